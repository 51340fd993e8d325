"""The tree's layers: the numerical core and the exchange layer run without Spark."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "rnnlm")


def imports_of(path):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            yield "." * node.level + (node.module or "")
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_core_and_exchange_never_import_pyspark():
    code = ("import importlib, pkgutil, sys\n"
            "import rnnlm.core, rnnlm.exchange\n"
            "for pkg in (rnnlm.core, rnnlm.exchange):\n"
            "    for m in pkgutil.iter_modules(pkg.__path__):\n"
            "        importlib.import_module(pkg.__name__ + '.' + m.name)\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('pyspark', 'py4j')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_layers_import_downwards_only():
    """core imports nothing of exchange or spark; exchange nothing of spark."""
    below = {"core": ("exchange", "spark"), "exchange": ("spark",)}
    checked = 0
    for layer, forbidden in below.items():
        for f in os.listdir(os.path.join(PKG, layer)):
            if not f.endswith(".py"):
                continue
            for name in imports_of(os.path.join(PKG, layer, f)):
                checked += 1
                for other in forbidden:
                    assert not (name.startswith(f"..{other}") or name.startswith(f"rnnlm.{other}")
                                or name in ("pyspark", "py4j") or name.startswith("pyspark.")), (layer, f, name)
    assert checked > 20


def test_run_loading_and_plots_start_no_spark():
    """A notebook on a laptop reads runs and draws without pyspark or a JVM."""
    code = ("import sys\n"
            "import rnnlm.runs, rnnlm.plots\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('pyspark', 'py4j')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
