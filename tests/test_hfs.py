"""rnnlm.spark.hfs: where paths go (Hadoop's rules), and crash-safe replacement on both code paths."""
import os

import pytest

from rnnlm.core import checkpoint as ckpt
from rnnlm import config
from rnnlm.core.files import PathError
from rnnlm.spark.hfs import HadoopFS, default_fs, resolve
from rnnlm.core.model import RNNLM
from rnnlm.core.vocab import Vocab


def _crc_files(root):
    """Hadoop's LocalFileSystem leaves a ``.<name>.crc`` beside each file; Python I/O does not."""
    return [n for _, _, names in os.walk(root) for n in names if n.endswith(".crc")]


# ------------------------------------------------------------ resolve (no JVM)
def test_resolve_plain_path_on_local_default_is_local_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve("runs/x", "file:///") == (True, str(tmp_path / "runs" / "x"))
    assert resolve("/a/b", "file:///") == (True, "/a/b")
    assert resolve("runs/x", "file:/") == (True, str(tmp_path / "runs" / "x"))


def test_resolve_plain_path_on_hdfs_default_goes_to_hadoop():
    assert resolve("runs/x", "hdfs://nn:8020") == (False, "runs/x")
    assert resolve("/data/x", "hdfs://nn:8020") == (False, "/data/x")


def test_resolve_file_uri_is_local_whatever_the_default():
    for default in ("file:///", "hdfs://nn:8020"):
        assert resolve("file:///x/y", default) == (True, "/x/y")
        assert resolve("file:/x/y", default) == (True, "/x/y")
        assert resolve("file://localhost/x/y", default) == (True, "/x/y")
        # Hadoop's Path has no query or fragment: they are the name's ("/runs/x#2" is not "/runs/x")
        assert resolve("file:///runs/x#2", default) == (True, "/runs/x#2")
        assert resolve("file:/runs/x?y", default) == (True, "/runs/x?y")
        assert resolve("file:///runs/a%20b", default) == (True, "/runs/a%20b")


def test_a_file_uri_names_where_hadoop_writes(spark, tmp_path):
    """Hadoop's own FileSystem and the local check put file:///.../exp#2 in one place; with the
    fragment cut off, --overwrite of that run deleted the run in .../exp."""
    for name in ("exp#2", "exp?q", "a%20b"):
        uri = f"file://{tmp_path}/{name}"
        HadoopFS(spark.sparkContext, uri, local=False).write_atomic(f"{uri}/m", b"x")
        assert resolve(uri, "file:///") == (True, str(tmp_path / name))
        assert (tmp_path / name / "m").read_bytes() == b"x"


def test_resolve_other_schemes_go_to_hadoop():
    for default in ("file:///", "hdfs://nn:8020"):
        assert resolve("hdfs://h/x", default) == (False, "hdfs://h/x")
        assert resolve("s3a://bucket/k", default) == (False, "s3a://bucket/k")


# ------------------------------------------------------- default filesystem
def test_plain_path_uses_python_io_on_local_default(spark, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs = HadoopFS(spark.sparkContext, "runs/x")
    assert fs.local and fs.fs is None
    fs.write_atomic("runs/x/metrics.jsonl", b"a\n")
    fs.append("runs/x/metrics.jsonl", b"b\n", None)
    assert (tmp_path / "runs" / "x" / "metrics.jsonl").read_bytes() == b"a\nb\n"
    assert _crc_files(tmp_path) == []


def test_file_uri_uses_python_io(spark, tmp_path):
    root = f"file://{tmp_path}/run"
    fs = HadoopFS(spark.sparkContext, root)
    assert fs.local
    fs.write_atomic(f"{root}/metrics.jsonl", b"m")
    fs.write_dir_atomic(f"{root}/checkpoint", {"a": b"1"})
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == b"m"
    assert fs.read(f"{root}/checkpoint/a") == b"1"
    assert _crc_files(tmp_path) == []


def test_plain_path_follows_hadoop_default_fs(spark, tmp_path, monkeypatch):
    """With a non-local fs.defaultFS, a scheme-less path must not land on the driver's disk."""
    monkeypatch.chdir(tmp_path)
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    before = conf.get("fs.defaultFS")
    conf.set("fs.defaultFS", "nofs://x")
    try:
        with pytest.raises(Exception, match="No FileSystem for scheme"):
            fs = HadoopFS(spark.sparkContext, "some/relative/path")
            fs.write_atomic("some/relative/path/metrics.jsonl", b"lost")
    finally:
        conf.set("fs.defaultFS", before)
    assert list(tmp_path.iterdir()) == []


def test_forcing_python_io_refuses_a_remote_path(spark):
    with pytest.raises(ValueError, match="not a local path"):
        HadoopFS(spark.sparkContext, "hdfs://h/x", local=True)


# ---------------------------------------------------- crash-safe replacement
def _store(kind, spark, tmp_path):
    """(HadoopFS, root): Python I/O on a plain path, or Hadoop's client on a ``file://`` one."""
    if kind == "python":
        return HadoopFS(spark.sparkContext, str(tmp_path)), str(tmp_path)
    root = f"file://{tmp_path}"
    fs = HadoopFS(spark.sparkContext, root, local=False)
    assert not fs.local and fs.fs is not None
    return fs, root


@pytest.fixture(params=["python", "hadoop"])
def store(request, spark, tmp_path):
    return _store(request.param, spark, tmp_path)


def test_read_finds_a_cut_replacements_backup_where_it_lies(store):
    """A reader reads ``<p>.old`` and moves nothing (the writer's next write, or a run's start, does)."""
    fs, root = store
    p = f"{root}/metrics.jsonl"
    fs.write_atomic(p, b"old")
    fs.rename(p, f"{p}.old")              # the state a crash between the two renames leaves
    assert fs.read(p) == b"old" and fs.read_at_most(p, 10) == b"old" and fs.readable(p) == f"{p}.old"
    assert not fs.exists(p) and fs.exists(f"{p}.old")
    fs.write_atomic(p, b"new")
    assert fs.read(p) == b"new" and not fs.exists(f"{p}.old")


def test_a_reader_between_a_writers_two_renames_leaves_the_write_to_finish(store, monkeypatch):
    """A reader that moved the backup back (``rnnlm generate`` or ``plot`` on a running run) made the
    writer's rename of its new checkpoint into place fail (on HDFS: moved it into the old directory)."""
    fs, root = store
    d, p = f"{root}/checkpoint", f"{root}/metrics.jsonl"
    fs.write_dir_atomic(d, {"a": b"1"})
    fs.write_atomic(p, b"1")
    real, seen = fs.rename, []

    def rename(src, dst):
        real(src, dst)
        if dst == f"{d}.old":                         # between the two renames a reader comes, as
            seen.append(fs.read(f"{fs.readable(d)}/a"))     # rnnlm.cli.session.read_checkpoint reads
        elif dst == f"{p}.old":
            seen.append(fs.read(p))
    monkeypatch.setattr(fs, "rename", rename)
    fs.write_dir_atomic(d, {"a": b"2"})
    fs.write_atomic(p, b"2")                          # (Python's I/O replaces a file in one os.replace)
    assert seen == [b"1"] * (1 if fs.local else 2)
    assert fs.read(f"{d}/a") == b"2" and fs.read(p) == b"2"
    assert not fs.exists(f"{d}.old") and not fs.exists(f"{p}.old")


def test_restore_recovers_directory_from_backup(store):
    fs, root = store
    d = f"{root}/checkpoint"
    fs.write_dir_atomic(d, {"a": b"1"})
    fs.rename(d, f"{d}.old")
    assert not fs.exists(d)
    assert fs.restore(d)
    assert fs.read(f"{d}/a") == b"1" and not fs.exists(f"{d}.old")
    assert not fs.restore(f"{root}/nothing")


def _die_on_rename_into_place(fs, monkeypatch):
    """Make the writer crash at its rename of the temporary into place."""
    if fs.local:
        real = os.rename
        monkeypatch.setattr(os, "rename", lambda s, d: _die() if str(s).endswith(".tmp") else real(s, d))
    else:
        real = fs.rename
        monkeypatch.setattr(fs, "rename", lambda s, d: _die() if s.endswith(".tmp") else real(s, d))


def _die():
    raise RuntimeError("crash")


def _crash_then_recover(fs, p, write, read, monkeypatch):
    write(b"old")
    with monkeypatch.context() as m:
        _die_on_rename_into_place(fs, m)
        with pytest.raises(RuntimeError, match="crash"):
            write(b"new")
    assert fs.exists(f"{p}.old")          # a fixed name a later process finds
    assert fs.exists(f"{p}.tmp")          # the new content, never renamed into place
    assert read() == b"old"
    write(b"new")                           # and the next write completes cleanly
    assert read() == b"new" and not fs.exists(f"{p}.old") and not fs.exists(f"{p}.tmp")


def test_crash_in_write_dir_atomic_keeps_old_directory(store, monkeypatch):
    fs, root = store
    d = f"{root}/checkpoint"
    _crash_then_recover(fs, d, lambda data: fs.write_dir_atomic(d, {"a": data}),
                        lambda: fs.restore(d) and fs.read(f"{d}/a"), monkeypatch)


def test_crash_in_hadoop_write_atomic_keeps_old_file(spark, tmp_path, monkeypatch):
    # (the Python I/O path replaces a file with one os.replace: there is no gap)
    fs, root = _store("hadoop", spark, tmp_path)
    p = f"{root}/metrics.jsonl"
    _crash_then_recover(fs, p, lambda data: fs.write_atomic(p, data), lambda: fs.read(p), monkeypatch)


def test_delete_removes_backup_too(store):
    fs, root = store
    p = f"{root}/m"
    fs.write_atomic(p, b"x")
    fs.rename(p, f"{p}.old")
    fs.delete(p)
    assert fs.read(p) is None


def test_a_crashed_writers_temporary_is_cleared_not_piled_up(store):
    """A replacement is written under one fixed name: what a writer killed before its renames left
    (a whole checkpoint's size) is cleared by the next write, or by a delete (``--overwrite``)."""
    fs, root = store
    d, p = f"{root}/checkpoint", f"{root}/metrics.jsonl"
    fs.write_dir_atomic(d, {"a": b"1"})
    fs.write_dir_atomic(f"{d}.tmp", {"a": b"half"})         # a writer killed midway, in any process
    fs.write_atomic(f"{p}.tmp", b"half")
    fs.write_dir_atomic(d, {"a": b"2"})
    assert fs.read(f"{d}/a") == b"2" and not fs.exists(f"{d}.tmp")
    fs.write_dir_atomic(f"{d}.tmp", {"a": b"half"})
    fs.delete(d)
    fs.delete(p)
    assert not any(fs.exists(q) for q in (d, f"{d}.tmp", p, f"{p}.tmp"))


# -------------------------------------------------------------- checkpoint
@pytest.fixture
def ck():
    vocab = Vocab.build("abracadabra", "char")
    cfg = config.replace(config.load(None, ["model.hidden=4", "optim.name=sgd"]), "model",
                         vocab_size=len(vocab))
    return ckpt.Checkpoint(params=RNNLM(cfg.model).init_params(1), config=cfg, vocab=vocab,
                           position={"round": 1})


def test_checkpoint_save_uses_the_hfs_directory_writer(tmp_path, ck, monkeypatch):
    from rnnlm.spark import hfs
    calls = []
    real = hfs.LocalFS.write_dir_atomic
    monkeypatch.setattr(hfs.LocalFS, "write_dir_atomic", lambda self, d, f: calls.append(d) or real(self, d, f))
    ckpt.save(str(tmp_path / "c"), ck)
    assert calls == [str(tmp_path / "c")]


def test_checkpoint_load_recovers_from_a_crashed_save(tmp_path, ck, monkeypatch):
    path = str(tmp_path / "c")
    ckpt.save(path, ck)
    newer = ckpt.Checkpoint(params=ck.params + 1, config=ck.config, vocab=ck.vocab, position={"round": 2})
    real = os.rename
    with monkeypatch.context() as m:
        m.setattr(os, "rename", lambda s, d: _die() if str(s).endswith(".tmp") else real(s, d))
        with pytest.raises(RuntimeError, match="crash"):
            ckpt.save(path, newer)
    assert ckpt.load(path).position == {"round": 1}
    ckpt.save(path, newer)
    assert ckpt.load(path).position == {"round": 2}
    assert os.listdir(tmp_path) == ["c"]


def test_mkdirs_of_a_directory_that_exists_is_no_error(store):
    """Hadoop's mkdirs is idempotent; the local one behaves the same."""
    fs, root = store
    d = f"{root}/a/b"
    fs.mkdirs(d)
    fs.write(f"{d}/f", b"1")
    fs.mkdirs(d)
    assert fs.read(f"{d}/f") == b"1"


def test_the_default_filesystem_is_read_from_core_site_as_sparks_launcher_reads_it(tmp_path, monkeypatch):
    def site(name, body):
        d = tmp_path / name
        d.mkdir()
        (d / "core-site.xml").write_text(f"<configuration>{body}</configuration>")
        return str(d)

    def prop(name, value):
        return f"<property><name>{name}</name><value>{value}</value></property>"
    for var in ("SPARK_CONF_DIR", "SPARK_HOME", "PYSPARK_SUBMIT_ARGS"):     # the launcher's own settings
        monkeypatch.delenv(var, raising=False)
    hdfs = site("hdfs", "<property><value>x</value></property>" + prop("fs.other", "y")
                + prop(" fs.defaultFS ", " hdfs://nn:8020 "))
    assert default_fs(hdfs) == "hdfs://nn:8020"
    assert default_fs(site("empty", prop("fs.defaultFS", " "))) == "file:///"
    assert default_fs(site("none", prop("fs.other", "hdfs://nn:8020"))) == "file:///"
    assert default_fs(site("broken", "<property>")) == "file:///"
    assert default_fs(str(tmp_path / "missing")) == "file:///"
    # what gave a traceback through every command that resolves a path, or blocked it
    odd = tmp_path / "encoding"
    odd.mkdir()
    (odd / "core-site.xml").write_text('<?xml version="1.0" encoding="bogus-enc"?><configuration/>')
    assert default_fs(str(odd)) == "file:///"                            # LookupError, read as unreadable
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "core-site.xml")
    assert default_fs(str(fifo)) == "file:///"                           # not read: it blocked for ever
    bad = site("bad-url", prop("fs.defaultFS", "hdfs://[nn:8020"))
    with pytest.raises(PathError) as e:
        default_fs(bad)
    assert str(e.value) == (f"fs.defaultFS in {bad}/core-site.xml = hdfs://[nn:8020: not a path or a URL "
                            "(Invalid IPv6 URL)")
    yarn = site("yarn", prop("fs.defaultFS", "hdfs://yarn:8020"))
    monkeypatch.delenv("YARN_CONF_DIR", raising=False)
    monkeypatch.setenv("HADOOP_CONF_DIR", hdfs)
    assert default_fs() == "hdfs://nn:8020"                              # HADOOP_CONF_DIR alone
    monkeypatch.setenv("YARN_CONF_DIR", yarn)
    assert default_fs() == "hdfs://nn:8020"                              # HADOOP_CONF_DIR first
    monkeypatch.setenv("HADOOP_CONF_DIR", "")
    assert default_fs() == "hdfs://yarn:8020"                            # else YARN_CONF_DIR
    monkeypatch.delenv("YARN_CONF_DIR")
    assert default_fs() == "file:///"
    # as Hadoop reads them: the deprecated key, and a name without "/" (FileSystem.fixName: HDFS)
    assert default_fs(site("old", prop("fs.default.name", "hdfs://old:8020"))) == "hdfs://old:8020"
    assert default_fs(site("both", prop("fs.default.name", "hdfs://old:8020") + prop("fs.defaultFS", "file:///"))) \
        == "file:///"
    assert default_fs(site("bare", prop("fs.defaultFS", "namenode"))) == "hdfs://namenode"
    assert default_fs(site("local", prop("fs.defaultFS", "local"))) == "file:///"
    assert resolve("runs/x", "namenode") == (False, "runs/x") and resolve("/x", "local") == (True, "/x")
    # Spark's launcher puts its conf directory on the classpath before Hadoop's: its core-site.xml is loaded
    monkeypatch.setenv("HADOOP_CONF_DIR", hdfs)
    monkeypatch.setenv("SPARK_CONF_DIR", site("spark", prop("fs.defaultFS", "hdfs://spark:8020")))
    assert default_fs() == "hdfs://spark:8020"


def test_a_checkpoint_read_through_hadoops_paths_is_checked_before_its_bytes_are_read(spark, tmp_path, ck):
    """A local one under spark-submit (every path is Hadoop's there) was read with open(): a link to
    /dev/zero would never end, and sizes were known only once whole files were in memory. Now a local
    one is the local loader's (lstat first), and any other's sizes come from Hadoop's file status."""
    from rnnlm.spark.hfs import read_checkpoint
    path = str(tmp_path / "c")
    ckpt.save(path, ck)
    for mode in (None, False):                        # Python I/O where local, and Hadoop's own FileSystem
        assert read_checkpoint(HadoopFS(spark.sparkContext, path, local=mode), path).position == {"round": 1}
    params = os.path.join(path, "params.npy")
    os.replace(params, tmp_path / "params.npy")
    os.symlink(tmp_path / "params.npy", params)         # to the file itself: followed and taken before
    with pytest.raises(ckpt.CheckpointError, match=r"params.npy is a symbolic link, refused"):
        read_checkpoint(HadoopFS(spark.sparkContext, path), path)
    os.remove(params)
    with open(params, "wb") as f:
        f.truncate(10 ** 12)                          # sparse: a terabyte that is never read
    fs = HadoopFS(spark.sparkContext, path, local=False)
    with pytest.raises(ckpt.CheckpointError, match=r"params.npy has 1000000000000 bytes, its manifest entry \d+$"):
        read_checkpoint(fs, path)


def test_a_spark_defaults_file_that_is_a_fifo_is_skipped_not_waited_on(tmp_path, monkeypatch):
    """A FIFO as spark-defaults.conf (or as a --properties-file) blocked every command's start for good."""
    import threading
    os.mkfifo(tmp_path / "spark-defaults.conf")
    for var in ("SPARK_HOME", "YARN_CONF_DIR", "HADOOP_CONF_DIR", "PYSPARK_SUBMIT_ARGS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    got = []
    th = threading.Thread(target=lambda: got.append(default_fs()), daemon=True)
    th.start()
    th.join(10)
    assert got == ["file:///"]


def test_a_properties_files_comments_and_where_no_pyspark_is_found(tmp_path, monkeypatch):
    """Java's properties syntax: ``#`` and ``!`` open a comment, a line of the mark alone included (one
    character long); with no PySpark importable (rnnlm demo's core alone) there is no launcher to read."""
    import importlib.util
    from rnnlm.spark import launcher
    (tmp_path / "spark-defaults.conf").write_text("#\n!\n#spark.master local[8]\n! spark.master local[9]\n"
                                                  "spark.master   local[3]\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS", raising=False)
    assert launcher.launcher_property("spark.master") == "local[3]"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert launcher._pyspark_home() is None


def test_spark_hadoop_fs_default_fs_given_to_the_launcher_wins_as_in_the_jvm(tmp_path, monkeypatch):
    """Spark copies ``spark.hadoop.*`` over Hadoop's configuration: a default filesystem named in
    spark-defaults.conf, a --properties-file or a --conf in $PYSPARK_SUBMIT_ARGS is where a scheme-less
    --data or --out goes, so the checks before Spark must not read such a path on the local disk. (Each
    case below was checked once against the JVM that plain PySpark starts: ``hadoopConfiguration()``.)"""
    site = tmp_path / "hadoop"
    site.mkdir()
    (site / "core-site.xml").write_text("<configuration><property><name>fs.defaultFS</name>"
                                        "<value>hdfs://site:8020</value></property></configuration>")
    (tmp_path / "spark-defaults.conf").write_text("# comment\n! comment\n\nspark.other=1\n"
                                                  "spark.hadoop.fs.defaultFS   hdfs://defaults:1 \n")
    (tmp_path / "p.conf").write_text("spark.hadoop.fs.defaultFS: hdfs://props:2\n")
    (tmp_path / "p2.conf").write_text("spark.other 1\n")
    for var in ("SPARK_HOME", "YARN_CONF_DIR", "PYSPARK_SUBMIT_ARGS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HADOOP_CONF_DIR", str(site))
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    assert default_fs() == "hdfs://defaults:1"
    monkeypatch.setenv("SPARK_CONF_DIR", str(site))                   # no spark-defaults.conf there
    assert default_fs() == "hdfs://site:8020"
    monkeypatch.delenv("SPARK_CONF_DIR")
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "conf").symlink_to(tmp_path)
    assert default_fs() == "hdfs://defaults:1"                         # $SPARK_HOME/conf
    import pyspark
    from rnnlm.spark import launcher
    assert launcher._pyspark_home() == os.path.dirname(pyspark.__file__)  # its conf/ where $SPARK_HOME is unset
    cases = {f"--properties-file {tmp_path}/p.conf pyspark-shell": "hdfs://props:2",
             f"--properties-file {tmp_path}/p2.conf pyspark-shell": "hdfs://site:8020",
             f"--properties-file {tmp_path}/p2.conf --load-spark-defaults pyspark-shell": "hdfs://defaults:1",
             f"--properties-file {tmp_path}/p.conf --conf spark.hadoop.fs.defaultFS=hdfs://conf:3 pyspark-shell":
                 "hdfs://conf:3",
             "--conf=spark.hadoop.fs.defaultFS=file:/// pyspark-shell": "file:///",
             "--conf spark.other=1 --name spark.hadoop.fs.defaultFS=hdfs://no:9 pyspark-shell": "hdfs://defaults:1",
             "--conf=spark.other=2 pyspark-shell": "hdfs://defaults:1",
             "--properties-file 'unclosed pyspark-shell": "hdfs://defaults:1",
             f"--properties-file {tmp_path}/missing.conf pyspark-shell": "hdfs://site:8020"}
    for args, expected in cases.items():
        monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", args)
        assert default_fs() == expected, args
    # the master: --master first (the launcher's own flag wins over --conf spark.master), then as any key
    (tmp_path / "spark-defaults.conf").write_text("spark.master local[3]\n")
    for args, expected in {"--master local[4] --conf spark.master=local[5] pyspark-shell": "local[4]",
                           "--conf spark.master=local[5] --master=local[6] pyspark-shell": "local[6]",
                           "--conf spark.master=local[5] pyspark-shell": "local[5]",
                           "--name local[7] pyspark-shell": "local[3]"}.items():
        monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", args)
        assert launcher.launcher_property("spark.master") == expected, args
    assert launcher.launcher_property("spark.other") is None
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--conf spark.hadoop.fs.defaultFS=hdfs://x:1 pyspark-shell")
    assert resolve("runs/x", default_fs()) == (False, "runs/x")
