"""The ``rnnlm`` command line: its parsers (:mod:`.parsers`), what each command does
(:mod:`.actions`, :mod:`.tools`) and the checks made before Spark starts (:mod:`.checks`).

The names below are what the jobs, tests and benchmarks call. They load :mod:`.actions` on first
use: a command that needs neither NumPy nor Spark (``minicluster``: Java and Maven only) must
start, and fail with its own one-line message, where neither is installed."""
import importlib

_ACTIONS = ("EXPECTED", "INTERRUPTED", "evaluate", "guarded", "load_checkpoint", "make_trainer",
            "read_checkpoint", "train")
__all__ = list(_ACTIONS)


def __getattr__(name):
    if name in _ACTIONS:
        return getattr(importlib.import_module(".actions", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
