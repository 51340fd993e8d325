"""Standard output that a closed pipe or a full disk cannot turn into a traceback.

``rnnlm generate ... | head`` closes the pipe after the first lines; ``> /dev/full`` fails every
write. Either once ended the command with ``BrokenPipeError`` or ``OSError`` from the first ``print``
after it, and a training run printing its progress with it. Inside :func:`guarded` a failed write
points the descriptor at ``/dev/null`` and the command goes on (a run's metrics and checkpoints are in
its files); a command that succeeded then ends as a pipeline expects: 141 (128 + SIGPIPE) and nothing
said for a reader that went away, one line and exit code 2 for any other failure; one that failed keeps
its own exit code. Standard error is guarded alike (``2>&1 | head``).
"""
from __future__ import annotations

import errno
import os
import sys
from contextlib import contextmanager

EXIT_PIPE = 141


class _Guarded:
    """``stream`` (a text file, None: not guarded) whose writes and flushes cannot raise OSError; the
    first failure is kept in ``failed``."""

    def __init__(self, name: str, stream):
        self.name, self._stream, self.failed = name, stream, None

    @property
    def active(self) -> bool:
        return self._stream is not None

    def write(self, text: str) -> int:
        try:
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:      # what the stream's encoding cannot say (bytes of an argument that
                enc = getattr(self._stream, "encoding", None) or "utf-8"       # were not UTF-8): escaped
                self._stream.write(text.encode(enc, "backslashreplace").decode(enc))
                return len(text)
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
    """``sys.stdout`` and ``sys.stderr`` guarded while the block runs (then as they were); yields the
    guards, whose ``failed`` says whether a write failed. A stream without a descriptor (a test's
    capture) is left as it is. What is still buffered is flushed on the way out, whatever ended the
    block."""
    streams = (sys.stdout, sys.stderr)
    out, err = (_Guarded(name, s if _has_fd(s) else None) for name, s in zip(("output", "error"), streams))
    sys.stdout, sys.stderr = (g if g.active else s for g, s in zip((out, err), streams))
    try:
        yield out, err
    finally:
        try:
            for g in (out, err):
                if g.active:
                    g.flush()
        finally:
            sys.stdout, sys.stderr = streams


def _has_fd(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def exit_code(guards, code: int) -> int:
    """The command's exit code ``code``; when it succeeded but its output failed, 141 for a reader that
    went away (nothing said), else 2 and one line on stderr (if stderr still takes it)."""
    g = next((g for g in guards if g.failed is not None), None)
    if code or g is None:
        return code
    if g.failed.errno == errno.EPIPE:
        return EXIT_PIPE
    try:
        print(f"error: cannot write to standard {g.name}: {g.failed.strerror or g.failed}", file=sys.stderr)
    except OSError:
        pass
    return 2
