"""Stopping a run by signal: Ctrl-C or SIGTERM asks it to stop after the current round."""
from __future__ import annotations

import os
import signal
import threading

from .rundir import TrainingError


class Interrupted(TrainingError):
    """Ctrl-C (SIGINT) or SIGTERM during training: the run stopped between or inside a round.

    ``exit_code`` is the shell's code for a process ended by that signal (130, 143).
    """

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class StopRequest:
    """Ctrl-C or SIGTERM asks the run to stop after the current round (with a checkpoint); a
    second one stops it at once (through the handler it replaced, :mod:`rnnlm.cli.signals` under the
    command line, which raises; the run then cancels its jobs).

    SIGTERM is how ``timeout``, ``kill``, schedulers and YARN's container preemption stop a
    process: it gets the same grace as Ctrl-C. Interrupting a py4j call midway, as PySpark's
    handler does, logs py4j errors and leaves a half-done round; letting the round finish costs
    at most one round's time.
    """

    NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, log):
        self.requested, self.signum, self._log, self._previous = False, signal.SIGINT, log, {}
        if threading.current_thread() is threading.main_thread():   # signals reach the main thread only
            for sig in self.NAMES:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            previous = self._previous.get(signum)
            if callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        name = self.NAMES[signum]
        line = f"{name}: stopping after this round with a checkpoint ({name} again to stop now)"
        try:
            self._log(line)
        except RuntimeError:        # the signal came while the main thread was writing: "reentrant call"
            os.write(2, (line + "\n").encode())

    def release(self):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
