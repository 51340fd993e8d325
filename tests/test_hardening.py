"""Hostile input found before the JVM starts, or kept from stopping a run: one line on stderr, exit code 2.

Each case here fails without Spark (a subprocess ends in ~0.5 s), except where a Spark read is the
point, which uses the session's shared ``spark`` fixture.
"""
import os
import shutil
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from rnnlm import config
from rnnlm.core import checkpoint
from rnnlm.core.models import build as build_model
from rnnlm.core.vocab import Vocab

from conftest import HARBOUR, ROOT

DEMO = os.path.join(ROOT, "conf", "demo.toml")
HARDENED_RUN = ["--set", f"data.train={HARBOUR}", "--set", "model.hidden=4", "--set", "train.bptt=4",
                "--set", "train.batch=2", "--set", "data.valid="]


def tiny_checkpoint(path, position, nan=False):
    """A checkpoint of the model ``HARDENED_RUN`` trains, at ``position``; its parameters NaN with ``nan``."""
    cfg = config.load(DEMO, HARDENED_RUN[1::2])
    vocab = Vocab.build(open(HARBOUR).read(), "char")
    cfg = config.replace(cfg, "model", vocab_size=len(vocab))
    params = build_model(cfg.model).init_params(1)
    if nan:
        params[::7] = np.nan
    checkpoint.save(str(path), checkpoint.Checkpoint(params=params, config=cfg, vocab=vocab, position=position))


def before_the_jvm(argv, expected):
    """``argv`` (a job file and its options) ends with exit code 2 and the one line ``expected`` starts,
    in the time an error found without Spark takes (its JVM takes 13-16 s to start)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    assert r.returncode == 2, (argv, r.stderr[-2000:])
    assert r.stderr.startswith(expected) and r.stderr.count("\n") == 1, (argv, r.stderr[-2000:])
    assert took < 8.0, (argv, took)          # room for a loaded machine, still well short of a JVM


@pytest.mark.parametrize("sets, expected", [
    (["optim.lr=1" + "0" * 400], "error: optim.lr = a number of about 401 digits is out of range: a run takes "
                                 "optim.lr in (0, inf)\n"),
    (["model.hidden=" + "9" * 5000], "error: model.hidden: a number of 5000 characters is out of range"),
    (["model.hidden=65536", "model.layers=64"], "error: the model has "),
    (["data.train=/x\nerror: forged"], "error: --set 'data.train': the value holds a control character (U+000A); "
                                       "refused\n"),
])
def test_a_bad_setting_is_one_line_before_the_jvm(sets, expected):
    before_the_jvm(["jobs/train.py", "--config", DEMO, "--out", "/nonexistent/out",
                    *[a for s in sets for a in ("--set", s)]], expected)


def test_resuming_a_checkpoint_without_its_position_is_one_line_before_the_jvm(tmp_path):
    """``--resume`` on a state.json without ``tokens`` reached trainer._resume: KeyError after Spark started."""
    run = tmp_path / "run"
    tiny_checkpoint(run / "checkpoint", {"round": 1, "step": 40})          # what the one-machine trainer writes
    (run / "metrics.jsonl").write_text('{"round": 1}\n')
    before_the_jvm(["jobs/train.py", "--config", DEMO, "--out", str(run), "--resume", *HARDENED_RUN],
                   f"error: {run}/checkpoint: state.json's position has no tokens: not a checkpoint a sync run can "
                   "resume (rnnlm generate and evaluate can use it)\n")


def test_evaluating_parameters_that_are_not_finite_is_refused(tmp_path):
    """It printed ppl=inf and exited 0."""
    tiny_checkpoint(tmp_path / "ck", {"round": 1}, nan=True)
    before_the_jvm(["jobs/evaluate.py", "--checkpoint", str(tmp_path / "ck"), "--data", HARBOUR],
                   f"error: {tmp_path / 'ck'}: the parameters hold NaN or infinite values: not a model to use\n")


def test_generating_from_a_checkpoint_holding_a_link_loop_is_one_line(tmp_path):
    """A symlink loop as params.npy: OSError (Too many levels of symbolic links), exit 1."""
    tiny_checkpoint(tmp_path / "ck", {"round": 1})
    os.remove(tmp_path / "ck" / "params.npy")
    os.symlink("params.npy", tmp_path / "ck" / "params.npy")
    before_the_jvm(["jobs/generate.py", "--checkpoint", str(tmp_path / "ck")],
                   f"error: {tmp_path / 'ck'}: params.npy is a symbolic link, refused (a checkpoint holds regular "
                   "files only)\n")


@pytest.fixture
def local_dirs(tmp_path, monkeypatch):
    """An executor's ``SPARK_LOCAL_DIRS``, where rnnlm.spark.filestore keeps a partition's residuals."""
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path))
    return tmp_path


def test_residual_files_ignore_names_they_did_not_write(local_dirs):
    """A file ``0.x.feedback.npy`` in the run's directory: ValueError: invalid literal for int() in _prune,
    and the round's job aborted."""
    from rnnlm.spark import filestore
    d = filestore.root("run1")
    os.makedirs(d)
    foreign = ["0.x.feedback.npy", "0.1.feedback.npy.bak", "notes.txt", "0.1.a.b.npy", "00.1.feedback.npy"]
    for name in foreign:
        open(os.path.join(d, name), "wb").close()
    for seq in range(1, 6):
        ref = filestore.save("run1", seq, 0, {"feedback": np.full(4, seq, np.float32)})
    assert sorted(os.listdir(d)) == sorted(foreign + [f"0.{s}.feedback.npy" for s in (3, 4, 5)])
    assert filestore.load(ref, 0)["feedback"].tolist() == [5.0] * 4


@pytest.mark.parametrize("other", [np.full(4, 9, np.float32), np.zeros(5, np.float32), np.full(4, 5, np.float64)])
def test_a_foreign_file_under_a_residual_name_is_not_used(local_dirs, other):
    """Other numbers under the name a partition wrote were read as its residual, silently."""
    from rnnlm.spark import filestore
    ref = filestore.save("run2", 1, 3, {"feedback": np.full(4, 5, np.float32)})
    path = os.path.join(filestore.root("run2"), "3.1.feedback.npy")
    with open(path + ".x", "wb") as f:
        np.save(f, other)
    os.replace(path + ".x", path)
    assert filestore.load(ref, 3) is None                 # rebuilt from its lineage by the caller instead


def test_an_empty_or_cut_residual_file_is_rebuilt_and_a_failed_write_leaves_no_temporary(local_dirs, monkeypatch):
    """An empty file under the name: np.load's EOFError was not caught and failed the task; a save that
    failed (disk full) left its temporary file."""
    from rnnlm.spark import filestore
    ref = filestore.save("run4", 1, 0, {"feedback": np.full(4, 5, np.float32)})
    path = os.path.join(filestore.root("run4"), "0.1.feedback.npy")
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.truncate(0)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setattr(filestore, "_file", lambda st: ref.files[0][:4])         # as if the same file
    assert filestore.load(ref, 0) is None
    monkeypatch.undo()
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(local_dirs))

    def full(f, a, allow_pickle):
        f.write(b"\x93NUMPY")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(np, "save", full)
    with pytest.raises(OSError):
        filestore.save("run4", 2, 0, {"feedback": np.zeros(4, np.float32)})
    assert sorted(os.listdir(filestore.root("run4"))) == ["0.1.feedback.npy"]


_FIRED = []


def _fire(what):
    _FIRED.append(what)


class _Tripwire:
    """Unpickling it calls :func:`_fire` (by name, so in this process)."""

    def __reduce__(self):
        return (_fire, ("unpickled",))


def test_a_residual_file_holding_a_pickle_is_never_unpickled_and_a_run_without_files_removes_cleanly(local_dirs):
    """A file under a partition's residual name is read without pickles: an object array there is refused
    (the identity check comes after the read), not run."""
    from rnnlm.spark import filestore
    ref = filestore.save("run3", 1, 0, {"feedback": np.full(4, 5, np.float32)})
    path = os.path.join(filestore.root("run3"), "0.1.feedback.npy")
    with open(path, "wb") as f:
        np.save(f, np.array([_Tripwire()], dtype=object), allow_pickle=True)
    assert filestore.load(ref, 0) is None and _FIRED == []
    with pytest.raises(ValueError):
        filestore.save("run3", 2, 0, {"feedback": np.array([_Tripwire()], dtype=object)})    # nor written
    filestore.remove("run3")
    filestore.remove("run3")                              # already gone: nothing to do, no error
    assert not os.path.exists(filestore.root("run3"))


def test_a_corpus_of_one_huge_line_is_refused_before_the_jvm(tmp_path):
    """A 100,000,004-byte line with no newline (word level): OutOfMemoryError in the driver's JVM
    (Text.decode, during the CRLF probe's take(1)), then a ConnectionRefusedError traceback after ~9 s."""
    big = tmp_path / "one_line.txt"
    with open(big, "wb") as f:
        f.truncate(100_000_004)                        # sparse: NUL bytes, no line end
    try:
        before_the_jvm(["jobs/train.py", "--config", DEMO, "--out", str(tmp_path / "o"), "--set", f"data.train={big}",
                        "--set", "data.level=word", "--set", "data.paragraphs=line"],
                       f"error: data.train: {big} has no line end in its first 16 MiB: it is one huge line, and "
                       "records longer than data.max_record_mb = 16 MiB are refused (--set data.max_record_mb=N "
                       "raises it)\n")
    finally:
        big.unlink()


def test_a_gzip_inflating_to_one_huge_record_is_refused_before_the_jvm(tmp_path):
    """A 1.5 MB gzip inflating to 1.5 GiB with no newline killed the JVM the same way: the check reads
    no further than the limit."""
    import gzip
    bomb = tmp_path / "bomb.txt.gz"
    with gzip.open(bomb, "wb") as f:
        block = b"a" * (1 << 20)
        for _ in range(24):                            # 24 MiB inflated, 24 kB on disk
            f.write(block)
    assert bomb.stat().st_size < 100_000
    before_the_jvm(["jobs/train.py", "--config", DEMO, "--out", str(tmp_path / "o"), "--set", f"data.train={bomb}",
                    "--set", "data.max_record_mb=2"],
                   f"error: data.train: {bomb} has no line end in its first 2 MiB: it is one huge line, and records "
                   "longer than data.max_record_mb = 2 MiB are refused (--set data.max_record_mb=N raises it)\n")


def _corpus(path, *parts):
    with open(path, "wb") as f:
        for p in parts:
            f.write(p)
    return str(path)


def test_a_paragraph_whose_first_line_ends_past_the_first_chunk_is_called_a_paragraph(tmp_path):
    """The scan reads half the limit at a time: a first line ending after that, in a file with no blank
    line, was called 'one huge line' (and the hint to read it line by line was left out)."""
    from rnnlm.spark.scan import CorpusError, check_local_records
    mib = 1 << 20
    path = _corpus(tmp_path / "p.txt", b"a" * (700 << 10) + b"\n", b"b" * mib)
    with pytest.raises(CorpusError) as e:
        check_local_records(path, "blank_line", 1, "data.train")
    assert str(e.value) == (f"data.train: {path} has no blank line in its first 1 MiB: it is one paragraph, and "
                            "records longer than data.max_record_mb = 1 MiB are refused (--set data.max_record_mb=N "
                            "raises it); data.paragraphs = 'line' reads it line by line")


def test_a_text_whose_lines_end_with_a_lone_cr_is_one_paragraph_not_one_huge_line(tmp_path):
    """Lines that end with a lone \\r (old Macs') make no blank line, so a long text is one paragraph: the scan
    called it 'one huge line', with no line end, and left out that the line mode reads it (it does)."""
    from rnnlm.spark.scan import CorpusError, check_local_records
    path = _corpus(tmp_path / "mac.txt", b"the first line\r\r" + b"a line of words\r" * 80000)
    with pytest.raises(CorpusError) as e:
        check_local_records(path, "blank_line", 1, "data.train")
    assert str(e.value) == (f"data.train: {path} has no blank line in its first 1 MiB (its lines end with a lone "
                            "'\\r': a blank line is two '\\n' or two '\\r\\n'): it is one paragraph, and records "
                            "longer than data.max_record_mb = 1 MiB are refused (--set data.max_record_mb=N raises "
                            "it); data.paragraphs = 'line' reads it line by line")
    check_local_records(path, "line", 1, "data.train")


def test_records_longer_than_the_limit_are_found_wherever_they_are(tmp_path):
    from rnnlm.spark.scan import CorpusError, check_local_records
    mib = 1 << 20
    lines = b"a few words\n" * 1000
    exact = _corpus(tmp_path / "exact.txt", lines, b"x" * mib + b"\n", lines, b"y" * mib)    # two of 1 MiB: kept
    check_local_records(exact, "line", 1, "data.train")
    check_local_records(exact, "blank_line", 3, "data.train")        # one paragraph of 2 MiB and 24 kB
    over = _corpus(tmp_path / "over.txt", lines, b"x" * (mib + 1) + b"\r\n", lines)
    with pytest.raises(CorpusError) as e:
        check_local_records(over, "line", 1, "data.train")
    assert str(e.value) == (f"data.train: {over}: the line at byte 12,000 is longer than 1 MiB: records longer than "
                            "data.max_record_mb = 1 MiB are refused (--set data.max_record_mb=N raises it)")
    paras = b"one paragraph\r\nof two lines\r\n\r\n" * 20000                 # CRLF: paragraphs end at \r\n\r\n
    os.makedirs(tmp_path / "d")
    crlf = _corpus(tmp_path / "d" / "crlf.txt", paras)
    _corpus(tmp_path / "d" / ".hidden", b"z" * (2 * mib))                   # Hadoop skips it: so does the check
    check_local_records(str(tmp_path / "d"), "blank_line", 1, "data.train")
    _corpus(crlf, paras, b"long\r\n" * (mib // 6 + 2), b"\r\n", paras)       # 1 MiB and 4 bytes
    with pytest.raises(CorpusError, match=rf"^data.train: {crlf}: the paragraph at byte 620,000 is longer than 1 MiB"):
        check_local_records(str(tmp_path / "d" / "*.txt"), "blank_line", 1, "data.train")
    with pytest.raises(CorpusError, match=r"has no blank line in its first 1 MiB: it is one paragraph, .*; "
                                          r"data.paragraphs = 'line' reads it line by line$"):
        check_local_records(_corpus(tmp_path / "lines.txt", lines * 100), "blank_line", 1, "--data")
    check_local_records(_corpus(tmp_path / "lines.txt", lines * 100), "line", 1, "--data")
    os.makedirs(tmp_path / "g")
    _corpus(tmp_path / "g" / "_SUCCESS", b"z" * (2 * mib))
    check_local_records(str(tmp_path / "g" / "*"), "line", 1, "data.train")     # a glob's hidden match: skipped too


@pytest.mark.parametrize("mode, crlf", [("line", False), ("line", True), ("blank_line", False), ("blank_line", True),
                                        ("blank_line", None)])
def test_the_record_scan_agrees_with_the_records_at_every_chunk_boundary(mode, crlf):
    """Random streams at small limits (chunks of limit // 2 bytes, so delimiters straddle chunk ends and
    records start anywhere; runs of one to three line ends), against the whole stream split at its
    delimiters as Hadoop splits it (left to right, no overlap): the first record longer than the limit,
    its offset, and for a stream that opens with it whether its first limit bytes hold a line end.
    Before, a first line just over the limit in line mode was said to be a paragraph ("data.paragraphs =
    'line' reads it line by line", to a run reading lines), and three line ends moved a record's start.
    ``crlf`` None: lines that end with a lone \\r, no blank line to Hadoop, so the stream is one record."""
    import io
    from rnnlm.spark.scan import _long_record
    rng = np.random.default_rng(7 + bool(crlf))
    line_end = b"\r" if crlf is None else b"\r\n" if crlf else b"\n"
    found = {"none": 0, "line": 0, "paragraph": 0, "later": 0} if crlf is not None else {"none": 0, "line": 0, "cr": 0}
    for trial in range(2000):
        limit = int(rng.integers(4, 24))
        parts = []
        for _ in range(int(rng.integers(0, 7))):
            parts.append(rng.integers(97, 123, int(rng.integers(0, 2 * limit + 3))).astype(np.uint8).tobytes())
            parts.append(line_end * int(rng.choice([1, 1, 2, 2, 3])))
        stream = b"".join(parts[:len(parts) - int(rng.integers(0, 2))])
        if mode == "line":
            records = stream.replace(b"\r", b"\n").split(b"\n")
        elif crlf is None:
            records = [stream]
        else:
            records = stream.split(line_end * 2)
        want, offset = None, 0
        for i, r in enumerate(records):
            if len(r) > limit:
                lone_cr = crlf is None and b"\r" in r[:limit]
                want = offset, None if i else "paragraph" if b"\n" in r[:limit] else "cr" if lone_cr else "line"
                break
            offset += len(r) + (1 if mode == "line" else 2 * len(line_end))
        assert _long_record(io.BytesIO(stream), mode, limit) == want, (trial, limit, stream)
        found["none" if want is None else want[1] or "later"] += 1
    seen = {k for k, n in found.items() if n > 50}              # every outcome the mode has, met many times
    assert seen == ({"none", "line", "later"} if mode == "line" else set(found)), found


def test_a_record_where_no_scan_looks_is_refused_by_the_offsets_hadoop_read_it_at(spark, tmp_path):
    """Where the scan cannot look first (another codec: bzip2 here; another filesystem: test_hdfs), Hadoop's reader
    skips such a record rather than holding it (the JVM that held a 100 MB one died), and the records' offsets show
    the skip: refused (the run trained without it, saying nothing). Each read carries its own limit: a line-mode
    read once set it for the whole session, so a cached partition recomputed after a read with another limit read
    with that one."""
    import bz2
    from rnnlm.spark.reader import MAX_LINE, CorpusError, paragraphs
    mib = 1 << 20
    path = str(tmp_path / "c.txt.bz2")
    with bz2.open(path, "wb") as f:
        f.write(b"first words\n\n" + b"x" * (mib + 9) + b"\n\nlast words\n")
    sc = spark.sparkContext
    for mode, where in (("blank_line", "a paragraph between bytes 13 and 1,048,611"),
                        ("line", "a line between bytes 13 and 1,048,600")):
        loose = paragraphs(sc, path, mode, "word", 2, max_record_mb=2)
        with pytest.raises(CorpusError) as e:
            paragraphs(sc, path, mode, "word", 2, max_record_mb=1)
        assert str(e.value) == (f"{path}: {path}: {where} of its text is longer than 1 MiB (Hadoop skipped it): "
                                "records longer than data.max_record_mb = 1 MiB are refused (--set "
                                "data.max_record_mb=N raises it)")
        assert len(loose.collect()) == 3
    assert sc._jsc.hadoopConfiguration().get(MAX_LINE) is None          # the session's configuration untouched
    # bzip2, the codec Hadoop splits: a split's keys start at a compressed offset, so a line-mode read cut into
    # splits hid a long last line; read a file a task, the file's end is known (its text counted in the JVM)
    body = b"".join(b"%d words on line %d\n" % (i % 7, i) for i in range(60_000))
    with bz2.open(path, "wb") as f:
        f.write(body + b"x" * (mib + 7) + b"\n")
    last = body.rindex(b"\n", 0, -1) + 1
    with pytest.raises(CorpusError, match=f"^{path}: {path}: a line between bytes {last:,} and "
                                          f"{len(body) + mib + 8:,} of its text is longer than 1 MiB"):
        paragraphs(sc, path, "line", "word", 8, max_record_mb=1)
    assert paragraphs(sc, path, "line", "word", 8, max_record_mb=2).getNumPartitions() == 1


def test_line_mode_reads_a_file_in_as_many_splits_as_asked_in_order(spark, tmp_path):
    """As sc.textFile did with its minimum partitions: the read's tasks share a large file, its lines in order."""
    from rnnlm.spark.reader import paragraphs
    lines = [f"line {i} " + "w " * (i % 7) for i in range(20_000)]
    path = _corpus(tmp_path / "c.txt", "\n".join(lines).encode() + b"\n")
    rdd = paragraphs(spark.sparkContext, path, "line", "word", 4)
    assert rdd.getNumPartitions() == 4 and rdd.collect() == lines


def test_a_local_corpus_read_without_the_command_lines_check_still_refuses_a_record_past_the_limit(
        spark, tmp_path, monkeypatch):
    """Under spark-submit, or from a notebook, no check ran before Spark: the corpus' reader scans the local files
    itself (Hadoop skipped the record: the run trained without it, saying nothing), once per file as it stands."""
    from rnnlm.spark import reader, scan
    mib = 1 << 20
    path = _corpus(tmp_path / "c.txt", b"first words\n\n", b"x" * (mib + 9), b"\n\nlast words\n")
    sc = spark.sparkContext
    for mode, record in (("blank_line", "paragraph"), ("line", "line")):
        with pytest.raises(scan.CorpusError, match=f"c.txt: the {record} at byte 13 is longer than 1 MiB: records "
                                                   "longer than data.max_record_mb = 1 MiB are refused"):
            reader.paragraphs(sc, str(tmp_path), mode, "word", 2, max_record_mb=1)
    scans, real = [], scan._long_record
    monkeypatch.setattr(scan, "_long_record", lambda *a: scans.append(a[1:]) or real(*a))
    scan.check_local_records(path, "line", 2, "data.train")                     # as the command line does
    assert reader.paragraphs(sc, path, "line", "word", 2, max_record_mb=2).count() == 3 and len(scans) == 1
    _corpus(path, b"short\n")                                                      # changed: scanned again
    assert reader.paragraphs(sc, path, "line", "word", 2, max_record_mb=2).collect() == ["short"]
    assert len(scans) == 2
    # replaced by a file of the same size and time (cp -p, rsync -a): scanned again, and refused
    other = _corpus(tmp_path / "other.txt", b"x" * (2 * mib + 9) + b"\n")
    _corpus(path, b"y\n" * (mib + 5))
    os.utime(other, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns))
    scan.check_local_records(path, "line", 2, "data.train")
    assert os.path.getsize(other) == os.path.getsize(path)
    shutil.copy2(other, path)
    with pytest.raises(scan.CorpusError, match="c.txt has no line end in its first 2 MiB"):
        reader.paragraphs(sc, path, "line", "word", 2, max_record_mb=2)


@pytest.mark.parametrize("limit, sets, first, last", [
    ("1m", ["model.hidden=512"], "error: round 1: the Spark job failed: Total size of serialized results of ",
     "is bigger than spark.driver.maxResultSize (1024.0 KiB); stopped, no checkpoint was written yet"),
    ("1k", [], "error: a Spark job failed: Total size of serialized results of ",
     "is bigger than spark.driver.maxResultSize (1024.0 B)"),
])
def test_a_spark_job_that_fails_is_one_line_and_exit_code_2(tmp_path, limit, sets, first, last):
    """A job that Spark aborts in its JVM (as a driver out of heap does; here the tasks' results exceed
    ``spark.driver.maxResultSize``), in a round or before one (reading the corpus), ended in a
    Py4JJavaError's 60-line traceback, exit code 1. (PySpark's worker daemon may still print a
    BrokenPipeError of its own for the task Spark killed: not the driver's, and not this project's.)"""
    env = dict(os.environ, PYSPARK_SUBMIT_ARGS=f"--conf spark.driver.maxResultSize={limit} pyspark-shell")
    more = [a for s in [*sets, "train.results=spark", "train.rounds=2"] for a in ("--set", s)]
    r = subprocess.run([sys.executable, "jobs/train.py", "--config", DEMO, "--out", str(tmp_path / "run"),
                        *HARDENED_RUN, *more], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Py4JJavaError" not in r.stderr and "jobs/train.py" not in r.stderr, r.stderr[-3000:]
    assert not re.search(r'File "[^"]*/rnnlm/', r.stderr), r.stderr[-3000:]          # no frame of ours
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(first) and line.endswith(last), line


HEAP = """
import json, urllib.parse, urllib.request
from rnnlm.spark.session import get_spark
sc = get_spark("heap").sparkContext
port = urllib.parse.urlparse(sc.uiWebUrl).port
with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/applications/{sc.applicationId}/executors") as r:
    print(json.load(r)[0]["maxMemory"])
"""


@pytest.mark.parametrize("given, low, high", [(None, 1.6e9, 2.6e9), ("1g", 0.3e9, 0.7e9)])
def test_the_driver_started_by_plain_python_has_4g_of_heap_unless_told_otherwise(given, low, high):
    """Spark's 1g made a dense PTB medium round (2 x 80 MB of results through the JVM) fail now and then;
    a user's ``$SPARK_DRIVER_MEMORY`` (or ``spark.driver.memory``) still decides. Spark's storage memory,
    as its REST API reports it: 60% of the heap above 300 MiB."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_DRIVER_MEMORY", "PYSPARK_SUBMIT_ARGS")}
    env.update({"PYTHONPATH": ROOT, **({"SPARK_DRIVER_MEMORY": given} if given else {})})
    r = subprocess.run([sys.executable, "-c", HEAP], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert low < int(r.stdout.split()[-1]) < high, r.stdout


DEFAULTS = """
import os
from rnnlm.spark.session import get_spark
sc = get_spark("defaults").sparkContext
print(sc.master, sc.parallelize([0], 1).map(lambda _: os.environ.get("OPENBLAS_NUM_THREADS")).collect()[0])
print(sc._jvm.System.getProperty("rnnlm.test.flag"), sc._jvm.System.getProperty("log4j2.configurationFile"))
"""


@pytest.mark.parametrize("submit_args", ["", "--master local[4] pyspark-shell"])
def test_a_users_spark_defaults_are_kept_for_the_keys_the_session_sets(tmp_path, submit_args):
    """Started by plain Python, the session set its keys over what the launcher read from ``spark-defaults.conf``
    and ``$PYSPARK_SUBMIT_ARGS``: the master local[2], executors' BLAS on 1 thread under ``spark.task.cpus 2``, the
    user's driver options dropped for the log configuration. They are kept now, the log configuration added to the
    user's options; ``--master`` in ``$PYSPARK_SUBMIT_ARGS`` wins over ``spark.master``, as in the launcher."""
    (tmp_path / "spark-defaults.conf").write_text("spark.master local[3]\nspark.task.cpus 2\n"
                                                  "spark.driver.extraJavaOptions -Drnnlm.test.flag=kept\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_SUBMIT_ARGS", "SPARK_HOME")}
    env.update({"PYTHONPATH": ROOT, "SPARK_CONF_DIR": str(tmp_path)})
    if submit_args:                                     # set but empty, PySpark's launcher is given no arguments
        env["PYSPARK_SUBMIT_ARGS"] = submit_args
    r = subprocess.run([sys.executable, "-c", DEFAULTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    (master, threads), (flag, log4j) = (line.split() for line in r.stdout.splitlines()[-2:])
    assert master == ("local[4]" if submit_args else "local[3]") and threads == "2" and flag == "kept", r.stdout
    assert log4j.endswith("/rnnlm/data/log4j2.properties"), log4j


# the error of a PTB medium round (dense results through Spark) whose driver ran out of its 1g heap, 2026-11-26
TASK_RESULT_LOST = """An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 1 in stage 96.0 failed 1 times, most \
recent failure: Lost task 1.0 in stage 96.0 (TID 102) (192.0.2.2 executor driver): TaskResultLost (result lost \
from block manager)
Driver stacktrace:
\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2935)
"""


# a Python task's failure as py4j reports it: the call, Spark's abort, the worker's traceback, the JVM's stack
PYTHON_TASK_FAILED = """An error occurred while calling z:org.apache.spark.api.python.PythonRDD.runJob.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 3.0 failed 1 times
org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/w/rnnlm/spark/executor.py", line 140, in run
ValueError: the first failure, chained
During handling of the above exception, another exception occurred:
rnnlm.core.vocab.VocabError: the vocabulary holds 3 tokens
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:572)
py4j.protocol.Py4JJavaError: An error occurred
"""


@pytest.mark.parametrize("text, line", [
    (PYTHON_TASK_FAILED, "rnnlm.core.vocab.VocabError: the vocabulary holds 3 tokens"),   # the Python cause, last
    ("An error occurred while calling o1.count.\n: org.apache.spark.SparkException: Job aborted due to stage "
     "failure: Task 2 in stage 1.0 failed 4 times\n\tat org.apache.spark.x(y.scala:1)",
     "Task 2 in stage 1.0 failed 4 times"),                                                 # else Spark's reason
    ("  \n Connection refused by the JVM\nmore", "Connection refused by the JVM"),          # else the first line
    ("An error occurred while calling o123.partitions.\n: org.apache.hadoop.mapreduce.lib.input."
     "InvalidInputException: Input path does not exist: file:/d/_valid.txt\n\tat org.apache.hadoop.x(y.java:1)",
     "org.apache.hadoop.mapreduce.lib.input.InvalidInputException: Input path does not exist: file:/d/_valid.txt"),
    ("An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n: org.apache.spark."
     "SparkException: Job aborted due to stage failure: Task 0 in stage 0.0 failed 1 times, most recent failure: "
     "Lost task 0.0 in stage 0.0 (TID 0) (192.0.2.2 executor driver): org.apache.spark.SparkException: Python "
     "worker exited unexpectedly (crashed)\n\tat org.apache.spark.api.python.BasePythonRunner(x.scala:1)\n"
     "Caused by: java.io.EOFException: Unexpected end of input stream\n\tat org.apache.hadoop.io.compress."
     "DecompressorStream.decompress(DecompressorStream.java:165)\n",
     "java.io.EOFException: Unexpected end of input stream"),           # else the JVM's root cause (a cut gzip)
    ("", ""),
    ("KeyError: " + "k" * 400, "KeyError: " + "k" * 290),                                     # 300 characters at most
])
def test_a_failed_job_is_one_line_naming_its_cause(text, line):
    from rnnlm.spark.session import job_failure
    assert job_failure(text) == line


def test_only_a_local_master_keeps_every_executor_on_this_machine():
    from rnnlm.spark.session import is_local_master
    assert [is_local_master(m) for m in ("local", " local[*] ", "local[4,2]", "local-cluster[2,1,1024]")] == [True] * 4
    assert not any(is_local_master(m) for m in ("yarn", "localhost:7077", "local-cluster", "locals", "spark://local"))


def test_a_job_that_lost_a_result_says_so_and_what_memory_to_raise():
    from rnnlm.spark.session import job_failure
    line = job_failure(TASK_RESULT_LOST)
    assert line.startswith("Task 1 in stage 96.0 failed 1 times, most recent failure: Lost task 1.0 in stage 96.0 "
                           "(TID 102) (192.0.2.2 executor driver): TaskResultLost (result lost from block manager) "
                           "(a JVM's memory: raise spark.driver.memory"), line
    assert "\n" not in line and "$SPARK_DRIVER_MEMORY" in line
