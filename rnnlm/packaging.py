"""Building what ``spark-submit --py-files`` ships: the ``rnnlm`` package as a zip."""
from __future__ import annotations

import os
import zipfile


def build_pyfiles(dest: str) -> str:
    """Write ``rnnlm`` (code and its small data files) to the zip ``dest``; return its path."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(pkg)
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    tmp = dest + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for d, dirs, files in os.walk(pkg):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for f in sorted(files):
                if f.endswith((".py", ".txt")):
                    full = os.path.join(d, f)
                    z.write(full, os.path.relpath(full, root))
    os.replace(tmp, dest)
    return dest
