"""Standard output that a closed pipe or a full disk cannot turn into a traceback.

``rnnlm generate ... | head`` closes the pipe after the first lines; ``> /dev/full`` fails every
write. Either once ended the command with ``BrokenPipeError`` or ``OSError`` from the first ``print``
after it, and a training run printing its progress with it. Inside :func:`guarded` a failed write
points the descriptor at ``/dev/null`` and the command goes on (a run's metrics and checkpoints are in
its files); the command then ends as a pipeline expects: 141 (128 + SIGPIPE) and nothing said for a
reader that went away, one line and exit code 2 for any other failure.
"""
from __future__ import annotations

import errno
import os
import sys
from contextlib import contextmanager

EXIT_PIPE = 141


class _Guarded:
    """``stream`` (a text file) whose writes and flushes cannot raise OSError; the first failure is kept."""

    def __init__(self, stream):
        self._stream, self.failed = stream, None

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._fail(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        if self.failed is None:
            self.failed = e
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())    # what is still buffered goes there too
            finally:
                os.close(null)
        try:
            self._stream.flush()
        except OSError:
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextmanager
def guarded():
    """``sys.stdout`` guarded while the block runs (then as it was); yields the guard, whose ``failed``
    says whether a write failed. A stream without a descriptor (a test's capture) is left as it is."""
    stream = sys.stdout
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        yield _Guarded(None)
        return
    guard = sys.stdout = _Guarded(stream)
    try:
        yield guard
        guard.flush()
    finally:
        sys.stdout = stream


def exit_code(guard, code: int) -> int:
    """The command's exit code ``code``, unless its standard output failed (said in one line on stderr
    unless the reader went away)."""
    e = guard.failed
    if e is None:
        return code
    if e.errno == errno.EPIPE:
        return EXIT_PIPE
    print(f"error: cannot write to standard output: {e.strerror or e}", file=sys.stderr)
    return code or 2
