"""What the jobs do, as importable functions (the jobs are thin ``main()``s)."""
from __future__ import annotations

import math
import sys

from . import checkpoint, config, corpus
from .hfs import HadoopFS
from .metrics import loss_fields
from .trainer import Trainer, TrainingError, evaluate_rdd, load_corpus

EXPECTED = (config.ConfigError, corpus.CorpusError, checkpoint.CheckpointError, TrainingError,
            FileNotFoundError)


def guarded(fn) -> int:
    """Run ``fn``; expected failures become one line on stderr and exit code 2."""
    try:
        return fn() or 0
    except EXPECTED as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def train(a) -> int:
    from .generate import generate
    from .model import RNNLM
    from .session import get_spark
    cfg = config.load(a.config, a.set)
    spark = get_spark("rnnlm-train", a.master)
    spark.sparkContext.setLogLevel("WARN")
    tr = Trainer(spark, cfg, a.out)
    last = tr.run(resume=a.resume)
    print(f"done: round {last['round']} | train_loss {last['train_loss']:.4f}"
          + (f" | valid_ppl {last['valid_ppl']:.2f}" if "valid_ppl" in last else "")
          + f" | checkpoint {tr.ck_path}")
    model = RNNLM(tr.cfg.model)
    for s in range(a.samples):
        print(f"--- sample {s + 1} ---")
        print(generate(model, tr.params, tr.vocab, length=300, temperature=0.8, seed=s))
    return 0


def evaluate(a) -> int:
    from .session import get_spark
    spark = get_spark("rnnlm-evaluate", a.master)
    spark.sparkContext.setLogLevel("WARN")
    ck = read_checkpoint(spark.sparkContext, a.checkpoint)
    cfg = config.replace(ck.config, "data", train=a.data, valid="", partitions=a.partitions,
                         strategy="streams")
    cfg = config.replace(cfg, "train", batch=1, bptt=1)
    data = load_corpus(spark.sparkContext, cfg, ck.vocab)
    loss = evaluate_rdd(spark.sparkContext, cfg, ck.params, data.train)
    data.train.unpersist()
    for k, v in loss_fields(loss, ck.config.data.level, "test").items():
        print(f"{k} {v:.4f}")
    print(f"ppl={math.exp(loss):.4f}")
    return 0


def read_checkpoint(sc, path: str) -> checkpoint.Checkpoint:
    """Load a checkpoint directory from any Hadoop path."""
    fs, path = HadoopFS(sc, path), path.rstrip("/")
    if not fs.exists(path):
        raise checkpoint.CheckpointError(f"checkpoint not found: {path}")
    return checkpoint.from_files(lambda n: fs.read(f"{path}/{n}"), path)
