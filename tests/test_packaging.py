"""``jobs/package.py --env``'s last step without building an environment (test_yarn builds one for real):
the packed archive replaces ``dest`` whole or not at all."""
import errno
import os
import stat
import shutil
import subprocess
import sys
import tempfile
import types

import pytest

from rnnlm import packaging


@pytest.fixture
def packed(monkeypatch):
    """venv, pip and venv-pack stood in for: the archive venv-pack writes is 1 MB of b"new"."""
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=0, stderr=""))
    monkeypatch.setitem(sys.modules, "venv_pack", types.SimpleNamespace(
        pack=lambda prefix, output, verbose: open(output, "wb").write(b"new" * 350_000)))


def test_a_copy_cut_short_leaves_the_earlier_archive_whole(tmp_path, packed, monkeypatch):
    """The archive was moved onto ``dest`` across filesystems (/tmp is often another): a full disk or
    Ctrl-C midway left a truncated archive where a good one had been."""
    dest = tmp_path / "rnnlm-env.tar.gz"
    dest.write_bytes(b"the earlier, good archive")

    def disk_full(src, dst):
        with open(dst, "wb") as f:
            f.write(b"new" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shutil, "copyfile", disk_full)
    with pytest.raises(packaging.PackagingError) as e:
        packaging.build_env(str(dest), ["numpy"])
    assert str(e.value) == f"cannot write {dest}: No space left on device"
    assert dest.read_bytes() == b"the earlier, good archive"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rnnlm-env.tar.gz"]

    def interrupted(src, dst):
        with open(dst, "wb") as f:
            f.write(b"new" * 1000)
        raise KeyboardInterrupt
    monkeypatch.setattr(shutil, "copyfile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        packaging.build_env(str(dest), ["numpy"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rnnlm-env.tar.gz"]


def test_the_archive_replaces_dest_and_a_directory_is_refused(tmp_path, packed):
    dest = tmp_path / "env.tar.gz"
    dest.write_bytes(b"old")
    assert packaging.build_env(str(dest), ["numpy"]) == str(dest)
    assert dest.read_bytes() == b"new" * 350_000
    (tmp_path / "dir.tgz").mkdir()
    with pytest.raises(packaging.PackagingError, match=r"^cannot write .*/dir.tgz: a directory$"):
        packaging.build_env(str(tmp_path / "dir.tgz"), ["numpy"])
    assert list((tmp_path / "dir.tgz").iterdir()) == []


def test_a_destination_that_is_not_a_regular_file_is_not_replaced(tmp_path):
    """As root, ``package --out /dev/full`` replaced the device node by the zip; a FIFO went the same way."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(packaging.PackagingError, match=r"^cannot write .*/fifo: not a regular file \(not replaced\)$"):
        packaging.build_pyfiles(str(fifo))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


def test_a_source_dated_before_1980_is_packed(tmp_path, monkeypatch):
    """A Nix store's files (mtime 1) were a traceback: ZIP does not support timestamps before 1980."""
    import zipfile
    copy = tmp_path / "src" / "rnnlm"
    shutil.copytree(os.path.dirname(packaging.__file__), copy, ignore=shutil.ignore_patterns("__pycache__"))
    os.utime(copy / "config.py", (86400, 86400))                      # 1970-01-02
    monkeypatch.setattr(packaging, "__file__", str(copy / "packaging.py"))       # the package packed: the copy
    packaging.build_pyfiles(str(tmp_path / "out.zip"))
    with zipfile.ZipFile(tmp_path / "out.zip") as z:
        assert z.getinfo("rnnlm/config.py").date_time[0] == 1980
        assert z.read("rnnlm/config.py") == (copy / "config.py").read_bytes()


def test_a_destination_under_a_file_names_that_file(tmp_path):
    """Making the directories under a file said only "File exists"."""
    (tmp_path / "afile").write_text("mine")
    for dest in ("afile/x.zip", "afile/sub/x.zip"):
        with pytest.raises(packaging.PackagingError) as e:
            packaging.build_pyfiles(str(tmp_path / dest))
        assert str(e.value) == f"cannot write {tmp_path / dest}: {tmp_path / 'afile'} is a file, not a directory"
    with pytest.raises(packaging.PackagingError) as e:                  # before any environment is built
        packaging.build_env(str(tmp_path / "afile" / "env.tar.gz"), ["numpy"])
    assert str(e.value).endswith(f"{tmp_path / 'afile'} is a file, not a directory")
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_directory_is_refused_before_the_environment_is_built(tmp_path, monkeypatch):
    """It was found after venv and pip had run (minutes, a network's worth of wheels)."""
    ran = []
    done = types.SimpleNamespace(returncode=0, stderr="")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: ran.append(cmd) or done)
    monkeypatch.setitem(sys.modules, "venv_pack", types.SimpleNamespace(pack=lambda **k: ran.append("pack")))
    (tmp_path / "dir.tar.gz").mkdir()
    with pytest.raises(packaging.PackagingError, match=r"^cannot write .*/dir.tar.gz: a directory$"):
        packaging.build_env(str(tmp_path / "dir.tar.gz"), ["numpy"])
    # a gzip tarball named .zip was written: Spark unpacks by the suffix, so it failed on the cluster alone
    for dest in ("env.zip", "env.tar", "env"):
        with pytest.raises(packaging.PackagingError, match=rf"^cannot write .*/{dest}: an environment is packed as "):
            packaging.build_env(str(tmp_path / dest), ["numpy"])
    assert ran == [] and sorted(p.name for p in tmp_path.iterdir()) == ["dir.tar.gz"]


def test_the_zip_holds_every_subpackage_and_imports_from_itself_without_bytecode(tmp_path, monkeypatch):
    """What ``--py-files`` ships: the package's modules and data files from every subpackage, nothing from
    ``__pycache__`` (bytecode of another Python, or a stray file left there), importable from the zip alone."""
    import zipfile
    copy = tmp_path / "src" / "rnnlm"
    shutil.copytree(os.path.dirname(packaging.__file__), copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "core" / "__pycache__").mkdir()
    (copy / "core" / "__pycache__" / "stale.py").write_text("raise ImportError('stale')\n")
    monkeypatch.setattr(packaging, "__file__", str(copy / "packaging.py"))
    dest = tmp_path / "rnnlm.zip"
    packaging.build_pyfiles(str(dest))
    with zipfile.ZipFile(dest) as z:
        names = z.namelist()
    assert {"rnnlm/__init__.py", "rnnlm/core/model.py", "rnnlm/spark/trainer.py", "rnnlm/exchange/plan.py",
            "rnnlm/data/harbour.txt"} <= set(names)
    assert [n for n in names if "__pycache__" in n or not n.endswith((".py", ".txt"))] == []
    code = f"import sys; sys.path.insert(0, {str(dest)!r}); import rnnlm.spark.trainer, rnnlm; print(rnnlm.__file__)"
    r = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == str(dest / "rnnlm" / "__init__.py"), r.stderr


@pytest.mark.parametrize("stderr, said", [
    ("ERROR: one\nERROR: No matching distribution found for numpy==0.0\n",
     "installing numpy==0.0 failed: ERROR: No matching distribution found for numpy==0.0"),    # pip's last line
    ("", "installing numpy==0.0 failed: exit 3"),                  # nothing said: the exit status
])
def test_a_failed_install_is_its_last_line_and_leaves_nothing(tmp_path, monkeypatch, stderr, said):
    def run(cmd, **k):
        return types.SimpleNamespace(returncode=3 if "pip" in cmd else 0, stderr=stderr if "pip" in cmd else "")
    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setitem(sys.modules, "venv_pack", types.SimpleNamespace(pack=lambda **k: pytest.fail("packed")))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))          # where the work directory goes
    with pytest.raises(packaging.PackagingError) as e:
        packaging.build_env(str(tmp_path / "out" / "env.tar.gz"), ["numpy==0.0"])
    assert str(e.value) == said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not any((tmp_path / "out").iterdir())
