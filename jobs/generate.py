"""Sample text from a checkpoint.

    python jobs/generate.py --checkpoint DIR [--prime TEXT] [--length N]
                            [--temperature T] [--argmax] [--seed S]

DIR is a checkpoint or a training run's directory (the ``--out`` of train). A local DIR is read
with plain Python; any other Hadoop path (``hdfs://...``, or a path without a scheme while
``$HADOOP_CONF_DIR`` names HDFS as the default filesystem) through a local Spark JVM.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.cli import load_checkpoint  # noqa: E402
from rnnlm.core import checkpoint  # noqa: E402
from rnnlm.core.generate import generate  # noqa: E402
from rnnlm.core.model import build as build_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a checkpoint, or a run directory (train's --out)")
    ap.add_argument("--prime", default="")
    ap.add_argument("--length", type=int, default=300)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--argmax", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        ck = load_checkpoint(a.checkpoint)
        model = build_model(ck.config.model)
        text = generate(model, ck.params, ck.vocab, prime=a.prime, length=a.length,
                        temperature=a.temperature, argmax=a.argmax, seed=a.seed)
    except (checkpoint.CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(ck.vocab.join(a.prime, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
