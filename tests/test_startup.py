"""A run's start-up, as a user at a terminal meets it: every phase said, and Ctrl-C or SIGTERM at any
moment one line and exit 130 / 143, never a traceback."""
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

from rnnlm.cli.signals import children

from conftest import ROOT, train_cmd

STARTUP_RUN = ("model.hidden=16", "train.rounds=2", "train.eval_every=0")


def start(tmp_path, name):
    cmd = train_cmd(tmp_path / name, *STARTUP_RUN)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def signal_when(proc, signals, seen: str | None = None, lines=None, after: float = 0.0):
    """Send ``signals`` (0.3 s apart) ``after`` seconds once stdout shows a line starting with ``seen``, or
    with ``seen`` None once the process has started Spark's JVM (a child); the lines read go to ``lines``."""
    if seen is None:
        deadline = time.time() + 60
        while not children(proc.pid) and time.time() < deadline:
            time.sleep(0.01)
    else:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(seen):
                break
    for i, sig in enumerate(signals):
        time.sleep(0.3 if i else after)
        proc.send_signal(sig)


def outcome(proc, lines):
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + out, err


def test_a_signal_at_any_moment_of_start_up_is_one_line_and_the_shells_exit_code(tmp_path):
    """While the JVM starts, while the corpus is read (PySpark's own SIGINT handler, which cancels jobs
    through py4j from inside the call it interrupts, used to print 4 tracebacks; twice, 12) and twice in a
    row; the processes run side by side to share the JVMs' start."""
    cases = {"jvm": ([signal.SIGTERM], None, 143, "error: stopped (SIGTERM)"),
             "corpus": ([signal.SIGINT], "encoding and caching", 130, "error: stopped (Ctrl-C)"),
             "twice": ([signal.SIGINT, signal.SIGINT], "counting chars", 130, "error: stopped (")}
    procs, lines, senders = {}, {}, []
    for name, (sigs, seen, _, _) in cases.items():
        procs[name], lines[name] = start(tmp_path, name), []
        t = threading.Thread(target=signal_when, args=(procs[name], sigs, seen, lines[name]))
        t.start()
        senders.append(t)
    for t in senders:
        t.join(timeout=120)
    for name, (_, seen, code, last) in cases.items():
        rc, out, err = outcome(procs[name], lines[name])
        said = [x for x in err.splitlines() if x.startswith("error:")]
        assert rc == code and len(said) == 1 and said[0].startswith(last), (name, rc, err[-3000:])
        # what Spark logs of the jobs a stop drops (a block not put, a Python worker gone) is no news either
        noise = [x for x in err.splitlines() if any(w in x for w in ("Traceback", "ERROR", "Exception", " WARN "))
                 and "could not bind on port" not in x]       # the UI's port: three JVMs start side by side
        assert noise == [], (name, err[-3000:])
        if seen == "encoding and caching":       # every phase before it was said, in order
            assert out.startswith("reading rnnlm/data/harbour.txt ...\ncounting chars for the vocabulary ...\n"
                                  "encoding and caching 2 partitions ...\n"), out
        assert not os.path.exists(tmp_path / name / "checkpoint"), name      # nothing was trained


# test-only: the signal lands while the JVM makes the SparkContext (its web UI starting), 0.3 s into that call
MID_CONTEXT = """
import os, signal, threading
from pyspark.core.context import SparkContext
_make = SparkContext._initialize_context
def _signalled(self, jconf):
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return _make(self, jconf)
SparkContext._initialize_context = _signalled
"""


def test_a_signal_while_the_jvm_makes_the_spark_context_waits_for_it_then_stops_it_quietly(tmp_path):
    """A JVM stopped while it made the SparkContext logged the half-made context's errors after the command's
    line: its web UI's servlets interrupted, "Error initializing SparkContext", ~100 lines (under load, 2 of 17
    tries 3.6-4 s in). The signal is said and held until the context exists, and the session then stops."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(MID_CONTEXT)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYTHONPATH=f"{tmp_path / 'hook'}{os.pathsep}{ROOT}")
    r = subprocess.run(train_cmd(tmp_path / "run", *STARTUP_RUN), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=180)
    lines = [x for x in r.stderr.splitlines() if not x.startswith("WARNING: Using incubator modules")
             and "could not bind on port" not in x]       # the UI's port, where another JVM holds it
    assert (r.returncode, lines) == (143, ["SIGTERM: stopping once Spark has started (SIGTERM again to stop now)",
                                           "error: stopped (SIGTERM)"]), r.stderr[-3000:]
    assert not os.path.exists(tmp_path / "run" / "checkpoint")


def test_a_clean_up_that_fails_after_a_signal_is_still_the_signals_one_line_and_exit_code():
    """Ctrl-C inside a call into the JVM, then the session's stop failing with py4j's "Answer from Java
    side is empty" (seen once, under load, reading the corpus) was a traceback and exit code 1."""
    code = ("import os, signal, sys\n"
            "from rnnlm.cli import signals\nfrom rnnlm.cli.actions import guarded\n"
            "signals.install(command=True)\n"
            "def run():\n"
            "    try:\n        os.kill(os.getpid(), signal.SIGTERM)\n        signal.pause()\n"
            "    finally:\n        raise ConnectionError('Answer from Java side is empty')\n"
            "sys.exit(guarded(run))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr) == (143, "error: stopped (SIGTERM)\n")


def test_a_second_signal_during_the_clean_up_ends_the_command_at_once_and_its_children_with_it():
    """The first Ctrl-C raises, and clean-up runs (stopping Spark takes seconds, more under load); a second one
    then ends the command at once, in one line, and kills its children (Spark's JVM, which would otherwise log
    its tasks' deaths after that line). The clean-up here waits for a minute, the child is a sleeping process."""
    code = ("import os, signal, subprocess, sys, time\n"
            "from rnnlm.cli import signals\nfrom rnnlm.cli.actions import guarded\n"
            "signals.install(command=True)\n"
            "child = subprocess.Popen(['sleep', '600'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "def run():\n"
            "    try:\n        print(child.pid, flush=True)\n        signal.pause()\n"
            "    finally:\n        print('cleaning', flush=True)\n        time.sleep(60)\n"
            "sys.exit(guarded(run))\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    child = None
    try:
        child = int(p.stdout.readline())
        p.send_signal(signal.SIGINT)
        assert p.stdout.readline() == "cleaning\n"
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
        deadline = time.monotonic() + 10      # killed: gone, or a zombie until whoever adopted it reaps it
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        left = _alive(child)
    finally:
        p.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
    assert (p.returncode, out, err) == (130, "", "error: stopped (Ctrl-C again, without clean-up)\n")
    assert took < 10 and not left, (took, left)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_signal_inside_an_at_fork_hook_or_a_finaliser_still_stops_the_command():
    """CI saw it once: SIGTERM as PySpark's Popen forked the JVM ran the handler inside logging's at-fork
    hook (``_releaseLock``), where Python prints an exception as "Exception ignored" and drops it. Here the
    signal lands in such a hook (a fork with a preexec_fn, as PySpark's) and in a ``__del__``; after it,
    a loop that would otherwise finish and print must not."""
    for where in ("fork", "finaliser"):
        code = ("import os, signal, subprocess, sys, time\n"
                "from rnnlm.cli import signals\nfrom rnnlm.cli.actions import guarded\n"
                "signals.install(command=True)\n"
                "def hit():\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(1)\n"
                "class Hit:\n    def __del__(self):\n        hit()\n"
                "os.register_at_fork(after_in_parent=hit)\n"
                "def run():\n"
                f"    if {where == 'fork'}:\n"
                "        subprocess.Popen(['true'], preexec_fn=lambda: None).wait()\n"
                "    else:\n        h = Hit()\n        del h\n"
                "    for _ in range(10 ** 6):\n        pass\n"
                "    print('not stopped')\n"
                "sys.exit(guarded(run))\n")
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert (p.returncode, p.stdout, p.stderr) == (143, "", "error: stopped (SIGTERM)\n"), where


def test_an_ordinary_exception_in_a_finaliser_is_still_printed_and_the_command_goes_on():
    """Only a signal's Stopped is raised again: anything else a finaliser raises goes to Python's own hook."""
    code = ("import sys\nfrom rnnlm.cli import signals\n"
            "signals.install(command=True)\n"
            "class Bad:\n    def __del__(self):\n        raise ValueError('in a finaliser')\n"
            "b = Bad()\ndel b\nprint('went on')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, "went on\n"), p.stderr
    assert "Exception ignored in" in p.stderr and "ValueError: in a finaliser" in p.stderr, p.stderr


def test_the_spark_sessions_install_keeps_a_signal_already_received():
    """The session installs the handlers again once PySpark has put its own in place: a signal received
    before that is still the command's (a second one exits at once, logging stays off)."""
    code = ("import logging, os, signal\nfrom rnnlm.cli import signals\n"
            "signals.install(command=True)\n"
            "try:\n    os.kill(os.getpid(), signal.SIGTERM)\n    for _ in range(10 ** 6):\n        pass\n"
            "except signals.Stopped:\n    pass\n"
            "signals.install()\n"
            "print(signals.stopped(), logging.root.manager.disable)\n"
            "signals.install(command=True)\n"            # the next command in this process (a notebook's)
            "print(signals.stopped(), logging.root.manager.disable)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, f"SIGTERM {logging.CRITICAL}\nNone {logging.NOTSET}\n"), p.stderr


def test_a_plain_keyboard_interrupt_is_ctrl_c_and_a_sigterm_its_own_code():
    from rnnlm.cli import signals
    assert signals.exit_code(KeyboardInterrupt()) == 130 and signals.message(KeyboardInterrupt()) == "stopped (Ctrl-C)"
    term = signals.Stopped(signal.SIGTERM)
    assert signals.exit_code(term) == 143 and signals.message(term) == "stopped (SIGTERM)"


def test_spark_starts_from_a_checkout_whose_path_holds_a_space(tmp_path):
    """The log4j option named the checkout's path unquoted: Spark's launcher split it at the space, the JVM took
    the second half for its main class ("Could not find or load main class ace.rnnlm.data.log4j2.properties"),
    and every Spark command failed there."""
    import shutil
    checkout = tmp_path / "my projects" / "rnnlm checkout"
    shutil.copytree(os.path.join(ROOT, "rnnlm"), checkout / "rnnlm", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("from rnnlm.spark.session import get_spark\n"
            "s = get_spark('space', 'local[1]', {'spark.ui.enabled': 'false'})\n"
            "print(s.sparkContext.parallelize(range(5)).sum())\ns.stop()\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=dict(os.environ, PYTHONPATH=str(checkout)),
                       capture_output=True, text=True, timeout=180)
    assert (r.returncode, r.stdout) == (0, "10\n"), r.stderr[-2000:]


def test_a_signal_under_the_corpus_jobs_stops_them_without_a_word_from_spark(tmp_path, shared_data):
    """Ctrl-C while Spark counts or encodes PTB's words, its tasks running: the stop under them logged a WARN
    and an ERROR per task whose Python worker went with it, or a broadcast gone under a task's listener
    (3 of 4 tries, 0.5 and 1.5 s into either phase); the harbour text's phases are too short to meet them."""
    procs, lines, senders = {}, {}, []
    for phase in ("counting", "encoding"):
        cmd = [sys.executable, "jobs/train.py", "--config", "conf/ptb_word_small.toml", "--master", "local[1]",
               "--out", str(tmp_path / phase), "--samples", "0", "--set", f"data.train={shared_data}/ptb.train.txt",
               "--set", "data.valid=", "--set", "data.test=", "--set", "train.rounds=1000"]
        procs[phase] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=dict(os.environ, PYSPARK_PYTHON=sys.executable, PYTHONUNBUFFERED="1"))
        lines[phase] = []
        senders.append(threading.Thread(target=signal_when, args=(procs[phase], [signal.SIGINT], phase,
                                                                  lines[phase], 0.5)))
        senders[-1].start()
    for t in senders:
        t.join(timeout=120)
    for phase, proc in procs.items():
        rc, out, err = outcome(proc, lines[phase])
        assert lines[phase][-1].startswith(phase) and rc == 130, (phase, rc, out, err[-3000:])
        # Spark's log (its lines start with a date): a worker forked by PySpark's daemon may still print its
        # broken pipe's traceback as the JVM drops it (seen once under CI's load): not Spark's log, not ours
        logged = [x for x in err.splitlines() if re.match(r"\d\d/\d\d/\d\d \d\d:\d\d:\d\d ", x)
                  and "could not bind on port" not in x]
        said = [x for x in err.splitlines() if x.startswith("error:")]
        assert logged == [] and said == ["error: stopped (Ctrl-C)"], (phase, err[-3000:])


def test_a_stop_that_cancels_a_job_group_just_ended_says_nothing():
    """A run stopping (SIGTERM, with overlap) cancels its job group, whose last job may have just ended: Spark 4
    logged "WARN DAGScheduler: Failed to cancel job group ... Cannot find active jobs for it" before the run's
    one line. The driver's log configuration drops that warning alone."""
    code = ("from rnnlm.spark.session import get_spark\n"
            "s = get_spark('t', 'local[1]')\ns.sparkContext.setLogLevel('WARN')\n"
            "s.sparkContext.cancelJobGroup('rnnlm train runs/x')\n"
            "s.sparkContext._jvm.org.apache.log4j.LogManager.getLogger('org.apache.spark.scheduler.DAGScheduler')"
            ".warn('another warning')\ns.stop()\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, PYSPARK_PYTHON=sys.executable))
    # another test's session may hold the UI's port (CI runs two at once): Spark says it took the next one
    said = [x for x in r.stderr.splitlines() if " WARN " in x and "could not bind on port" not in x]
    assert r.returncode == 0 and len(said) == 1 and said[0].endswith("WARN DAGScheduler: another warning"), r.stderr
