import hashlib
import io
import json
import struct
import dataclasses
import os
import pickle
import zipfile

import numpy as np
import pytest

from rnnlm.core import checkpoint as ckpt
from rnnlm import config
from rnnlm.core.model import RNNLM
from rnnlm.core.optim import make_optimizer
from rnnlm.core.vocab import Vocab


@pytest.fixture
def ck():
    vocab = Vocab.build("abracadabra", "char")
    cfg = config.replace(config.load(None, ["model.hidden=8", "optim.name=adam"]), "model",
                         vocab_size=len(vocab))
    m = RNNLM(cfg.model)
    p = m.init_params(1)
    st = make_optimizer(cfg.optim).init_state(p)
    st["m"] += 0.25
    return ckpt.Checkpoint(params=p, config=cfg, vocab=vocab,
                           optim={k: v for k, v in st.items() if k != "t"}, optim_t=7,
                           position={"round": 3, "epoch": 0.5},
                           hidden=np.stack([m.zero_state(cfg.train.batch) + 1] * cfg.data.partitions),
                           schedule={"lr": 0.5, "best": 2.0})


def test_round_trip(tmp_path, ck):
    path = str(tmp_path / "c1")
    ckpt.save(path, ck)
    got = ckpt.load(path, expect=ck.config.model)
    assert np.array_equal(got.params, ck.params) and got.params.dtype == np.float32
    assert got.config == ck.config and got.vocab == ck.vocab
    assert np.array_equal(got.optim["m"], ck.optim["m"]) and got.optim_t == 7
    assert got.position == {"round": 3, "epoch": 0.5} and got.schedule == ck.schedule
    assert np.array_equal(got.hidden, ck.hidden)
    # overwrite is atomic: no temp or old directories are left behind
    ckpt.save(path, ck)
    assert sorted(os.listdir(tmp_path)) == ["c1"]
    ck.hidden = ck.hidden[0]               # one stream's state, as the one-machine trainer saves it
    ckpt.save(path, ck)
    assert np.array_equal(ckpt.load(path).hidden, ck.hidden)


def _saved(tmp_path, ck):
    path = str(tmp_path / "c")
    ckpt.save(path, ck)
    return path


def test_truncated_is_rejected(tmp_path, ck):
    path = _saved(tmp_path, ck)
    f = os.path.join(path, "params.npy")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match="params.npy is truncated"):
        ckpt.load(path)


def test_corrupt_is_rejected(tmp_path, ck):
    path = _saved(tmp_path, ck)
    f = os.path.join(path, "optim.npz")
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(f, "wb").write(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="optim.npz is corrupt"):
        ckpt.load(path)


def test_missing_manifest_and_missing_dir(tmp_path, ck):
    path = _saved(tmp_path, ck)
    os.remove(os.path.join(path, ckpt.MANIFEST))
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint"):
        ckpt.load(path)
    with pytest.raises(ckpt.CheckpointError, match="not found"):
        ckpt.load(str(tmp_path / "nope"))
    with pytest.raises(ckpt.CheckpointError, match=f"not a checkpoint: {tmp_path}/plain.txt is a file"):
        (tmp_path / "plain.txt").write_text("text\n")
        ckpt.load(str(tmp_path / "plain.txt"))


def test_mismatched_config_is_rejected(tmp_path, ck):
    path = _saved(tmp_path, ck)
    other = config.replace(ck.config, "model", hidden=16).model
    with pytest.raises(ckpt.CheckpointError, match="differs .* in hidden"):
        ckpt.load(path, expect=other)


def test_mismatched_shapes_are_rejected(tmp_path, ck):
    ck.params = np.zeros(ck.params.size + 1, np.float32)
    path = _saved(tmp_path, ck)
    with pytest.raises(ckpt.CheckpointError, match="params are float32"):
        ckpt.load(path)


def test_pickle_is_refused(tmp_path, ck):
    """Even with a valid manifest, a pickled payload is never unpickled."""
    path = str(tmp_path / "p")
    os.makedirs(path)
    payload = pickle.dumps({"evil": 1})
    good = ckpt.to_files(_fresh(ck))
    good["params.npy"] = payload
    man = json.loads(good[ckpt.MANIFEST])
    man["params.npy"] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    good[ckpt.MANIFEST] = json.dumps(man).encode()
    for name, data in good.items():
        open(os.path.join(path, name), "wb").write(data)
    with pytest.raises(ckpt.CheckpointError, match="pickled data, refused"):
        ckpt.load(path)


def _fresh(ck):
    return ckpt.Checkpoint(params=RNNLM(ck.config.model).init_params(0), config=ck.config, vocab=ck.vocab)


def test_a_checkpoint_read_while_it_is_saved_leaves_the_save_to_finish(tmp_path, ck, monkeypatch):
    """``rnnlm generate`` on a running run: a load between the save's two renames moved the backup back,
    and the save's rename of the new checkpoint into place failed (ENOTEMPTY): the run stopped."""
    path = str(tmp_path / "checkpoint")
    ckpt.save(path, ck)
    newer = dataclasses.replace(ck, params=ck.params + 1)
    real, seen = os.rename, []

    def rename(src, dst):
        real(src, dst)
        if str(dst).endswith("checkpoint.old"):
            seen.append(ckpt.load(path).params)
    monkeypatch.setattr(os, "rename", rename)
    ckpt.save(path, newer)
    assert len(seen) == 1 and np.array_equal(seen[0], ck.params)
    assert np.array_equal(ckpt.load(path).params, newer.params) and not os.path.exists(path + ".old")


def test_a_run_directory_loads_its_checkpoint_even_one_left_as_old(tmp_path, ck):
    run = tmp_path / "run"
    ckpt.save(str(run / "checkpoint"), ck)
    (run / "metrics.jsonl").write_text("{}\n")
    assert np.array_equal(ckpt.load(str(run)).params, ck.params)
    os.rename(run / "checkpoint", run / "checkpoint.old")      # a save cut (or under way) between its two renames
    assert np.array_equal(ckpt.load(str(run)).params, ck.params)
    assert not (run / "checkpoint").exists() and (run / "checkpoint.old").is_dir()    # read where it lies
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint"):
        ckpt.load(str(tmp_path))                                # neither a checkpoint nor a run's


def _crafted(tmp_path, ck, **changes):
    """A checkpoint directory whose files are ``ck``'s with ``changes`` (name -> bytes) and a manifest that
    vouches for them: what a crafted checkpoint looks like to the loader."""
    files = ckpt.to_files(ck)
    manifest = json.loads(files.pop(ckpt.MANIFEST))
    for name, data in changes.items():
        files[name] = data
        manifest[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    path = tmp_path / "crafted"
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    return str(path)


def _save(a):
    import io
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def _state(ck, **changes):
    state = json.loads(ckpt.to_files(ck)["state.json"])
    state.update(changes)
    return json.dumps(state).encode()


@pytest.mark.parametrize("name", ["../../etc/hostname", "/dev/zero", "sub/params.npy", "..", ".hidden", "", "a\\b"])
def test_manifest_entries_must_be_plain_file_names_in_the_checkpoint(ck, name):
    """The manifest's names were joined to the directory unchecked: ../../etc/hostname and /dev/zero were read."""
    files = ckpt.to_files(ck)
    manifest = json.loads(files[ckpt.MANIFEST])
    manifest[name] = {"size": 10, "sha256": "0" * 64}
    files[ckpt.MANIFEST] = json.dumps(manifest).encode()
    asked = []

    def read(n):
        asked.append(n)
        return files.get(n)

    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.from_files(read, "where")
    assert str(e.value) == f"where: MANIFEST.json names {name!r}, not a plain file name in the checkpoint"
    assert name not in asked


def test_a_checkpoint_file_that_is_not_a_regular_file_is_not_read(tmp_path, ck):
    """A fifo (or a link to /dev/zero) under a manifest's name: refused before it is opened."""
    path = _saved(tmp_path, ck)
    os.remove(os.path.join(path, "vocab.json"))
    os.mkfifo(os.path.join(path, "vocab.json"))
    import threading
    out = {}
    th = threading.Thread(target=lambda: out.update(e=pytest.raises(ckpt.CheckpointError, ckpt.load, path)),
                          daemon=True)
    th.start()
    th.join(10)
    if th.is_alive():                                        # it opened the fifo: let it go, then fail
        open(os.path.join(path, "vocab.json"), "wb").close()
        th.join(5)
    assert not th.is_alive() and "e" in out, "the loader opened a fifo"
    assert str(out["e"].value) == f"{path}: vocab.json is not a regular file"


@pytest.mark.parametrize("what, needle", [
    ("manifest list", "MANIFEST.json is not a table of files"),
    ("manifest entry", "MANIFEST.json: params.npy needs an integer size and a sha256"),
    ("zip in params.npy", "params.npy is not a NumPy array file"),
    ("truncated optim.npz", "optim.npz is not a zip of NumPy arrays"),
    ("huge declared shape", "params.npy declares 8000000000000 bytes of float64 in a"),
    ("state.json list", "state.json must be a table with position, schedule and optim_t"),
    ("optim_t string", "state.json: optim_t must be an integer >= 0"),
    ("optim_t float", "state.json: optim_t must be an integer >= 0"),
    ("optim_t_local list", "state.json: optim_t_local must be a table of integers >= 0 by partition (0 to 1)"),
    ("optim_t_local pid", "state.json: optim_t_local must be a table of integers >= 0 by partition (0 to 1)"),
    ("optim_t_local sign", "state.json: optim_t_local must be a table of integers >= 0 by partition (0 to 1)"),
    ("optim_t_local bool", "state.json: optim_t_local must be a table of integers >= 0 by partition (0 to 1)"),
    ("position list", "state.json must be a table with position, schedule and optim_t"),
    ("hidden shape", "hidden.npy is float32[2, 1, 2, 8, 19], the configuration needs float32[2, 1, 2, 8, 20]"),
    ("hidden dtype", "hidden.npy is float64[2, 1, 2, 8, 20], the configuration needs float32[2, 1, 2, 8, 20]"),
    ("optim dtype", "optimizer slot m is int64[{size}], the configuration needs float32[{size}]"),
    ("optim name", "optimizer slot name 'px/m' is not one a trainer writes"),
    ("object array", "hidden.npy contains pickled data, refused"),
    ("manifest lacks", "manifest lacks vocab.json"),
    ("manifest lacks config.json", "manifest lacks config.json"),
    ("manifest lacks state.json", "manifest lacks state.json"),
    ("manifest lacks params.npy", "manifest lacks params.npy"),
    ("manifest lacks optim.npz", "manifest lacks optim.npz"),
    ("vocab size", "vocabulary has 5 tokens, model.vocab_size is 6"),
    ("trailing bytes", "params.npy declares {nbytes} bytes of float32 in a {total}-byte file"),
    ("vocab count", "vocabulary counts must be a list of integers in [0, 2**63)"),
    ("optim member name", "optim.npz holds 'm.bin' ("),
    ("optim member size", "optim.npz holds 'm.npy' ("),
])
def test_a_crafted_checkpoint_is_one_line_not_a_traceback(tmp_path, ck, what, needle):
    size = ck.params.size
    b = __import__("io").BytesIO()
    if what == "manifest list":
        path = _saved(tmp_path, ck)
        open(os.path.join(path, ckpt.MANIFEST), "w").write("[1, 2]")
    elif what == "manifest entry":
        path = _saved(tmp_path, ck)
        man = json.load(open(os.path.join(path, ckpt.MANIFEST)))
        man["params.npy"] = "big"
        open(os.path.join(path, ckpt.MANIFEST), "w").write(json.dumps(man))
    elif what == "zip in params.npy":
        np.savez(b, params=ck.params)
        path = _crafted(tmp_path, ck, **{"params.npy": b.getvalue()})
    elif what == "truncated optim.npz":
        np.savez(b, **ck.optim)
        path = _crafted(tmp_path, ck, **{"optim.npz": b.getvalue()[:len(b.getvalue()) // 2]})
    elif what == "huge declared shape":
        head = _save(np.zeros(3)).replace(b"(3,), }", b"(1000000000000,), }")      # 24 bytes of data follow
        path = _crafted(tmp_path, ck, **{"params.npy": head})
    elif what == "state.json list":
        path = _crafted(tmp_path, ck, **{"state.json": b"[1, 2]"})
    elif what == "optim_t string":
        path = _crafted(tmp_path, ck, **{"state.json": _state(ck, optim_t="7")})
    elif what == "optim_t float":
        path = _crafted(tmp_path, ck, **{"state.json": _state(ck, optim_t=7.5)})
    elif what == "position list":
        path = _crafted(tmp_path, ck, **{"state.json": _state(ck, position=[3])})
    elif what.startswith("optim_t_local"):
        bad = {"list": [3, 4], "pid": {"0": 3, "2": 4, "\u00b2": 1}, "sign": {"1": -1},
               "bool": {"0": True}}[what.split()[1]]
        path = _crafted(tmp_path, ck, **{"state.json": _state(ck, optim_t_local=bad)})
    elif what in ("hidden shape", "hidden dtype"):
        h = np.zeros((2, 1, 2, 8, 19), np.float32) if what == "hidden shape" else np.zeros((2, 1, 2, 8, 20))
        path = _crafted(tmp_path, ck, **{"hidden.npy": _save(h)})
    elif what == "object array":
        np.save(b, np.array([None, {"evil": 1}], dtype=object), allow_pickle=True)
        path = _crafted(tmp_path, ck, **{"hidden.npy": b.getvalue()})
    elif what.startswith("manifest lacks"):
        path = _saved(tmp_path, ck)
        man = json.load(open(os.path.join(path, ckpt.MANIFEST)))
        del man[what.split()[2] if len(what.split()) > 2 else "vocab.json"]
        open(os.path.join(path, ckpt.MANIFEST), "w").write(json.dumps(man))
    elif what == "vocab size":                     # a vocabulary of another model: ids past the table
        vocab = json.loads(ck.vocab.to_json())
        vocab = {k: v[:-2] + v[-1:] if isinstance(v, list) else v for k, v in vocab.items()}
        path = _crafted(tmp_path, ck, **{"vocab.json": json.dumps(vocab).encode()})
    elif what == "trailing bytes":                 # junk after the array: not the file a save writes
        path = _crafted(tmp_path, ck, **{"params.npy": _save(ck.params) + b"\0" * 64})
    elif what == "vocab count":                    # was an OverflowError's traceback
        vocab = json.loads(ck.vocab.to_json())
        vocab["counts"][0] = 10 ** 30
        path = _crafted(tmp_path, ck, **{"vocab.json": json.dumps(vocab).encode()})
    elif what.startswith("optim member"):          # refused from the zip's directory, before it is read
        import zipfile
        with zipfile.ZipFile(b, "w") as z:
            z.writestr("m.bin" if what.endswith("name") else "m.npy",
                       _save(ck.optim["m"] if what.endswith("name") else np.zeros(size + 2000, np.float32)))
            z.writestr("v.npy", _save(ck.optim["v"]))
        path = _crafted(tmp_path, ck, **{"optim.npz": b.getvalue()})
    elif what == "optim dtype":
        np.savez(b, m=np.zeros(size, np.int64), v=ck.optim["v"])
        path = _crafted(tmp_path, ck, **{"optim.npz": b.getvalue()})
    else:
        np.savez(b, **{"px/m": ck.optim["m"]})
        path = _crafted(tmp_path, ck, **{"optim.npz": b.getvalue()})
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path)
    needle = needle.format(size=size, nbytes=size * 4, total=len(_save(ck.params)) + 64)
    assert str(e.value).startswith(f"{path}: {needle}") and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("field, value, needle", [
    ("position", {"round": "3", "tokens": 10}, "state.json: position: round must be an integer >= 0, not '3'"),
    ("position", {"round": 3, "tokens": -1}, "state.json: position: tokens must be a finite number >= 0, not -1"),
    ("position", {"round": 3, "wall_s": float("nan")}, "state.json: position: wall_s must be a finite number"),
    ("position", {"version": 2, "done": [1]}, "state.json: position: done must be a list of 2 integers >= 0"),
    ("position", {"version": 2, "done": [0, -1]}, "state.json: position: done must be a list of 2 integers >= 0"),
    ("position", {"version": 2, "done": ["a", 1]}, "state.json: position: done must be a list of 2 integers >= 0"),
    ("position", {"totals": {"refused_protocol": "many"}}, "state.json: position: totals must be a table of the "
                                                           "server's counters"),
    ("position", {"totals": {"syncs": 9}}, "state.json: position: totals must be a table of the server's counters"),
    ("position", {"totals": {"refused_\x1b[2J": 1}}, "state.json: position: totals must be a table of the server's"),
    ("position", {"line": {"round": 1}}, "state.json: position: line must be a metrics line with integer round"),
    ("position", {"line": {"round": 1, "syncs": 2, "bytes_sent": 0, "bytes_broadcast": 0}},
     "state.json: position: line must be a metrics line with integer round and syncs, and bytes_sent, "
     "bytes_broadcast, wall_s >= 0"),
    ("position", {"best": [1]}, "state.json: position: best must be a table or null"),
    ("schedule", {"lr": "0.5", "best": 2.0}, "state.json: schedule must be empty or hold a finite lr >= 0"),
    ("schedule", {"best": 2.0}, "state.json: schedule must be empty or hold a finite lr >= 0"),
    ("schedule", {"lr": 0.5, "best": float("nan")}, "state.json: schedule must be empty or hold a finite lr >= 0"),
    ("position", {"round": True, "tokens": 10}, "state.json: position: round must be an integer >= 0, not True"),
    ("position", {"round": 3, "wall_s": float("inf")}, "state.json: position: wall_s must be a finite number"),
    ("optim_t_local", {"2": 4}, "state.json: optim_t_local must be a table of integers >= 0 by partition (0 to 1)"),
    ("position", {"round": 3, "tokens": 10 ** 400}, "state.json: position: tokens must be a finite number >= 0"),
    ("schedule", {"lr": 10 ** 400, "best": 2.0}, "state.json: schedule must be empty or hold a finite lr >= 0"),
    ("schedule", {"lr": 0.5, "best": 10 ** 400}, "state.json: schedule must be empty or hold a finite lr >= 0"),
    ("schedule", {"lr": 0.5, "best": -1.0}, "state.json: schedule must be empty or hold a finite lr >= 0"),
    ("format", 2, "state.json: its parameters are packed as format 2 with another layout than this rnnlm's"),
    ("layout", [["embed", 0, [1, 1]]], "state.json: its parameters are packed as format 1 with another layout"),
])
def test_state_json_fields_are_typed_by_the_loader(tmp_path, ck, field, value, needle):
    """``"round": "3"`` passed the loader and the pre-Spark checks, and failed in trainer._resume with a
    TypeError after Spark started."""
    path = _crafted(tmp_path, ck, **{"state.json": _state(ck, **{field: value})})
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path)
    assert str(e.value).startswith(f"{path}: {needle}"), str(e.value)


def test_state_json_is_strict_json_before_a_plateaus_first_evaluation(tmp_path, ck):
    """A plateau schedule's best loss is infinite until it is first measured: state.json held Infinity,
    which Python reads and strict JSON readers (jq, a browser) refuse. It is null now, read back as infinite."""
    ck.schedule = {"lr": 0.5, "best": float("inf")}
    path = str(tmp_path / "c1")
    ckpt.save(path, ck)

    def strict(name):
        raise ValueError(f"not JSON: {name}")
    with open(os.path.join(path, "state.json")) as f:
        assert json.loads(f.read(), parse_constant=strict)["schedule"] == {"lr": 0.5, "best": None}
    assert ckpt.load(path).schedule == {"lr": 0.5, "best": float("inf")}


@pytest.mark.parametrize("best", [None, {"round": 0, "valid_ppl": 120.0}])
def test_a_position_at_its_edges_loads(tmp_path, ck, best):
    """Every count and amount at 0 (a run stopped before its first round), a best entry or none: a
    position the trainers write, taken as written."""
    position = {"round": 0, "version": 0, "step": 0, "tokens": 0, "bytes_sent": 0, "bytes_broadcast": 0,
                "wall_s": 0.0, "eval_s": 0.0, "epoch": 0.0, "pending_lr": 0.0, "done": [0, 0],
                "totals": {"refused_protocol": 0}, "best": best,
                "line": {"round": 0, "syncs": 0, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 0.0}}
    schedule = {"lr": 0.0, "best": float("inf")}        # a plateau schedule before its first evaluation
    got = ckpt.load(_crafted(tmp_path, ck, **{"state.json": _state(ck, position=position, optim_t=0,
                                                                   schedule=schedule)}))
    assert got.position == position and got.optim_t == 0 and got.schedule == schedule


def test_a_checkpoint_to_resume_must_hold_what_its_trainer_reads_back(tmp_path, ck):
    """A missing or empty position gave KeyError: 'round' in trainer._resume, after Spark started."""
    for position, lacks in (({}, "round"), ({"round": 3, "epoch": 0.5}, "tokens")):
        path = _crafted(tmp_path / lacks, ck, **{"state.json": _state(ck, position=position)})
        assert ckpt.load(path).position == position              # generate and evaluate can use it
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.load(path, resume=True)
        assert str(e.value) == (f"{path}: state.json's position has no {lacks}: not a checkpoint a sync run can "
                                "resume (rnnlm generate and evaluate can use it)")
    ck.config = config.replace(ck.config, "train", mode="async", push_every=3)
    ck.position = {"round": 3, "tokens": 100, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 1.0}
    path = _saved(tmp_path, ck)
    with pytest.raises(ckpt.CheckpointError, match="has no version: not a checkpoint a async run can resume"):
        ckpt.load(path, resume=True)
    ck.position.update(version=4, done=[2, 2], totals={"refused_duplicate": 0})
    assert ckpt.load(_saved(tmp_path, ck), resume=True).position["done"] == [2, 2]


@pytest.mark.parametrize("bad", [np.nan, -1.0])
def test_the_servers_adagrad_sums_must_be_finite_and_not_negative(tmp_path, ck, bad):
    """A NaN or negative accumulator made the server's parameters NaN, and the run blamed a worker."""
    ck.optim = {"server.acc": np.ones_like(ck.params)}
    assert ckpt.load(_saved(tmp_path / "good", ck)).optim["server.acc"].sum() == ck.params.size
    ck.optim["server.acc"][3] = bad
    path = _saved(tmp_path / "bad", ck)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path)
    assert str(e.value) == f"{path}: the parameter server's AdaGrad sums (server.acc) must be finite and >= 0"


def _big(hidden=128, name="adam"):
    """A checkpoint of a larger model (its float64 optimizer member: 0.5 MB)."""
    vocab = Vocab.build("abracadabra", "char")
    cfg = config.replace(config.load(None, [f"model.hidden={hidden}", f"optim.name={name}"]), "model",
                         vocab_size=len(vocab))
    p = RNNLM(cfg.model).init_params(1)
    return ckpt.Checkpoint(params=p, config=cfg, vocab=vocab, optim={k: np.zeros_like(p) for k in ("m", "v")},
                           position={"round": 1})


def _peak(fn):
    """``fn()``'s exception and the most memory it held at once (NumPy's arrays included: tracemalloc)."""
    import tracemalloc
    tracemalloc.start()
    try:
        fn()
    except ckpt.CheckpointError as e:
        err = e
    else:
        err = None
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return err, peak


def test_a_sparse_huge_params_file_is_refused_from_its_size_before_it_is_read(tmp_path, ck):
    """A sparse 3 GiB params.npy (truncate -s 3G) was read whole (MemoryError under ulimit -v 2 GiB)."""
    path = _saved(tmp_path, ck)
    f = os.path.join(path, "params.npy")
    size = 3 << 30
    os.truncate(f, size)
    man = json.load(open(os.path.join(path, ckpt.MANIFEST)))
    man["params.npy"]["size"] = size                              # the manifest vouches for it
    with open(os.path.join(path, ckpt.MANIFEST), "w") as out:
        json.dump(man, out)
    err, peak = _peak(lambda: ckpt.load(path))
    limit = ckpt.HEADER_BYTES + 4 * ck.params.size
    assert str(err) == (f"{path}: params.npy has {size} bytes, more than a checkpoint of its configuration holds "
                        f"({limit})")
    assert peak < 4 << 20, peak


def test_arrays_are_read_by_streaming_into_their_own_memory(tmp_path):
    """Each file was read whole as bytes, then copied into its array: twice the checkpoint's size."""
    ck = _big(hidden=512, name="sgd")
    ck.optim = {}
    path = _saved(tmp_path, ck)
    got = []
    err, peak = _peak(lambda: got.append(ckpt.load(path)))
    assert err is None and np.array_equal(got[0].params, ck.params)
    assert peak < ck.params.nbytes * 1.25 + (2 << 20), (peak, ck.params.nbytes)


def test_an_optim_npz_bomb_is_refused_before_it_is_inflated(tmp_path):
    """An npz of many members, each under the per-member cap, was inflated member after member (an 807 kB
    one drove peak RSS to 1.0 GB with hidden=2048)."""
    ck = _big()
    size, most = ck.params.size, ckpt.optimizer_arrays(ck.config)
    b = io.BytesIO()
    np.savez_compressed(b, **{f"m{i}": np.zeros(size) for i in range(60)})      # 60 float64 members of 0.5 MB
    path = _crafted(tmp_path, ck, **{"optim.npz": b.getvalue()})
    assert len(b.getvalue()) < size                                           # small on disk
    err, peak = _peak(lambda: ckpt.load(path))
    assert str(err).startswith(f"{path}: optim.npz declares 60 members in a ") and \
        str(err).endswith(f"a run of this configuration writes at most {most} optimizer arrays"), str(err)
    assert peak < ck.params.nbytes + (4 << 20), peak
    raw = bytearray(b.getvalue())                  # an end record that says fewer members than the directory holds
    raw[-12:-10] = (3).to_bytes(2, "little")
    path = _crafted(tmp_path / "lie", ck, **{"optim.npz": bytes(raw)})
    with pytest.raises(ckpt.CheckpointError, match=f"optim.npz holds 60 members: a run of this configuration "
                                                   f"writes at most {most} optimizer arrays$"):
        ckpt.load(path)                                                       # counted in the directory as well


def test_a_link_in_a_checkpoint_is_refused_without_following_it(tmp_path, ck):
    """A symlink loop as params.npy ended in OSError (Too many levels of symbolic links); a link to
    /proc/self/environ was followed, and the error told its size."""
    path = _saved(tmp_path, ck)
    os.remove(os.path.join(path, "params.npy"))
    os.symlink("params.npy", os.path.join(path, "params.npy"))               # a loop
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path)
    assert str(e.value) == f"{path}: params.npy is a symbolic link, refused (a checkpoint holds regular files only)"
    path = _saved(tmp_path / "b", ck)
    environ = open("/proc/self/environ", "rb").read()
    for name in ("vocab.json", ckpt.MANIFEST):
        os.replace(os.path.join(path, name), os.path.join(tmp_path, name))
        os.symlink("/proc/self/environ", os.path.join(path, name))
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.load(path)
        assert str(e.value) == f"{path}: {name} is a symbolic link, refused (a checkpoint holds regular files only)"
        assert "environ" not in str(e.value) and str(len(environ)) not in str(e.value)
        os.remove(os.path.join(path, name))
        os.replace(os.path.join(tmp_path, name), os.path.join(path, name))


def test_a_manifest_larger_than_any_checkpoints_is_refused_before_it_is_parsed(tmp_path, ck):
    path = _saved(tmp_path, ck)
    with open(os.path.join(path, ckpt.MANIFEST), "a") as f:
        f.write(" " * (2 << 20))                     # still the same JSON
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path)
    n = os.path.getsize(os.path.join(path, ckpt.MANIFEST))
    assert str(e.value) == f"{path}: MANIFEST.json has {n} bytes, more than a checkpoint's (1048576)"


def test_a_link_swapped_in_after_the_files_look_is_not_followed(tmp_path, ck, monkeypatch):
    """The race: vocab.json a regular file when looked at, a link to /proc/self/environ when opened."""
    path = _saved(tmp_path, ck)
    looked = ckpt._Directory.size

    def then_swapped(self, name):
        size = looked(self, name)
        if name == "vocab.json":
            os.replace(os.path.join(path, name), os.path.join(tmp_path, name))
            os.symlink("/proc/self/environ", os.path.join(path, name))
        return size
    monkeypatch.setattr(ckpt._Directory, "size", then_swapped)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path)
    assert str(e.value) == f"{path}: vocab.json cannot be read (Too many levels of symbolic links)"


@pytest.mark.parametrize("name, pad, needle", [
    ("config.json", 1 << 20, "config.json has {n} bytes, more than a checkpoint of its configuration holds (1048576)"),
    ("vocab.json", 2 << 20, "vocab.json has {n} bytes, more than a checkpoint of its configuration holds"),
    ("hidden.npy", 1 << 16, "hidden.npy has {n} bytes, more than a checkpoint of its configuration holds"),
    ("extra.bin", 10, "MANIFEST.json names 'extra.bin', not a file of a checkpoint"),
])
def test_every_file_has_a_size_its_configuration_allows(tmp_path, ck, name, pad, needle):
    files = ckpt.to_files(ck)
    data = files.get(name, b"") + b" " * pad
    path = _crafted(tmp_path, ck, **{name: data})
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path)
    assert str(e.value).startswith(f"{path}: {needle.format(n=len(data))}"), str(e.value)


def test_parameters_that_are_not_finite_are_not_a_model_to_use(tmp_path, ck):
    ck.params[3] = np.nan
    with pytest.raises(ckpt.CheckpointError, match="^where: the parameters hold NaN or infinite values: not a model"):
        ckpt.finite(ckpt.load(_saved(tmp_path, ck)), "where")


def _npy_with_header(a, total):
    """``a`` as a version 1.0 ``.npy`` whose header (magic to newline) is ``total`` bytes."""
    head = "{'descr': '%s', 'fortran_order': False, 'shape': %r, }" % (a.dtype.str, a.shape)
    head = head.ljust(total - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head.encode() + a.tobytes()


@pytest.mark.parametrize("total, ok", [(4096, True), (4097, False)])
def test_an_array_header_of_up_to_4_kib_is_taken(tmp_path, ck, total, ok):
    """NumPy writes 128 bytes; a checkpoint's params.npy may have up to 4096 before its data."""
    path = _crafted(tmp_path, ck, **{"params.npy": _npy_with_header(ck.params, total)})
    if ok:
        assert np.array_equal(ckpt.load(path).params, ck.params)
        return
    with pytest.raises(ckpt.CheckpointError, match=f"params.npy has {total + ck.params.nbytes} bytes, more than a "):
        ckpt.load(path)


def _zip64(arrays, monkeypatch) -> bytearray:
    """``np.savez`` of ``arrays`` ending in ZIP64 records (as an optim.npz past 4 GiB or 65,535 members does)."""
    import io
    import zipfile
    with monkeypatch.context() as m:
        m.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 0)
        b = io.BytesIO()
        np.savez(b, **arrays)
    return bytearray(b.getvalue())


def _slots(ck, n):
    """``n`` optimizer slots a trainer could write (averaged, then per partition), ``ck``'s shape."""
    names = ["m", "v", "outer.view", "outer.momentum", "server.accumulator"]
    names += [f"p{i}/s{j}" for i in range(4) for j in range(4)]
    return {k: np.full(ck.params.size, i, np.float32) for i, k in enumerate(names[:n])}


def test_a_zip64_optimizer_file_of_the_most_members_loads(tmp_path, ck, monkeypatch):
    """ZIP64 end records (what a big run's optim.npz has) are read, and a configuration's whole count of
    slots (adam on 2 partitions: 13) is taken."""
    most = ckpt.optimizer_arrays(ck.config)
    assert most == 13                               # 2 slots x (1 + 2) + outer's 2 + 2 x 2 carries + 1
    data = _zip64(_slots(ck, most), monkeypatch)
    assert b"PK\x06\x06" in data and b"PK\x06\x07" in data
    got = ckpt.load(_crafted(tmp_path, ck, **{"optim.npz": bytes(data)})).optim
    want = _slots(ck, most)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("damage, needle", [
    ("members", "optim.npz declares 14 members in a"),              # from the ZIP64 record, not the classic one
    ("locator", "optim.npz is not a zip of NumPy arrays (a ZIP64 locator without its record)"),
    ("signature", "optim.npz is not a zip of NumPy arrays (a ZIP64 locator without its record)"),
    ("comment", "optim.npz is not a zip of NumPy arrays (no end record)"),
])
def test_a_damaged_zip64_end_is_refused_before_zipfile_reads_it(tmp_path, ck, monkeypatch, damage, needle):
    data = _zip64(_slots(ck, 2), monkeypatch)
    record, locator = data.rindex(b"PK\x06\x06"), data.rindex(b"PK\x06\x07")
    if damage == "members":
        data[record + 32:record + 40] = struct.pack("<Q", 14)
    elif damage == "locator":
        data[locator + 8:locator + 16] = struct.pack("<Q", record + 1)
    elif damage == "signature":
        data[record + 3] = 7
    else:                                       # a comment's length, where NumPy's zips have none
        data[-2:] = struct.pack("<H", 1)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(_crafted(tmp_path, ck, **{"optim.npz": bytes(data)}))
    assert str(e.value).startswith(f"{tmp_path}/crafted: {needle}"), str(e.value)


def test_a_version_2_array_file_loads(tmp_path, ck):
    """NumPy writes format 2.0 when a header outgrows 64 KiB (a structured dtype's): the loader reads both."""
    import io
    b = io.BytesIO()
    np.lib.format.write_array(b, ck.params, version=(2, 0))
    assert b.getvalue()[6:8] == b"\x02\x00"
    assert np.array_equal(ckpt.load(_crafted(tmp_path, ck, **{"params.npy": b.getvalue()})).params, ck.params)


def test_a_checkpoint_of_a_large_vocabulary_and_many_partitions_optimizer_state_loads(tmp_path):
    """The loader's size bounds grow with what the configuration holds: vocab.json with model.vocab_size
    (here 1.3 MB for 60,000 words, past the bound's fixed 1 MiB), optim.npz with the partitions whose
    optimizer state it keeps (here 64 partitions' Adam slots, 128 arrays of a small model)."""
    words = [f"word{i:06d}-of-a-long-vocabulary" for i in range(60_000)]
    vocab = Vocab.from_counts({w: 60_000 - i for i, w in enumerate(words)}, "word")
    cfg = config.load(None, ["model.hidden=2", "model.embed=2", f"model.vocab_size={len(vocab)}", "optim.name=adam",
                             "train.optim_state=local", "data.partitions=64"])
    p = RNNLM(cfg.model).init_params(1)
    big = ckpt.Checkpoint(params=p, config=cfg, vocab=vocab)
    assert len(vocab.to_json().encode()) > 1 << 20
    ckpt.save(str(tmp_path / "vocab"), big)
    assert ckpt.load(str(tmp_path / "vocab")).vocab == vocab
    small = config.load(None, ["model.hidden=8", "model.embed=8", "model.vocab_size=5", "optim.name=adam",
                               "train.optim_state=local", "data.partitions=64"])
    q = RNNLM(small.model).init_params(1)
    local = {f"p{pid}/{slot}": np.full_like(q, pid) for pid in range(64) for slot in ("m", "v")}
    ckpt.save(str(tmp_path / "local"), ckpt.Checkpoint(params=q, config=small, vocab=Vocab.build("abcd", "char"),
                                                       optim=local, optim_t=3))
    got = ckpt.load(str(tmp_path / "local"))
    assert sorted(got.optim) == sorted(local) and got.optim["p63/v"][0] == 63
    assert os.path.getsize(tmp_path / "local" / "optim.npz") > 1 << 17          # past the bound's fixed slack


@pytest.mark.parametrize("where", ["hidden", "optim"])
def test_a_checkpoint_never_writes_a_pickle(tmp_path, ck, where):
    """An object array is refused before anything is written: optim.npz's went in as a pickle, and the
    checkpoint could then not be read back (its loader refuses pickles)."""
    arrays = {"hidden": np.array([object()])} if where == "hidden" else {"optim": {"m": np.array([object()])}}
    with pytest.raises(ValueError, match="[Oo]bject arrays cannot"):
        ckpt.save(str(tmp_path / "c"), ckpt.Checkpoint(params=ck.params, config=ck.config, vocab=ck.vocab, **arrays))
    assert not (tmp_path / "c").exists()


def _npz(arrays, compression=zipfile.ZIP_STORED) -> bytes:
    """``arrays`` as an ``.npz`` whose members are compressed by ``compression`` (NumPy itself writes
    ZIP_STORED, or ZIP_DEFLATED with savez_compressed)."""
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", compression) as z:
        for k, a in arrays.items():
            with z.open(f"{k}.npy", "w") as f:
                np.lib.format.write_array(f, a)
    return b.getvalue()


def test_an_optimizer_member_compressed_as_numpy_never_writes_is_refused_before_it_is_inflated(tmp_path, ck):
    """zipfile inflates a bzip2 or lzma member a whole block at a time, past the size its header declares:
    4 kB of bzip2 blocks of zeros (a member that declares 64 bytes) held ~340 MB."""
    slots = _slots(ck, 2)
    for compression in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):            # what NumPy writes: loaded
        loaded = ckpt.load(_crafted(tmp_path / str(compression), ck, **{"optim.npz": _npz(slots, compression)}))
        assert sorted(loaded.optim) == sorted(slots)
    for compression in (zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA):
        path = _crafted(tmp_path / str(compression), ck, **{"optim.npz": _npz(slots, compression)})
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.load(path)
        assert str(e.value) == (f"{path}: optim.npz holds 'm.npy' compressed or encrypted as NumPy never writes it "
                                "(a zip member stored or deflated)")


def test_a_damaged_deflate_stream_or_an_encrypted_member_is_one_error(tmp_path, ck):
    """zlib.error ("invalid distance too far back") and zipfile's RuntimeError ("is encrypted, password
    required") escaped the loader as tracebacks."""
    raw = bytearray(_npz({"m": np.arange(ck.params.size, dtype=np.float32)}, zipfile.ZIP_DEFLATED))
    start = 30 + len("m.npy")                       # the member's data, after its local header
    raw[start + 8:start + 40] = bytes(range(32))
    path = _crafted(tmp_path / "damaged", ck, **{"optim.npz": bytes(raw)})
    with pytest.raises(ckpt.CheckpointError, match=r"optim.npz is not a zip of NumPy arrays: "):
        ckpt.load(path)
    raw = bytearray(_npz({"m": np.zeros(ck.params.size, np.float32)}))
    raw[6] |= 1                                     # the local header's flag: encrypted
    central = raw.rindex(b"PK\x01\x02")
    raw[central + 8] |= 1                           # and the central directory's
    path = _crafted(tmp_path / "encrypted", ck, **{"optim.npz": bytes(raw)})
    with pytest.raises(ckpt.CheckpointError, match="compressed or encrypted as NumPy never writes it"):
        ckpt.load(path)


def test_arrays_larger_than_this_machines_memory_are_refused_before_they_are_allocated(tmp_path, ck, monkeypatch):
    """A config.json of hidden 16384 and 12 layers makes a params.npy of 92 GiB one of its configuration: a
    sparse file of that size made np.empty raise MemoryError (a traceback) before a byte was checked."""
    path = _saved(tmp_path, ck)
    monkeypatch.setattr(config, "memory_bytes", lambda: ck.params.nbytes - 1)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path)
    assert str(e.value) == (f"{path}: params.npy holds {ck.params.nbytes:,} bytes of float32, more than this "
                            f"machine's {(ck.params.nbytes - 1) / (1 << 30):,.1f} GiB of memory")
    monkeypatch.setattr(config, "memory_bytes", lambda: 1 << 20)             # each array fits: loaded
    assert np.array_equal(ckpt.load(path).params, ck.params)


def test_a_json_file_that_grows_after_its_size_was_checked_is_read_no_further_than_its_limit(ck):
    """A file's size is checked before it is read; one that grew since (a writer still at it) was read to its end."""
    files = ckpt.to_files(ck)
    grown = files["config.json"] + b" " * (ckpt.JSON_LIMITS["config.json"] + 1)

    def read(name):
        return grown if name == "config.json" else files.get(name)

    def size(name):                         # what the filesystem said before the file grew
        return len(files[name]) if name in files else None
    with pytest.raises(ckpt.CheckpointError, match=r"^where: config.json grew past 1048576 bytes as it was read$"):
        ckpt.from_files(read, "where", size=size)
