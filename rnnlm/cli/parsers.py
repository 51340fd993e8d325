"""The arguments of every command, shared by ``rnnlm COMMAND`` and ``jobs/COMMAND.py``.

Every option has a help text, and every default is shown in ``--help`` (an option without a
value, as ``--resume``, is off unless given).
"""
from __future__ import annotations

import argparse
import re

TRAIN_OUT = "runs/latest"


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Help with ``(default: X)`` after each option that has a value by default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, [], "", argparse.SUPPRESS):
            return text
        if not action.option_strings and action.nargs not in ("?", "*"):
            return text
        return f"{text} (default: %(default)s)"


def _int_in(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi] (hi None: no bound), else argparse's one-line error
    naming the option (a negative --seed was NumPy's "expected non-negative integer", a --length of
    10^12 ran out of memory)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r:.40}") from None
        if value < lo or (hi is not None and value > hi):
            digits = len(str(abs(value)))
            shown = str(value) if digits <= 12 else f"{'-' * (value < 0)}a number of {digits} digits"
            raise argparse.ArgumentTypeError(f"{shown} is out of range [{lo}, {'inf' if hi is None else hi}]")
        return value
    parse.__name__ = "integer"          # what argparse names in its errors
    return parse


MAX_LENGTH = 1_000_000          # tokens generate samples: 10x a novel, well within memory
MAX_SAMPLES = 1000


_MASTERS = re.compile(r"local|local\[([0-9]+|\*)(\s*,\s*[0-9]+)?\]"
                      r"|local-cluster\[\s*[0-9]+\s*,\s*[0-9]+\s*,\s*[0-9]+\s*\]|yarn|spark://.+|k8s://.+")


def master_url(text: str) -> str:
    """A master URL Spark takes (what ``spark-submit`` and ``SparkContext`` parse), checked before its JVM
    starts: a typo there was a Java stack trace and a one-line error naming something else."""
    m = _MASTERS.fullmatch(text)
    if m is None or (m.group(1) or "1").strip("0") == "":             # local[0]: no thread to run on
        raise argparse.ArgumentTypeError(
            f"{text!r:.60} is not a Spark master: local, local[N], local[*], local[N,F], local-cluster[W,C,MB], "
            "yarn, spark://HOST:PORT or k8s://URL")
    return text


master_url.__name__ = "master"


def _spark(ap) -> None:
    ap.add_argument("--master", default=None, type=master_url,
                    help="Spark master when not run by spark-submit (default: the one $PYSPARK_SUBMIT_ARGS or "
                         "spark-defaults.conf names, else local[2]; under spark-submit, its --master)")
    ap.add_argument("--verbose", action="store_true", help="Spark's INFO logging (silenced by default)")


def train(ap) -> None:
    ap.add_argument("--config", required=True, metavar="TOML", help="the run's configuration (conf/*.toml)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one configuration key, such as train.rounds=5 (repeatable)")
    ap.add_argument("--out", default=TRAIN_OUT, metavar="PATH",
                    help="run directory, any Hadoop path: run.json, metrics.jsonl, checkpoint/")
    again = ap.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    again.add_argument("--overwrite", action="store_true",
                       help="start again in an --out that holds a run (deletes its metrics, run.json, checkpoint)")
    ap.add_argument("--init-from", default=None, metavar="RUN|RUN/best|CHECKPOINT",
                    help="start a new run (round 1 on, in its own --out) from these weights and their "
                         "vocabulary, for fine-tuning or another learning rate; any Hadoop path "
                         "(default: fresh weights)")
    ap.add_argument("--keep-optimizer", action="store_true",
                    help="with --init-from: its optimizer state too (default: fresh)")
    ap.add_argument("--samples", type=_int_in(0, MAX_SAMPLES), default=1, metavar="N",
                    help="text samples to print at the end")
    ap.add_argument("--log", action="append", default=[], metavar="TRACKER",
                    help="every metrics line also to tensorboard[:DIR] (default DIR: OUT/tensorboard) or mlflow "
                         "(MLFLOW_TRACKING_URI; needs mlflow-skinny); repeatable")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the resolved configuration, the parameter count and the bytes a round moves "
                         "(measured on four rounds in a scratch directory, then deleted); keep and write nothing")
    ap.add_argument("--bandwidth", default=None, metavar="RATE",
                    help="with --dry-run: predict a round's sync time on host links of this rate (100mbit, 1gbit; "
                         "default: no prediction)")
    ap.add_argument("--latency", default=None, metavar="TIME",
                    help="with --bandwidth: one-way link latency (1ms; default: 0ms)")
    _spark(ap)


def evaluate(ap) -> None:
    ap.add_argument("--checkpoint", required=True, metavar="PATH",
                    help="a checkpoint, or a run directory (train's --out)")
    ap.add_argument("--data", required=True, metavar="PATH", help="the text to score, any Hadoop path")
    ap.add_argument("--streams", "--partitions", dest="streams", type=int, default=None, metavar="N",
                    help="contiguous streams evaluated in parallel (default: the checkpoint's data.eval_streams, "
                         "as in its training log; 1 = the whole text as one stream)")
    ap.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                    help="where the streams are scored (default auto: a GPU where Spark assigns one and CuPy finds "
                         "it, else the CPU), whatever device the checkpoint trained on")
    _spark(ap)


def generate(ap) -> None:
    ap.add_argument("--checkpoint", required=True, metavar="PATH",
                    help="a checkpoint, or a run directory (train's --out)")
    ap.add_argument("--prime", default="", help="text the sample continues (default: none)")
    ap.add_argument("--length", type=_int_in(0, MAX_LENGTH), default=300, metavar="N", help="tokens to sample")
    ap.add_argument("--temperature", type=float, default=1.0, metavar="T",
                    help="below 1 sharper, above 1 flatter than the model")
    ap.add_argument("--argmax", action="store_true", help="always the likeliest token (no sampling)")
    ap.add_argument("--seed", type=_int_in(0), default=None, metavar="S",
                    help="the sampler's seed (default: a new one each call, printed to repeat it)")


def plot(ap) -> None:
    ap.add_argument("--runs", nargs="+", required=True, metavar="DIR",
                    help="runs (train's --out) or folders of runs; webhdfs://host:port/path reads HDFS")
    ap.add_argument("--kind", choices=("metric", "frontier", "sync"), default="metric",
                    help="metric: --y against --x per run; frontier: best/final --y against bytes per token; "
                         "sync: sync fraction against K per codec")
    ap.add_argument("--x", choices=("tokens", "syncs", "bytes", "wall"), default="tokens", help="the x axis")
    ap.add_argument("--y", default="train_loss", help="a metrics key: train_loss, valid_ppl, valid_bpc, ...")
    ap.add_argument("--pick", choices=("best", "final"), default="best", help="frontier: which value of a run")
    ap.add_argument("--log-x", action="store_true", help="a logarithmic x axis")
    ap.add_argument("--labels", nargs="+", default=None, metavar="NAME",
                    help="one legend label per run, in the order the runs are found (default: what differs "
                         "in their configurations)")
    ap.add_argument("--out", required=True, metavar="FIG", help="FIG.png, .svg or .pdf")


def download(ap) -> None:
    from ..download import CORPORA
    ap.add_argument("corpora", nargs="*", metavar="CORPUS", help=f"any of {', '.join(CORPORA)} (default: all)")
    ap.add_argument("--dest", default="data", metavar="DIR", help="where the corpora go")
    ap.add_argument("--mirror", default=None, metavar="DIR",
                    help="copy from this folder instead of the network (default: download)")


def demo(ap) -> None:
    ap.add_argument("--config", default=None, metavar="TOML",
                    help="the run's configuration (default: conf/demo.toml of this checkout)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one configuration key, such as train.rounds=5 (repeatable)")
    ap.add_argument("--out", default=None, metavar="DIR", help="checkpoint directory to write (default: none)")
    ap.add_argument("--prime", default="The light", help="text the samples continue")


def package(ap) -> None:
    ap.add_argument("--out", default="dist/rnnlm.zip", metavar="ZIP", help="the zip for --py-files")
    ap.add_argument("--env", metavar="ENV.tar.gz",
                    help="also pack a virtual environment with NumPy (needs venv-pack: the cluster extra; "
                         "default: none)")


def minicluster(ap) -> None:
    ap.add_argument("--dir", help="working directory: cluster files, conf/, minicluster.log (required unless "
                                  "--build)")
    ap.add_argument("--build", action="store_true", help="fetch the jars and compile the launcher, then exit")
    ap.add_argument("--datanodes", type=int, default=2, choices=range(1, 5), metavar="{1..4}",
                    help="HDFS DataNodes")
    ap.add_argument("--nodemanagers", type=int, default=2, choices=range(1, 5), metavar="{1..4}",
                    help="YARN NodeManagers")
    ap.add_argument("--nm-memory-mb", type=_int_in(1024, 1 << 20), default=3072, metavar="MB",
                    help="memory each NodeManager offers YARN (at least 1024: a Spark container needs ~900 MB)")
