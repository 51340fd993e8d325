"""Learning-rate schedules, and a run's length: its rounds, and where ``train.patience`` ends it early.

A schedule maps the epoch (epochs trained, from 0: passes over the data) to a rate; the
plateau schedule also observes validation losses. Its state is a small dict of
floats, saved in checkpoints.
"""
from __future__ import annotations

import math

from ..config import OptimConfig, TrainConfig


def rounds_for(epochs: float, per_epoch: float, per_round: float) -> int:
    """The rounds that train ``epochs`` epochs, each ``per_epoch`` (steps or tokens) where a round
    trains ``per_round``: a whole number of rounds' worth (13 passes of one-pass rounds, 2.2 epochs
    of 25 steps in rounds of one) is not rounded up by the quotient's last bit."""
    return max(1, math.ceil(epochs * per_epoch / per_round * (1 - 1e-12)))


def improves(best: dict | None, valid_loss: float) -> bool:
    """Whether ``valid_loss`` beats the run's best so far (``{"round", "valid_loss"}``; the first evaluation does)."""
    return best is None or valid_loss < best["valid_loss"]


def early_stop(t: TrainConfig, at: int, best: dict | None) -> str | None:
    """Why a run of rounds ends at round ``at``, an evaluation's, before its length: ``t.patience`` evaluations
    after the round ``best`` holds (``{"round", "valid_loss"}``) without a lower validation loss; else None.
    Evaluations are every ``t.eval_every`` rounds: an earlier, shorter run's last round, evaluated off that
    cadence, is not one of them, as a run that had not ended there made none. Read from the round and the
    best alone (a checkpoint's position holds both), so a resumed run ends where the uninterrupted one did."""
    if not (t.patience and t.eval_every and best is not None and at % t.eval_every == 0):
        return None
    since = at // t.eval_every - best["round"] // t.eval_every
    if since < t.patience:
        return None
    return (f"{since} evaluation{'s' * (since != 1)} since round {best['round']} without a lower validation loss "
            f"than its {best['valid_loss']:.4f} (train.patience = {t.patience})")


class Schedule:
    """``lr(epoch)``; ``observe(valid_loss)`` after each evaluation."""

    def __init__(self, cfg: OptimConfig, state: dict | None = None):
        self.cfg = cfg
        self.state = dict(state) if state else {"lr": cfg.lr, "best": math.inf}

    def lr(self, epoch: float) -> float:
        c = self.cfg
        if c.schedule == "epoch_decay":
            # Zaremba: epochs 1..decay_after at lr, then x decay per epoch
            k = max(0, math.floor(epoch) + 1 - c.decay_after)
            return max(c.min_lr, c.lr * c.decay ** k)
        if c.schedule == "plateau":
            return self.state["lr"]
        return c.lr

    def observe(self, valid_loss: float) -> None:
        """Record a validation loss; the plateau schedule decays when it did not improve."""
        if self.cfg.schedule != "plateau":
            return
        if valid_loss < self.state["best"]:
            self.state["best"] = valid_loss
        else:
            self.state["lr"] = max(self.cfg.min_lr, self.state["lr"] * self.cfg.decay)
