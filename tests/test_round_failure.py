"""A round whose task raises in Python (a bug, a MemoryError on an executor): from PySpark 4 the
driver gets a ``PythonException``, not py4j's error, and the trainer caught only the latter, so the
run ended in a traceback instead of its one line. The round's task is swapped for one that raises;
it travels to the Python workers by value, as the lineage tests' toy round does."""
import sys

import pytest
from pyspark import cloudpickle

from rnnlm import config
from rnnlm.spark import allreduce
from rnnlm.spark.rundir import TrainingError
from rnnlm.spark.trainer import Trainer

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def raising_round_task(*args, **kwargs):
    def run(it):
        raise MemoryError("no room for the gates")
        yield                                # a generator, as mapPartitions expects
    return run


def test_a_round_whose_task_raises_stops_the_run_with_one_line(spark, tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(allreduce.executor, "round_task", raising_round_task)
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), ["train.rounds=2"]))
    with pytest.raises(TrainingError, match=r"^round 1: the Spark job failed: MemoryError: no room for the gates; "
                                            r"stopped, "):
        Trainer(spark, cfg, str(tmp_path / "run"), log=lambda s: None).run()
