"""What the tests share: fixtures, and helpers a test module imports (``from conftest import ROOT``:
pytest puts this folder on ``sys.path``, as it does for ``from test_hdfs import ...``)."""
import collections
import os
import sys
import time

import numpy as np
import pytest

from rnnlm.core import backend
from rnnlm.core.metrics import json_lines

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")   # Spark stays on loopback
# The tests' JVMs (a driver, its executors) live for seconds: HotSpot's C1 compiler alone, without C2's
# optimising recompiles, halves what each costs the CPU (a demo run: 29 CPU-s -> 15; docs/results.md,
# "The test suite's time").
# The driver reads SPARK_SUBMIT_OPTS; executors and YARN's ApplicationMaster take the system properties
# the driver's SparkConf loads (a properties file or --conf naming the key wins over them).
JIT = "-XX:TieredStopAtLevel=1"
if JIT not in os.environ.get("SPARK_SUBMIT_OPTS", ""):      # xdist's workers inherit the controller's
    os.environ["SPARK_SUBMIT_OPTS"] = " ".join([os.environ.get("SPARK_SUBMIT_OPTS", ""), JIT] + [
        f"-Dspark.{k}.extraJavaOptions={JIT}" for k in ("executor", "yarn.am", "driver")]).strip()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the repository
HARBOUR = os.path.join(ROOT, "rnnlm", "data", "harbour.txt")            # the project's own small corpus
HARBOUR_VALID = os.path.join(ROOT, "rnnlm", "data", "harbour_valid.txt")
SHARED_DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")     # the corpora beside the checkout (CI has them)
# a small, fast LSTM for a run of one machine (local[2]), and one for a run on a real cluster
TINY = ["model.hidden=16", "train.bptt=8", "train.batch=4", "train.local_steps=3"]
TINY_CLUSTER = ["model.hidden=24", "train.bptt=16", "train.batch=4", "train.local_steps=4"]
CLUSTER_RUN = [*TINY_CLUSTER, "train.eval_every=0", "data.valid="]      # such a run, no held-out text


def set_options(*sets) -> list:
    """A command line's ``--set`` options, one for each ``section.key=value``."""
    return [a for s in sets for a in ("--set", s)]


EXECUTOR_HOOK = '''import importlib.abc, importlib.util, os, sys, threading, time


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "rnnlm.spark.executor":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.train_and_encode = wrap(module.train_and_encode)
            if "wrap_scores" in globals():
                module.held_out_nll = wrap_scores(module.held_out_nll)
        spec.loader.exec_module = exec_module
        return spec


{wrap}

sys.meta_path.insert(0, _Hook())
'''


def executor_hook(directory, wrap: str) -> dict:
    """Test-only: a ``sitecustomize.py`` in ``directory`` (made) through which the Python processes that import
    it wrap ``rnnlm.spark.executor.train_and_encode`` (``wrap``: the source of ``def wrap(train)``, returning its
    replacement, and optionally of ``def wrap_scores(held_out_nll)``, the held-out scorer's); the environment's
    PYTHONPATH entry that makes a run's executors import it."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
        f.write(EXECUTOR_HOOK.format(wrap=wrap))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))}


# test-only: partition 1's first attempt of round 3 (an async run's window 2) blocks for ever, as a read that never
# returns would (an async worker's heartbeats' thread goes on); a retried attempt trains on. With
# RNNLM_TEST_BLOCKED_SCORES set, so does the first attempt of partition 1's first held-out scores.
BLOCKED = '''def _block_once(marker):
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass                                          # a retried attempt goes on
    else:
        threading.Event().wait()


def wrap(train):
    def blocked(*args, **kw):
        if args[8] == 3 and args[9] == 1:             # round 3 of partition 1
            _block_once(os.environ["RNNLM_TEST_BLOCKED"])
        return train(*args, **kw)
    return blocked


def wrap_scores(score):
    def blocked(*args, **kw):
        from pyspark import TaskContext
        ctx = TaskContext.get()
        if "RNNLM_TEST_BLOCKED_SCORES" in os.environ and ctx is not None and ctx.partitionId() == 1:
            _block_once(os.environ["RNNLM_TEST_BLOCKED_SCORES"])
        return score(*args, **kw)
    return blocked
'''


def blocked_at_round_3(tmp_path, scores: bool = False) -> dict:
    """The environment of a run whose executors block as :data:`BLOCKED` says (``tmp_path/blocked`` marks the
    first attempt blocked; with ``scores``, ``tmp_path/blocked_scores`` the first held-out scores' attempt)."""
    marker = {"RNNLM_TEST_BLOCKED_SCORES": str(tmp_path / "blocked_scores")} if scores else {}
    return dict(os.environ, RNNLM_TEST_BLOCKED=str(tmp_path / "blocked"), PYSPARK_PYTHON=sys.executable,
                **marker, **executor_hook(tmp_path / "hook", BLOCKED))


def tensorboard_scalars(directory) -> dict:
    """``{tag: [(step, value)]}`` of every event file in ``directory``, as TensorBoard's own reader reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def train_cmd(out, *sets, master: str | None = None, resume: bool = False) -> list:
    """``jobs/train.py`` on conf/demo.toml as a user runs it, writing ``out``, no samples printed (any cwd)."""
    return [sys.executable, os.path.join(ROOT, "jobs", "train.py"), "--config", os.path.join(ROOT, "conf", "demo.toml"),
            "--out", str(out), "--samples", "0", *(["--master", master] if master else []),
            *(["--resume"] if resume else []), *set_options(*sets)]


def wait_for(predicate, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout`` seconds (a loaded machine's
    threads can lag by a second: the default leaves room for it, a test that times something sets less)."""
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def metrics(run) -> list:
    """The metrics lines of the run directory ``run``, read as the project reads them."""
    with open(os.path.join(run, "metrics.jsonl"), "rb") as f:
        return json_lines(f.read())


def held_out_tokens(vocab, path: str):
    """A character-level text's tokens as the project reads held-out text, derived from the file alone:
    its characters, the last paragraph ending with a blank line (for texts whose paragraphs are
    separated by exactly one blank line, as the project's are)."""
    with open(path, encoding="utf-8") as f:
        return vocab.encode(f.read().rstrip("\n") + "\n\n")


def core_nll(model, params, streams) -> tuple:
    """Summed NLL and scored tokens of ``streams`` under ``params`` by the core model alone: each stream
    read whole in one forward pass from a zero state, every token after its first predicted once."""
    total, count = 0.0, 0
    for tokens in streams:
        tokens = np.asarray(tokens, np.int32)
        loss, n, _ = model.loss(params, tokens[:-1, None], tokens[1:, None], model.zero_state(1))
        total, count = total + float(loss), count + int(n)
    return total, count


XPS = [pytest.param("cpu", id="numpy")]
XPS.append(pytest.param("gpu", id="cupy", marks=pytest.mark.skipif(
    not backend.gpu_available(), reason="no CUDA device / CuPy")))


@pytest.fixture(params=XPS)
def xp(request):
    """NumPy, and CuPy when a CUDA device is present: kernel tests run on both."""
    return backend.get_xp(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture
def shared_data() -> str:
    """``../shared/data``: Penn Treebank and Tiny Shakespeare as published (skipped where absent, a
    failure in CI)."""
    if not os.path.isdir(SHARED_DATA):
        pytest.skip("../shared/data is not beside the checkout")
    return SHARED_DATA


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession shared by every Spark test (as pyspark.testing does)."""
    from rnnlm.spark.session import get_spark
    s = get_spark("rnnlm-tests", "local[2]", {"spark.ui.enabled": "false"})
    s.sparkContext.setLogLevel("ERROR")
    yield s
    s.stop()


def pytest_configure(config):
    """Under ``--dist loadgroup`` the groups go out in collection order (:func:`pytest_collection_modifyitems`'s),
    not xdist's default of the most tests first: that sent the Hadoop group, of few but long tests, out
    last, and one worker ran it alone for minutes at the end."""
    if getattr(config.option, "dist", "no") == "loadgroup":
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)      # before xdist's hook of this name, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Tests that need the Hadoop cluster run together: last in one process, so its JVM is up only while
    they run; first under ``-n 2 --dist loadgroup`` (CI), one worker's longest share, while the other
    worker takes the other modules whole (a module's tests share its fixtures and their assumptions),
    those marked slow last and one by one (each starts Spark or a cluster of its own, and a module of
    them whole kept one worker busy for minutes while the other had nothing left)."""
    # a worker's own options say dist "no" and loadgroup True (xdist rewrites them); the controller's say dist
    parallel = getattr(config.option, "loadgroup", False) or getattr(config.option, "dist", "no") == "loadgroup"

    def hadoop(item) -> bool:
        return item.get_closest_marker("hadoop") is not None

    def slow(item) -> bool:
        return item.get_closest_marker("slow") is not None
    if parallel:
        for i, item in enumerate(items):          # a group of one is named by its place (a test id holds "]")
            alone = slow(item) and not hadoop(item)
            item.add_marker(pytest.mark.xdist_group("hadoop" if hadoop(item) else f"{item.module.__name__}#{i}"
                                                    if alone else item.module.__name__))
        count = collections.Counter(item.module.__name__ for item in items)
        # the Hadoop group (its JVMs) beside the light modules, most tests first; the other slow ones (Spark
        # subprocesses, local clusters) last, when the Hadoop JVMs are gone: two at once compete for the cores
        items.sort(key=lambda item: (0, 0) if hadoop(item) else (1 + slow(item), -count[item.module.__name__]))
    else:
        items.sort(key=hadoop)


def pytest_runtest_setup(item):
    """Under ``--dist loadgroup`` a test whose id lacks its group fails: xdist would spread the Hadoop tests
    over both workers, each starting its own cluster (minutes longer, and silent). pytest 9.2 dropped the
    id that xdist 3.8 writes the group into (pytest-xdist#1386), hence setup.cfg's bound on pytest."""
    if getattr(item.config.option, "loadgroup", False) and "@" not in item.nodeid.rpartition("]")[2]:
        pytest.fail(f"--dist loadgroup did not group {item.nodeid} (see tests/conftest.py)", pytrace=False)


ALLOWED_SKIP = "no CUDA device"     # the one reason a test may skip in CI: the CuPy kernels on a machine without one


def _refuse_skip(report) -> None:
    """Where ``RNNLM_REQUIRE_HADOOP`` or ``RNNLM_REQUIRE_NETNS`` is set (CI sets both), a skip is a failure,
    whatever skipped it (a mark, a fixture, ``pytest.skip``, a lost extra), unless its reason starts with
    :data:`ALLOWED_SKIP`: a broken import or a missing corpus never passes as a skip there."""
    if not report.skipped or not (os.environ.get("RNNLM_REQUIRE_HADOOP") or os.environ.get("RNNLM_REQUIRE_NETNS")):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not reason.removeprefix("Skipped: ").startswith(ALLOWED_SKIP):
        report.outcome = "failed"
        report.longrepr = f"skipped where RNNLM_REQUIRE_HADOOP/RNNLM_REQUIRE_NETNS is set (CI): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's skip, judged by :func:`_refuse_skip`."""
    outcome = yield
    _refuse_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole module's skip (``pytest.skip(allow_module_level=True)``), judged by the same rule."""
    outcome = yield
    _refuse_skip(outcome.get_result())


@pytest.fixture(scope="session")
def hadoop(tmp_path_factory):
    """One real HDFS (2 DataNodes, WebHDFS) and YARN (2 NodeManagers) for the whole session.

    Without Java or Maven the tests that need it skip with the reason, unless
    ``RNNLM_REQUIRE_HADOOP`` is set (CI sets it: a skip there is a failure).
    """
    from rnnlm.hadoop.minicluster import MiniCluster, missing_tools
    problem = missing_tools()
    if problem:
        if os.environ.get("RNNLM_REQUIRE_HADOOP"):
            pytest.fail(problem)
        pytest.skip(problem)
    with MiniCluster(str(tmp_path_factory.mktemp("hadoop"))) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def webhdfs(hadoop):
    """An HdfsCLI client of the session's cluster, as the user the tests run as."""
    import getpass
    from hdfs import InsecureClient
    return InsecureClient(hadoop.endpoints.webhdfs, user=getpass.getuser())


@pytest.fixture
def tiny_cfg():
    """A small, fast character LSTM on the project's own text."""
    from rnnlm import config
    return config.load(None, [
        *TINY, "data.train=rnnlm/data/harbour.txt", "data.level=char", "data.partitions=2",
        "model.cell=lstm", "optim.name=adam", "optim.lr=0.01", "train.grad_norm=token",
        "train.rounds=2", "train.eval_every=0"])


def _central_differences(f, p, eps=1e-6):
    num = np.zeros(p.size)
    for i in range(p.size):
        q = p.copy()
        q[i] += eps
        lp = f(q)
        q[i] -= 2 * eps
        num[i] = float(lp - f(q)) / (2 * eps)      # f may return a 0-d device array
    return num


@pytest.fixture
def numeric_grad():
    """``numeric_grad(f, p)``: the central finite-difference gradient of the scalar ``f`` at ``p`` (float64)."""
    return _central_differences


@pytest.fixture
def netns_ok():
    """Network namespaces and tc usable (root, iproute2); else skip with the reason, or fail
    where ``RNNLM_REQUIRE_NETNS`` is set (CI sets it: a skip there is a failure)."""
    from rnnlm.netcluster import unavailable
    problem = unavailable()
    if problem:
        if os.environ.get("RNNLM_REQUIRE_NETNS"):
            pytest.fail(problem)
        pytest.skip(problem)
