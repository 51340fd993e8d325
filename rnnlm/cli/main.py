"""``rnnlm COMMAND ...``, the installed command (``setup.cfg``'s console script), and the
``main()`` of each ``jobs/COMMAND.py`` (the files ``spark-submit`` runs): the same parsers
and the same code either way."""
from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from . import parsers, signals, stdout

# name: (what it does, where its code is, its job file)
COMMANDS = {
    "train": ("train a language model on Spark", "actions", "train.py"),
    "evaluate": ("perplexity of a checkpoint on a text (Spark)", "actions", "evaluate.py"),
    "generate": ("sample text from a checkpoint", "tools", "generate.py"),
    "plot": ("draw runs' metrics (no Spark)", "tools", "plot.py"),
    "download": ("fetch the public corpora, checksum-verified", "tools", "download_data.py"),
    "demo": ("train the demo model in one process (no Spark) and print samples", "tools", "demo.py"),
    "minicluster": ("run a real HDFS and YARN on this machine until Ctrl-C", "tools", "minicluster.py"),
    "package": ("build what spark-submit ships to a cluster (--py-files, --archives)", "tools", "package.py"),
}
EPILOG = ("Each command is also a file for spark-submit: jobs/train.py, jobs/evaluate.py, ... "
          "(`spark-submit jobs/train.py --config conf/demo.toml`).")


def _sentence(what: str) -> str:
    return what[0].upper() + what[1:] + "."


def _run(command: str, a) -> int:
    try:
        with stdout.guarded() as out:              # a closed pipe or a full disk on stdout: no traceback
            code = _call(command, a)
    except KeyboardInterrupt as e:                 # a signal while the last output was flushed
        return signals.report(e)
    return stdout.exit_code(out, code)


def _call(command: str, a) -> int:
    try:
        module = importlib.import_module(f".{COMMANDS[command][1]}", __package__)
        fn = getattr(module, command)
        if COMMANDS[command][1] == "actions":      # expected failures become one line and exit code 2
            return module.guarded(lambda: fn(a))
        return fn(a)
    except KeyboardInterrupt as e:                 # Ctrl-C or SIGTERM (signals.Stopped) at any other moment
        return signals.report(e)
    except Exception:
        if (stop := signals.stopped()) is None:     # a failure of the clean-up a signal began is the signal's
            raise
        return signals.report(stop)


def parser(command: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of one command."""
    ap = argparse.ArgumentParser(prog=prog, description=_sentence(COMMANDS[command][0]),
                                 formatter_class=parsers.Formatter)
    getattr(parsers, command)(ap)
    return ap


def job(command: str, argv=None, doc: str | None = None) -> int:
    """The ``main()`` of ``jobs/<file>.py``: ``doc`` (the job's docstring) is its help's description."""
    signals.install(command=True)
    ap = parser(command, prog=COMMANDS[command][2])
    if doc:
        ap.description = doc
    return _run(command, ap.parse_args(argv))


def main(argv=None) -> int:
    """The ``rnnlm`` command."""
    signals.install(command=True)
    ap = argparse.ArgumentParser(prog="rnnlm", description="Recurrent neural language models trained on Spark.",
                                 epilog=EPILOG, formatter_class=parsers.Formatter)
    ap.add_argument("--version", action="version", version=f"rnnlm {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (what, _, _) in COMMANDS.items():
        p = sub.add_parser(name, help=what, description=_sentence(what),
                           formatter_class=parsers.Formatter)
        getattr(parsers, name)(p)
    a = ap.parse_args(argv)
    return _run(a.command, a)


if __name__ == "__main__":
    sys.exit(main())
