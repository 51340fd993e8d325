"""Ctrl-C and SIGTERM from a command's first line to its last: one line and exit 130 / 143, never a
traceback (a run's own graceful stop, between rounds, is :class:`rnnlm.spark.stop.StopRequest`).

The first signal raises :class:`Stopped` in the main thread, so clean-up (``finally``, the Spark
session's stop) runs; a second one while that runs exits at once, killing Spark's JVM. PySpark's own SIGINT handler
(installed with the SparkContext) cancels jobs through py4j from inside the py4j call it interrupts,
which logs tracebacks (``reentrant call``): :func:`install` is called again once the session exists,
and once a signal has come Python's logging is off (py4j logs the call it interrupted).
A JVM still starting (inside :func:`starting_jvm`) is stopped with the signal: it would not notice
this process go (it watches its stdin only once up) and would live on, printing a stack trace when it
finds no one to connect back to. Once it is up and making the SparkContext, the signal waits for it: a JVM
stopped then logs the half-made context's errors after this process's line (its web UI's servlets
interrupted, "Error initializing SparkContext", ~100 lines; under load, 2 of 17 tries at 3.6-4 s), so the
signal is said, held, and raised once the session exists, whose stop then says nothing. A signal that lands
where Python cannot raise (an at-fork hook, as logging's ``_releaseLock`` after Popen forks the JVM; a
finaliser) would be printed as "Exception ignored" and lost: :func:`_unraisable` raises it again at the next
line of Python instead.

Spark's JVM starts in a session (and process group) of its own (:func:`_own_session`): a SIGTERM sent to
this command's process group (``timeout``, ``kill -- -PGID``, a scheduler's) reached the JVM and its
Python workers too, which died at once, so the round failed and the run ended without the checkpoint its
stop promises. This process owns the JVM's life: the JVM ends when this process stops the session, or,
killed outright, when its stdin closes.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager

NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class Stopped(KeyboardInterrupt):
    """A command stopped by a signal; ``exit_code`` is the shell's (128 + the signal's number)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(NAMES.get(signum, "a signal"))
        self.signum, self.exit_code = signum, 128 + int(signum)


_fired = []      # signals received: the first raises, a second exits
_starting = []   # while Spark's JVM is being started: a callable, true once its gateway is up
_again = []      # a Stopped that Python could not raise where the signal landed, to raise once more


@contextmanager
def starting_jvm(up=lambda: False):
    """Around the call that starts Spark's JVM (a child of this process) and makes the SparkContext in it;
    ``up()``: whether the JVM is up (its gateway answers), so that a signal waits for the context and
    :func:`raise_held` raises it after this block."""
    _starting.append(up)
    try:
        yield
    finally:
        _starting.pop()


def _own_session() -> None:
    """At a fork, in the child: a JVM being launched (inside :func:`starting_jvm`) leaves this process's
    session and process group. Python runs at-fork hooks in a ``subprocess`` child only where it is given a
    ``preexec_fn``, as PySpark's launcher gives one (ignoring SIGINT)."""
    if _starting:
        os.setsid()


os.register_at_fork(after_in_child=_own_session)


def raise_held() -> None:
    """Raise the signal held while the SparkContext was made (:func:`starting_jvm`), if one came."""
    if _fired:
        raise Stopped(_fired[0])


def children(pid: int | None = None) -> list:
    """The processes whose parent is ``pid`` (default: this one), from /proc; none where there is none."""
    me, out = os.getpid() if pid is None else pid, []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for d in names:
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                    out.append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _handle(signum, frame):
    _fired.append(signum)
    # py4j logs the interrupted call with its traceback on the root logger: nothing logged is news now
    logging.disable(logging.CRITICAL)
    if len(_fired) > 1:                 # now: Spark's JVM with it, or it logs its tasks' deaths after our line
        _signal_children(signal.SIGKILL)
        print(f"error: stopped ({NAMES[signum]} again, without clean-up)", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    if _starting and _starting[-1]():      # the SparkContext is being made: stopped once it is (raise_held)
        os.write(2, f"{NAMES[signum]}: stopping once Spark has started ({NAMES[signum]} again to stop now)\n"
                    .encode())
        return
    if _starting:
        _signal_children(signal.SIGTERM)    # the JVM PySpark is launching (it ignores SIGINT)
    raise Stopped(signum)


def _signal_children(sig: int) -> None:
    for pid in children():
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _unraisable(u) -> None:
    """``sys.unraisablehook``: a :class:`Stopped` raised where Python can only print it is raised again at
    the next call or return outside this hook (:func:`_raise_again`); if that lands in another such place
    (the next at-fork hook) it comes back here. Anything else goes to the hook there was before."""
    if isinstance(u.exc_value, Stopped) and threading.current_thread() is threading.main_thread():
        _again.append(u.exc_value.signum)
        sys.setprofile(_raise_again)
    else:
        _previous_hook(u)


def _raise_again(frame, event, arg) -> None:
    if frame.f_code is _unraisable.__code__ or not _again:
        return
    sys.setprofile(None)
    raise Stopped(_again.pop())


_previous_hook = sys.unraisablehook


def install(command: bool = False) -> None:
    """Make Ctrl-C and SIGTERM raise :class:`Stopped` (the main thread only: signals reach no other);
    ``command``: a command starts, with no signal received yet and logging on (a notebook or a test
    runs several in one process)."""
    global _previous_hook
    if command:
        _fired.clear()
        _again.clear()
        logging.disable(logging.NOTSET)
    if sys.unraisablehook is not _unraisable:
        _previous_hook, sys.unraisablehook = sys.unraisablehook, _unraisable
    if threading.current_thread() is threading.main_thread():
        for sig in NAMES:
            signal.signal(sig, _handle)


def stopped() -> Stopped | None:
    """The signal received since the command started, as the :class:`Stopped` it raised; None if none came.
    Clean-up after a signal can fail as Spark's JVM goes (py4j's "Answer from Java side is empty" from the
    call it interrupted, or from the session's stop): the signal, not that failure, is what ended the command."""
    return Stopped(_fired[0]) if _fired else None


def exit_code(e: KeyboardInterrupt) -> int:
    """130 for Ctrl-C (a plain KeyboardInterrupt too), 143 for SIGTERM."""
    return getattr(e, "exit_code", 128 + signal.SIGINT)


def message(e: KeyboardInterrupt) -> str:
    return f"stopped ({e.args[0] if e.args else 'Ctrl-C'})"


def report(e: KeyboardInterrupt) -> int:
    """Say the stop in one line on stderr; the shell's exit code."""
    print(f"error: {message(e)}", file=sys.stderr)
    return exit_code(e)
