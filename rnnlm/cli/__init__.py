"""The ``rnnlm`` command line: its parsers (:mod:`.parsers`), what each command does
(:mod:`.actions`, :mod:`.tools`) and the checks made before Spark starts (:mod:`.checks`).

The names below are what the jobs, tests and benchmarks call."""
from .actions import (EXPECTED, INTERRUPTED, evaluate, guarded, load_checkpoint, make_trainer,  # noqa: F401
                      read_checkpoint, train)
