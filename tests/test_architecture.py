"""The tree's layers, bottom up: the numerical core, the exchange layer, the async server, Spark;
the three below Spark, and the commands that start no Spark job, run without it."""
import ast
import os
import subprocess
import sys

from conftest import ROOT

PKG = os.path.join(ROOT, "rnnlm")


def imports_in(source):
    """Every module a source imports, relative ones with their dots, and every name imported from a
    package as its own module: ``from .. import spark`` is ``..spark``, ``from rnnlm import spark``
    is ``rnnlm`` and ``rnnlm.spark``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if node.module:
                yield base
            yield from (base + ("." if node.module else "") + a.name for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def violations(pkg):
    """``(layer, file, module)`` for every import of a layer above in the package at ``pkg``, and
    how many imports were checked: core imports nothing of exchange, server or spark; exchange nothing
    of server or spark; server nothing of spark."""
    below = {"core": ("exchange", "server", "spark"), "exchange": ("server", "spark"), "server": ("spark",)}
    found, checked = [], 0
    for layer, forbidden in below.items():
        for f in sorted(os.listdir(os.path.join(pkg, layer))):
            if not f.endswith(".py"):
                continue
            with open(os.path.join(pkg, layer, f)) as src:
                names = list(imports_in(src.read()))
            checked += len(names)
            found += [(layer, f, name) for name in names
                      if any(name.startswith((f"..{other}", f"rnnlm.{other}")) for other in forbidden)
                      or name in ("pyspark", "py4j") or name.startswith(("pyspark.", "py4j."))]
    return found, checked


def test_layers_import_downwards_only():
    found, checked = violations(PKG)
    assert found == [] and checked > 20


def test_the_layer_check_sees_every_form_of_import(tmp_path):
    """``from .. import spark`` once read as ``..`` and passed (core/single.py uses that form for config)."""
    (tmp_path / "core").mkdir()
    (tmp_path / "exchange").mkdir()
    (tmp_path / "server").mkdir()
    (tmp_path / "core" / "a.py").write_text("from .. import spark\nfrom .. import config\nfrom . import model\n")
    (tmp_path / "core" / "b.py").write_text("from ..exchange.plan import encode\nfrom ..server import wire\n")
    (tmp_path / "exchange" / "c.py").write_text("import pyspark.sql\nfrom rnnlm import spark\n"
                                                "from py4j import java_gateway\nfrom ..server import wire\n")
    (tmp_path / "server" / "d.py").write_text("from ..exchange.blocks import Block\nfrom rnnlm.spark import trainer\n")
    found, checked = violations(str(tmp_path))
    assert found == [("core", "a.py", "..spark"), ("core", "b.py", "..exchange.plan"),
                     ("core", "b.py", "..exchange.plan.encode"), ("core", "b.py", "..server"),
                     ("core", "b.py", "..server.wire"), ("exchange", "c.py", "pyspark.sql"),
                     ("exchange", "c.py", "rnnlm.spark"), ("exchange", "c.py", "py4j"),
                     ("exchange", "c.py", "py4j.java_gateway"), ("exchange", "c.py", "..server"),
                     ("exchange", "c.py", "..server.wire"), ("server", "d.py", "rnnlm.spark"),
                     ("server", "d.py", "rnnlm.spark.trainer")]
    assert checked == 18


def test_run_loading_and_plots_start_no_spark():
    """A notebook on a laptop reads runs and draws without pyspark or a JVM."""
    code = ("import sys\n"
            "import rnnlm.runs, rnnlm.plots\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('pyspark', 'py4j')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# a subprocess's first lines: pyspark and py4j cannot be imported, as where they are not installed
NO_SPARK = ("import sys\n"
            "class NoSpark:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('pyspark', 'py4j'):\n"
            "            raise ImportError('No module named ' + repr(name))\n"
            "sys.meta_path.insert(0, NoSpark())\n")


def test_the_layers_below_spark_and_the_commands_without_it_import_no_pyspark():
    """Every module of the core, the exchange layer, the async server and the command line but
    :mod:`rnnlm.cli.actions` (``train`` and ``evaluate``, Spark's commands) imports where pyspark cannot
    be imported."""
    code = NO_SPARK + (
        "import importlib, pkgutil\n"
        "import rnnlm.core, rnnlm.exchange, rnnlm.server, rnnlm.cli\n"
        "names = [p.__name__ + '.' + m.name for p in (rnnlm.core, rnnlm.exchange, rnnlm.server, rnnlm.cli)\n"
        "         for m in pkgutil.iter_modules(p.__path__)]\n"
        "for name in names:\n"
        "    if name != 'rnnlm.cli.actions':\n"
        "        importlib.import_module(name)\n"
        "print(len(names))\n"
        "try:\n"
        "    import rnnlm.cli.actions\n"
        "except ImportError as e:\n"
        "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    count, blocked = r.stdout.splitlines()
    assert int(count) > 20 and blocked.startswith("No module named 'py")      # the block holds


def test_demo_and_generate_run_without_pyspark(tmp_path):
    """``rnnlm demo`` ("the core alone, no Spark") trains and samples, and ``rnnlm generate`` samples
    from the checkpoint it wrote, where pyspark cannot be imported."""
    def rnnlm(*argv):
        code = NO_SPARK + f"from rnnlm.cli.main import main\nsys.exit(main({list(argv)!r}))\n"
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    demo = rnnlm("demo", "--out", str(tmp_path / "ck"), "--set", "model.hidden=16", "--set", "train.rounds=2",
                 "--set", "train.eval_every=0")
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout.count("--- sample (temperature") == 2
    gen = rnnlm("generate", "--checkpoint", str(tmp_path / "ck"), "--prime", "The ", "--length", "30", "--seed", "3")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("The ") and len(gen.stdout.rstrip("\n")) == 34
