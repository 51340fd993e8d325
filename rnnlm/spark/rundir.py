"""A run's output directory: the names both drivers share (the synchronous :mod:`.trainer` and
the parameter server's :mod:`.async_trainer`)."""
from __future__ import annotations

from .. import config


# a change in any of these makes a resumed run a different experiment
RESUME_KEYS = {"data": None, "model": None, "optim": None, "exchange": None,
               "train": ("mode", "seed", "bptt", "batch", "grad_norm", "local_steps", "tree_depth", "outer",
                         "outer_lr", "outer_momentum", "optim_state")}


BEST = "best"      # <out>/best: the checkpoint of the lowest validation loss


class TrainingError(RuntimeError):
    """Training stopped (non-finite loss, incompatible resume); the message is one line."""


def check_resume(cfg: config.Config, saved: config.Config, where: str) -> None:
    """Refuse to resume the run saved with ``saved`` under ``cfg`` when a key that makes it another
    experiment differs (:data:`RESUME_KEYS`)."""
    mine, theirs = cfg.to_dict(), saved.to_dict()
    for sec, keys in RESUME_KEYS.items():
        for k in (keys or mine[sec].keys()):
            if sec == "model" and k == "vocab_size":
                continue
            if mine[sec][k] != theirs[sec][k]:
                raise TrainingError(f"cannot resume: {sec}.{k} is {mine[sec][k]!r} here but "
                                    f"{theirs[sec][k]!r} in {where}")


def best_record(saved) -> dict | None:
    """A checkpoint's record of its run's best round, or None (none yet, or a checkpoint from before
    ``best/``: the next evaluation then starts the record again)."""
    if (isinstance(saved, dict) and type(saved.get("round")) is int
            and isinstance(saved.get("valid_loss"), (int, float))):
        return {"round": saved["round"], "valid_loss": float(saved["valid_loss"])}
    return None


def improves(best: dict | None, valid_loss: float) -> bool:
    """Whether ``valid_loss`` beats the run's best so far (the first evaluation does)."""
    return best is None or valid_loss < best["valid_loss"]
