"""The ``rnnlm`` command line: its parsers (:mod:`.parsers`), what each command does
(:mod:`.actions`, :mod:`.tools`), the checks made before Spark starts (:mod:`.checks`) and the
Spark session the commands start (:mod:`.session`).

The names below are what the jobs, tests and benchmarks call, loaded on first use: a command that
needs neither NumPy nor Spark (``minicluster``: Java and Maven only) must start, and fail with its
own one-line message, where neither is installed; only :mod:`.actions` (``train``, ``evaluate``)
imports pyspark, so ``demo``, ``generate`` and ``plot`` run where it is not installed."""
import importlib

# name -> the module holding it: only .actions (Spark's commands) imports pyspark
_NAMES = {**dict.fromkeys(("EXPECTED", "evaluate", "guarded", "make_trainer", "train"), ".actions"),
          "load_checkpoint": ".checks", "read_checkpoint": ".session"}
__all__ = list(_NAMES)


def __getattr__(name):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
