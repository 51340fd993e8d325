"""Crash-safe files (rnnlm.core.files): replacement, recovery and bounded reads on the local disk, through
``LocalFS`` and through the primitives alone (``ReplaceSafely``'s own order, which HDFS runs)."""
import errno
import os

import pytest

from rnnlm.core import files
from rnnlm.core.files import LocalFS, ReplaceSafely, backup, temporary


class Primitives(LocalFS):
    """The local disk with ``ReplaceSafely``'s own replacement and bounded read (what ``HadoopFS`` runs)."""
    write_atomic = ReplaceSafely.write_atomic
    read_at_most = ReplaceSafely.read_at_most


FS = [LocalFS(), Primitives()]
IDS = ["local", "primitives"]


@pytest.mark.parametrize("fs", FS, ids=IDS)
def test_restore_moves_back_only_a_lone_backup(tmp_path, fs):
    p = str(tmp_path / "metrics.jsonl")
    with open(p, "w") as f:
        f.write("1\n2\n3\n")
    with open(backup(p), "w") as f:
        f.write("1\n")                            # stale: p is whole
    assert fs.restore(p) and open(p).read() == "1\n2\n3\n"
    os.remove(p)                                  # cut between the two renames: the backup is the last whole
    assert fs.restore(p) and open(p).read() == "1\n" and not os.path.exists(backup(p))
    assert not fs.restore(str(tmp_path / "none"))


@pytest.mark.parametrize("fs", FS, ids=IDS)
def test_a_save_clears_what_a_crashed_save_left_and_nothing_else_is_kept(tmp_path, fs):
    d = str(tmp_path / "checkpoint")
    fs.write_dir_atomic(d, {"a.npy": b"1"})
    os.makedirs(backup(d))                        # a crash after the second rename left the old one
    open(os.path.join(backup(d), "a.npy"), "wb").write(b"0")
    os.makedirs(temporary(d))                     # and a writer that died midway its files
    open(os.path.join(temporary(d), "hidden.npy"), "wb").write(b"stale")
    fs.write_dir_atomic(d, {"b.npy": b"2"})
    assert os.listdir(d) == ["b.npy"] and sorted(os.listdir(tmp_path)) == ["checkpoint"]
    os.makedirs(temporary(d))
    fs.delete(d)                                  # --overwrite: the run's files and what a crash left
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fs", FS, ids=IDS)
def test_a_write_that_fails_midway_leaves_the_old_content(tmp_path, fs, monkeypatch):
    p = str(tmp_path / "run.json")
    fs.write_atomic(p, b"one\n")
    fs.write_atomic(p, b"one\ntwo\n")
    assert fs.read(p) == b"one\ntwo\n" and os.listdir(tmp_path) == ["run.json"]
    real = files._local_write

    def full(q, data, mode):                      # the disk fills after 5 bytes
        real(q, data[:5], mode)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(files, "_local_write", full)
    with pytest.raises(OSError):
        fs.write_atomic(p, b"three\n" * 10)
    assert fs.read(p) == b"one\ntwo\n"


@pytest.mark.parametrize("fs", FS, ids=IDS)
def test_a_read_finds_the_backup_of_a_replacement_cut_between_its_renames(tmp_path, fs):
    p = str(tmp_path / "metrics.jsonl")
    with open(backup(p), "wb") as f:
        f.write(b"{}\n")
    assert fs.read(p) == b"{}\n" and fs.readable(p) == backup(p) and fs.read_at_most(p, 10) == b"{}\n"
    assert os.path.exists(backup(p)) and not os.path.exists(p)        # read where it lies, not moved back


@pytest.mark.parametrize("fs", FS, ids=IDS)
def test_a_bounded_read_takes_a_file_of_exactly_its_limit_and_refuses_one_byte_more(tmp_path, fs):
    p = str(tmp_path / "run.json")
    open(p, "wb").write(b"x" * 10)
    assert fs.read_at_most(p, 10) == b"x" * 10
    with pytest.raises(ValueError, match="more than"):
        fs.read_at_most(p, 9)


def test_a_file_that_holds_more_than_its_size_said_is_refused():
    """/proc's files say 0 bytes and hold more: read up to the limit and one byte, then refused."""
    with pytest.raises(files.TooLarge):
        files.read_regular("/proc/self/status", 100)
    with pytest.raises(ValueError, match=r"/proc/self/status: more than the 100 bytes it is read up to$"):
        LocalFS().read_at_most("/proc/self/status", 100)


def test_mkdirs_makes_the_missing_parents_and_takes_a_directory_that_exists(tmp_path):
    """As Hadoop's ``FileSystem.mkdirs`` does (``HadoopFS``'s other branch): both filesystems answer alike."""
    p = str(tmp_path / "a" / "b")
    LocalFS().mkdirs(p)
    LocalFS().mkdirs(p)
    assert os.path.isdir(p)


@pytest.mark.parametrize("nbytes, said", [
    (16 << 20, "16 MiB"), (1 << 20, "1 MiB"), (3 << 30, "3072 MiB"), ((16 << 20) + 1, "16,777,217 bytes"),
    ((1 << 20) - 1, "1,048,575 bytes"), (100, "100 bytes"), (0, "0 bytes")])
def test_a_limit_is_said_in_mib_when_it_is_whole_ones_and_else_in_bytes(nbytes, said):
    assert files.amount(nbytes) == said


def test_every_file_written_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    fs = LocalFS()
    fs.write_dir_atomic(str(tmp_path / "ck"), {"a": b"1", "b": b"2"})
    fs.write_atomic(str(tmp_path / "run.json"), b"{}")
    fs.append(str(tmp_path / "metrics.jsonl"), b"{}\n")
    assert synced == [str(tmp_path / p) for p in ("ck.tmp/a", "ck.tmp/b", "run.json.tmp", "metrics.jsonl")]


@pytest.mark.parametrize("fs", FS, ids=IDS)
def test_a_deletion_cut_midway_leaves_the_directory_gone_not_half(tmp_path, fs, monkeypatch):
    """A checkpoint removed in place and cut midway (kill -9 during --overwrite) was left without its arrays,
    a directory the run then offered to resume. Moved aside first, it is whole or gone; the rest goes next time."""
    d = str(tmp_path / "checkpoint")
    fs.write_dir_atomic(d, {"MANIFEST.json": b"{}", "params.npy": b"1"})
    real = files.shutil.rmtree

    def cut(path, *args, **kwargs):               # the first file goes, then the process dies
        os.remove(os.path.join(path, sorted(os.listdir(path))[-1]))
        raise KeyboardInterrupt
    monkeypatch.setattr(files.shutil, "rmtree", cut)
    with pytest.raises(KeyboardInterrupt):
        fs.delete(d)
    assert fs.readable(d) is None and not fs.restore(d)
    monkeypatch.setattr(files.shutil, "rmtree", real)
    fs.delete(d)
    assert os.listdir(tmp_path) == []
