"""HDFS for real: a NameNode and two DataNodes (rnnlm.hadoop.minicluster), driven through the
same code and jobs users run. The corpus, a run's output, resume, crash-safe replacement, a
DataNode lost mid-run, evaluate and generate on HDFS, and runs read back over WebHDFS."""
import getpass
import gzip
import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from rnnlm import cli, config, runs
from rnnlm.core import checkpoint
from rnnlm.core.metrics import json_lines
from rnnlm.core.model import RNNLM
from rnnlm.spark import corpus, reader
from rnnlm.hadoop.minicluster import hostname_not_on_loopback
from rnnlm.spark.hfs import HadoopFS, default_fs
from conftest import HARBOUR, HARBOUR_VALID, ROOT, TINY_CLUSTER, core_nll, held_out_tokens, train_cmd
from test_minicluster import LOOPBACK, listening

pytestmark = [pytest.mark.hadoop, pytest.mark.slow]

USER = getpass.getuser()
# a small character LSTM that writes a checkpoint every round, so that HDFS is written throughout
HDFS_RUN = [*TINY_CLUSTER, "train.eval_every=3",
            "train.checkpoint_every=1", f"data.train=file://{HARBOUR}", f"data.valid=file://{HARBOUR_VALID}"]


def job_env(hadoop):
    """A job's environment as a user's shell has it: the cluster's ``HADOOP_CONF_DIR``, no gateway."""
    env = hadoop.env()
    env.pop("PYSPARK_GATEWAY_PORT", None)
    return env


def train(hadoop, out, *sets, resume=False, cwd=None):
    """``jobs/train.py`` as a user runs it, with the cluster's ``HADOOP_CONF_DIR``."""
    r = subprocess.run(train_cmd(out, *HDFS_RUN, *sets, resume=resume), cwd=cwd or ROOT, env=job_env(hadoop),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def read_ck(webhdfs, path):
    """A checkpoint on HDFS, read over WebHDFS (no Spark), as ``checkpoint.load`` reads a local one."""
    def read(name):
        if webhdfs.status(f"{path}/{name}", strict=False) is None:
            return None
        with webhdfs.read(f"{path}/{name}") as f:
            return f.read()
    return checkpoint.from_files(read, path)


def cat(webhdfs, path) -> bytes:
    with webhdfs.read(path) as f:
        return f.read()


def metrics(webhdfs, run):
    return json_lines(cat(webhdfs, f"{run}/metrics.jsonl"))


def rounds_written(webhdfs, run) -> int:
    """Complete lines of a run's metrics while it is being written (0 while there is no file:
    a rewrite replaces it through a moment without one)."""
    try:
        return cat(webhdfs, f"{run}/metrics.jsonl").count(b"\n")
    except Exception:               # HdfsError: the file is missing at that moment
        return 0


def home(path):
    """The absolute HDFS path of a scheme-less one: relative paths are under /user/<name>."""
    return f"/user/{USER}/{path}"


@pytest.fixture(scope="module")
def reference(hadoop, webhdfs, tmp_path_factory):
    """A 6-round run written to HDFS through a scheme-less --out, as on a YARN cluster."""
    cwd = tmp_path_factory.mktemp("cwd")
    train(hadoop, "runs/ref", "train.rounds=6", cwd=str(cwd))
    assert list(cwd.iterdir()) == []            # nothing landed on the local disk
    return home("runs/ref")


def test_cluster_is_real_and_on_loopback(hadoop, webhdfs):
    assert default_fs(hadoop.endpoints.conf_dir) == hadoop.endpoints.fs_default
    assert hadoop.endpoints.fs_default.startswith("hdfs://localhost:")
    webhdfs.write("/probe/x", b"abc", overwrite=True, replication=2)
    st = webhdfs.status("/probe/x")
    assert (st["length"], st["replication"]) == (3, 2)
    ports = listening(hadoop.proc.pid)
    named = [hadoop.endpoints.fs_default, hadoop.endpoints.webhdfs, hadoop.endpoints.yarn, hadoop.endpoints.yarn_web]
    assert {int(e.rsplit(":", 1)[1]) for e in named} <= {port for _, port in ports}
    if hostname_not_on_loopback() is None:      # YARN listens where the hostname resolves (rnnlm.hadoop)
        assert {a for a, _ in ports} <= LOOPBACK, ports


def test_corpus_on_hdfs_reads_as_on_the_local_disk(spark, hadoop, webhdfs, tmp_path):
    """Plain, gzip and a directory of files: vocabulary and every partition's tokens equal file://'s."""
    text = open(HARBOUR, "rb").read()
    cut = text.index(b"\n\n", len(text) // 2) + 2
    local = tmp_path / "dir"
    local.mkdir()
    (local / "part-0").write_bytes(text[:cut])
    (local / "part-1").write_bytes(text[cut:])
    (tmp_path / "h.txt.gz").write_bytes(gzip.compress(text))
    webhdfs.write("/corpus/plain/harbour.txt", text, overwrite=True)
    webhdfs.write("/corpus/gz/harbour.txt.gz", gzip.compress(text), overwrite=True)
    webhdfs.write("/corpus/dir/part-0", text[:cut], overwrite=True)
    webhdfs.write("/corpus/dir/part-1", text[cut:], overwrite=True)
    fs = hadoop.endpoints.fs_default
    pairs = [(f"file://{HARBOUR}", f"{fs}/corpus/plain/harbour.txt"),
             (f"file://{tmp_path}/h.txt.gz", f"{fs}/corpus/gz/harbour.txt.gz"),
             (f"file://{local}", f"{fs}/corpus/dir")]
    sc = spark.sparkContext
    for level in ("char", "word"):
        for on_disk, on_hdfs in pairs:
            got = []
            for path in (on_disk, on_hdfs):
                cfg = config.load(None, [f"data.train={path}", f"data.level={level}", "data.partitions=2",
                                         "train.bptt=8", "train.batch=2"])
                data = corpus.load_corpus(sc, cfg)
                got.append((data.vocab, [(pid, t.tolist(), s.tolist()) for pid, t, s in data.train.collect()]))
                data.train.unpersist()
            assert got[0][0] == got[1][0], (level, on_hdfs)
            assert got[0][1] == got[1][1], (level, on_hdfs)
            assert sum(len(t) for _, t, _ in got[0][1]) > 1000


def test_a_record_hadoop_skips_on_hdfs_is_refused_wherever_it_lies(spark, hadoop, webhdfs):
    """No scan can look at a corpus on HDFS before Spark reads it, and Hadoop's reader skips a record past
    data.max_record_mb without a word: the run trained without it. The records' offsets show where it skipped:
    inside a split, across a split's end, at a file's end, the whole of a file (named as the local scan names it, a
    text of lone \\r line ends too: one paragraph, which the line mode reads), in gzip'd text, before a line of
    Latin-1 (Hadoop hands its undecodable bytes over as U+FFFD, three bytes each: measured so, the line hid the
    gap); a corpus without such a record reads whole, in as many splits, undecodable bytes and all."""
    mib, fs = 1 << 20, hadoop.endpoints.fs_default
    long = b"x" * (mib + 9)
    lines = b"".join(b"line %d of the corpus\n" % i for i in range(60_000))        # 1.4 MiB
    cut = lines.index(b"\n", 9000) + 1
    # two splits, the first ending just after the line that follows the long one: the skip shows in the next split
    edge = lines[:cut] + long + b"\ny\n" + lines[:cut + mib + 7] + b"\n"
    assert len(edge) // 2 == cut + mib + 10
    latin = "élève, été, déjà, café, naïve, résumé\n".encode("latin-1")     # ten bytes UTF-8 does not decode
    skipped, over = "is longer than 1 MiB (Hadoop skipped it)", "is longer than 1 MiB"
    refused = "records longer than data.max_record_mb = 1 MiB are refused (--set data.max_record_mb=N raises it)"
    mac = b"first words\r\r" + b"a line of words\r" * 70_000        # lone \r line ends: no blank line, one paragraph
    cases = {                           # name -> (bytes, partitions, mode, the error's middle)
        "inside": (lines[:cut] + long + b"\n" + lines, 1, "line",
                   f"a line between bytes {cut:,} and {cut + mib + 31:,} {skipped}"),
        "before-split-end": (edge, 2, "line", f"a line between bytes {cut:,} and {cut + mib + 12:,} {skipped}"),
        "split-end": (lines + long + b"\n" + lines, 4, "line", f"a line at byte {len(lines):,} {over}"),
        "file-end": (lines + long + b"\n", 2, "line",
                     f"a line between bytes {len(lines) - 25:,} and {len(lines) + mib + 10:,} {skipped}"),
        "whole": (long, 1, "line", f" has no line end in its first 1 MiB: it is one huge line, and {refused}"),
        "mac": (mac, 1, "blank_line", f" has no blank line in its first 1 MiB: it is one paragraph, and {refused}; "
                                      "data.paragraphs = 'line' reads it line by line"),
        "gzip": (gzip.compress(lines + b"\n" + long + b"\nlast\n"), 2, "line",
                 f"a line between bytes {len(lines) + 1:,} and {len(lines) + mib + 16:,} of its text {skipped}"),
        "latin-1": (lines[:cut] + long + b"\n" + latin + lines, 1, "line",
                    f"a line between bytes {cut:,} and {cut + mib + 10 + len(latin):,} {skipped}"),
        "paragraph": (b"first words\n\n" + long + b"\n\nlast words\n", 2, "blank_line",
                      f"a paragraph between bytes 13 and 1,048,611 {skipped}"),
    }
    sc = spark.sparkContext
    for name, (data, parts, mode, where) in cases.items():
        path = f"/corpus/long/{name}" + (".gz" if name == "gzip" else ".txt")
        webhdfs.write(path, data, overwrite=True)
        path = fs + path
        with pytest.raises(reader.CorpusError) as e:
            reader.paragraphs(sc, path, mode, "word", parts, max_record_mb=1)
        assert str(e.value) == f"{path}: {path}" + (where if where[0] == " " else f": {where}: {refused}"), name
        if name == "mac":               # as it says: line by line, the lines are short
            assert reader.paragraphs(sc, path, "line", "word", 1, max_record_mb=1).count() == 70_001
            continue
        loose = reader.paragraphs(sc, path, mode, "word", parts, max_record_mb=2).collect()
        assert max(map(len, loose)) == mib + 9, name                 # under a higher limit it is read
    # a line a few bytes over the limit, which Hadoop hands over whole, undecodable: refused by its bytes in the file
    webhdfs.write("/corpus/long/ff.txt", lines[:cut] + b"\xff" * (mib + 5) + b"\n" + lines, overwrite=True)
    with pytest.raises(reader.CorpusError, match=f": a line at byte {cut:,} is longer than 1 MiB: records"):
        reader.paragraphs(sc, f"{fs}/corpus/long/ff.txt", "line", "word", 1, max_record_mb=1)
    r = subprocess.run(train_cmd("/tmp/never", f"data.train={fs}/corpus/long/inside.txt", "data.paragraphs=line",
                                 "data.max_record_mb=1"),
                       env=job_env(hadoop), capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stderr.splitlines()[-1]) == (2, f"error: data.train: {fs}/corpus/long/inside.txt: "
                                                            f"{cases['inside'][3]}: records longer than "
                                                            "data.max_record_mb = 1 MiB are refused (--set "
                                                            "data.max_record_mb=N raises it)"), r.stderr
    # 0.4 MiB of bytes that are not UTF-8, 1.2 MB as the U+FFFDs Python is handed: within the limit
    fine = lines + b"w" * mib + b"\n" + b"\xff" * 400_000 + b"\n" + lines
    webhdfs.write("/corpus/long/fine.txt", fine, overwrite=True)
    read = reader.paragraphs(sc, f"{fs}/corpus/long/fine.txt", "line", "word", 4, max_record_mb=1)
    assert read.getNumPartitions() == 4 and read.collect() == fine.decode(errors="replace").splitlines()
    cfg = config.load(None, [f"data.train={fs}/corpus/long/fine.txt", f"data.valid={fs}/corpus/long/inside.txt",
                             "data.paragraphs=line", "data.max_record_mb=1", "data.level=word"])
    with pytest.raises(reader.CorpusError, match=f"^data.valid: {fs}/corpus/long/inside.txt: a line between"):
        corpus.load_corpus(sc, cfg)


def test_run_on_hdfs_resumes_bit_for_bit(hadoop, webhdfs, reference):
    """3 + 3 rounds with the checkpoint on HDFS equal 6 rounds at once."""
    run = f"{hadoop.endpoints.fs_default}{home('runs/halves')}"
    train(hadoop, run, "train.rounds=3")
    train(hadoop, run, "train.rounds=6", resume=True)
    assert set(webhdfs.list(home("runs/halves"))) == {"run.json", "metrics.jsonl", "checkpoint", "best"}
    info = json.loads(cat(webhdfs, f"{home('runs/halves')}/run.json"))
    assert len(info["resumed"]) == 1
    a, b = read_ck(webhdfs, f"{reference}/checkpoint"), read_ck(webhdfs, f"{home('runs/halves')}/checkpoint")
    assert np.array_equal(a.params, b.params)
    assert a.optim.keys() == b.optim.keys() and all(np.array_equal(a.optim[k], b.optim[k]) for k in a.optim)
    ma, mb = metrics(webhdfs, reference), metrics(webhdfs, home("runs/halves"))
    assert [m["train_loss"] for m in ma] == [m["train_loss"] for m in mb] and len(ma) == 6


def test_evaluate_and_generate_read_a_checkpoint_on_hdfs(hadoop, webhdfs, reference, tmp_path):
    env = job_env(hadoop)
    last = metrics(webhdfs, reference)[-1]
    ev = subprocess.run([sys.executable, "jobs/evaluate.py", "--checkpoint", "runs/ref", "--data",
                         f"file://{HARBOUR_VALID}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]
    ppl = float(ev.stdout.strip().splitlines()[-1].removeprefix("ppl="))
    assert ppl == pytest.approx(last["valid_ppl"], rel=1e-4)
    # both from the core model alone: the checkpoint's mean NLL of the text's 708 tokens
    ck = read_ck(webhdfs, f"{reference}/checkpoint")
    total, count = core_nll(RNNLM(ck.config.model), ck.params, [held_out_tokens(ck.vocab, HARBOUR_VALID)])
    assert count == 707 and last["valid_loss"] == pytest.approx(total / count, rel=1e-9)
    assert ppl == pytest.approx(math.exp(total / count), rel=1e-4)
    # generate: the same text from HDFS as from a local copy of the checkpoint
    local = tmp_path / "checkpoint"
    webhdfs.download(f"{reference}/checkpoint", str(local))
    outs = []
    for path in (f"{hadoop.endpoints.fs_default}{reference}", f"file://{local}"):
        g = subprocess.run([sys.executable, "jobs/generate.py", "--checkpoint", path, "--length", "80",
                            "--seed", "7"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert g.returncode == 0, g.stderr[-2000:]
        outs.append(g.stdout)
    assert outs[0] == outs[1] and len(outs[0]) >= 80


def test_a_file_longer_than_its_status_says_is_read_no_further_than_the_limit(spark, hadoop):
    """A bounded read trusts the bytes it reads, not the length the NameNode gave before (a file that
    grew between the two, as a run's metrics appended by its writer): here a status that says 10 bytes
    of a 4,096-byte file on HDFS."""
    class Stale(HadoopFS):
        def size(self, p):
            return 10 if super().size(p) is not None else None
    p = f"{hadoop.endpoints.fs_default}/bound/metrics.jsonl"
    fs = Stale(spark.sparkContext, p)
    fs.write(p, b"x" * 4096)
    assert fs.read_at_most(p, 4096) == b"x" * 4096
    with pytest.raises(ValueError, match=r"/bound/metrics.jsonl: more than the 1,000 bytes it is read up to"):
        fs.read_at_most(p, 1000)


def test_checkpoint_replacement_survives_a_crash_at_every_step(spark, hadoop):
    """The <name>.old protocol against the NameNode's own rename semantics: a write that dies
    after any of its steps leaves the old or the new checkpoint for the next reader, never neither."""
    from rnnlm.core.files import backup
    sc = spark.sparkContext
    root = f"{hadoop.endpoints.fs_default}/crash"
    cfg = config.load(None, ["data.train=x", "model.vocab_size=5", "model.hidden=4"])
    from rnnlm.core.models import build as build_model
    from rnnlm.core.vocab import Vocab
    vocab = Vocab.from_counts({c: 1 for c in "abcd"}, "char")
    size = build_model(cfg.model).layout.size
    cks = [checkpoint.Checkpoint(params=np.full(size, v, np.float32), config=cfg, vocab=vocab, optim={})
           for v in (1.0, 2.0)]

    class Crash(Exception):
        pass

    class Dying(HadoopFS):
        """Dies at its ``budget``-th step: just before one of its changes through the public primitives
        (mkdirs, write, rename), or just after a rename (to ``after``: whatever the budget). Only a rename
        changes what a reader finds, and the protocol removes at most one thing between two changes, so
        every state a crash can leave is one of these."""
        def __init__(self, budget=0, after=None):
            super().__init__(sc, root)
            self.budget, self.after, self.steps = budget, after, 0

        def _step(self):
            self.steps += 1
            if self.steps == self.budget:
                raise Crash()

        def write(self, p, data):
            self._step()
            super().write(p, data)

        def rename(self, src, dst):
            self._step()
            super().rename(src, dst)
            if dst == self.after:
                raise Crash()
            self._step()

        def mkdirs(self, p):
            self._step()
            super().mkdirs(p)

    def replace_old_by_new(dying):
        """Checkpoint 1.0 written whole, then ``dying`` replaces it by 2.0; whether it died."""
        fs = HadoopFS(sc, root)
        fs.delete(path)
        fs.write_dir_atomic(path, checkpoint.to_files(cks[0]))
        try:
            dying.write_dir_atomic(path, checkpoint.to_files(cks[1]))
        except Crash:
            return True
        return False

    path = f"{root}/checkpoint"
    seen, budget = [], 0
    while replace_old_by_new(Dying(budget + 1)):
        budget += 1
        got = cli.read_checkpoint(sc, path)       # a new reader, as --resume would be
        seen.append(float(got.params[0]))
    assert float(cli.read_checkpoint(sc, path).params[0]) == 2.0       # the replacement that did not die
    # old until the new one is renamed into place (the last change), then new
    assert seen == [1.0] * (budget - 1) + [2.0] and budget > len(checkpoint.to_files(cks[1])), seen
    # the moment that matters: between the two renames only <name>.old exists on HDFS
    fs = HadoopFS(sc, root)
    assert replace_old_by_new(Dying(after=backup(path)))
    assert not fs.exists(path) and fs.exists(backup(path))
    assert float(cli.read_checkpoint(sc, path).params[0]) == 1.0
    assert not fs.exists(path) and fs.exists(backup(path))             # read where it lies, moved by no reader
    fs.write_dir_atomic(path, checkpoint.to_files(cks[1]))               # the next save completes
    assert float(cli.read_checkpoint(sc, path).params[0]) == 2.0 and not fs.exists(backup(path))
    # dead after the new one is in place, before its backup is dropped: the new one is read
    assert replace_old_by_new(Dying(after=path))
    assert fs.exists(path) and fs.exists(backup(path))
    assert float(cli.read_checkpoint(sc, path).params[0]) == 2.0


def test_a_datanode_lost_mid_run_changes_nothing(hadoop, webhdfs, reference):
    """Replication 2: with one of the two DataNodes stopped after round 2, the run completes,
    writing its checkpoints to the other, with exactly the reference's result."""
    out = home("runs/dn")
    proc = subprocess.Popen(train_cmd(out, *HDFS_RUN, "train.rounds=6"), cwd=ROOT, env=job_env(hadoop),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped_at = None
    try:
        deadline = time.time() + 240
        while proc.poll() is None and time.time() < deadline and stopped_at is None:
            done = rounds_written(webhdfs, out)
            if done >= 2:
                hadoop.stop_datanode(1)
                stopped_at = done
            time.sleep(0.05)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        if stopped_at is not None:
            hadoop.restart_datanode(1)
    assert stopped_at is not None and stopped_at < 6, "the run ended before a DataNode could be stopped"
    assert proc.returncode == 0, err[-3000:]
    done = metrics(webhdfs, out)
    assert len(done) == 6
    a, b = read_ck(webhdfs, f"{reference}/checkpoint"), read_ck(webhdfs, f"{out}/checkpoint")
    assert np.array_equal(a.params, b.params)
    assert [m["train_loss"] for m in done] == [m["train_loss"] for m in metrics(webhdfs, reference)]


def test_runs_and_plots_read_hdfs_over_webhdfs(hadoop, webhdfs, reference, tmp_path):
    url = hadoop.endpoints.webhdfs.replace("http://", "webhdfs://")
    r = runs.load(f"{url}{reference}")
    assert r.metrics == metrics(webhdfs, reference)
    assert r.config["model"]["hidden"] == 24 and r.info["master"] == "local[2]"
    with pytest.raises(runs.RunError, match=r"/no/such/run: not a run \(no such directory\)$"):
        runs.load(f"{url}/no/such/run")
    # a run still being written: its last line cut short is dropped, as on a local disk
    lines = cat(webhdfs, f"{reference}/metrics.jsonl")
    webhdfs.write(f"{home('runs/partial')}/metrics.jsonl", lines + b'{"round": 7, "tra', overwrite=True)
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "metrics.jsonl").write_bytes(lines + b'{"round": 7, "tra')
    assert runs.load(f"{url}{home('runs/partial')}").metrics == runs.load(str(tmp_path / "partial")).metrics \
        == r.metrics
    # a folder of runs on HDFS, drawn by the plot job
    fig = tmp_path / "fig.png"
    p = subprocess.run([sys.executable, "jobs/plot.py", "--runs", f"{url}{home('runs')}", "--out", str(fig)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"ref", "partial"} <= {x.name for x in runs.load_all([f"{url}{home('runs')}"])}
    # and the convergence notebook, pointed at HDFS
    from test_notebooks import execute, outputs
    nb = execute("convergence_vs_communication.ipynb", {"RNNLM_RUNS": f"{url}{home('runs')}"})
    assert f"train_loss {r.metrics[-1]['train_loss']:.3f}" in outputs(nb)
    assert sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs) == 3
