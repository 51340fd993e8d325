import hashlib
import json
import os
import pickle

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
                           position={"round": 3, "epoch": 0.5}, hidden=m.zero_state(2) + 1,
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


def test_a_run_directory_loads_its_checkpoint_even_one_left_as_old(tmp_path, ck):
    run = tmp_path / "run"
    ckpt.save(str(run / "checkpoint"), ck)
    (run / "metrics.jsonl").write_text("{}\n")
    assert np.array_equal(ckpt.load(str(run)).params, ck.params)
    os.rename(run / "checkpoint", run / "checkpoint.old")      # a save cut between its two renames
    assert np.array_equal(ckpt.load(str(run)).params, ck.params)
    assert (run / "checkpoint").is_dir() and not (run / "checkpoint.old").exists()
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint"):
        ckpt.load(str(tmp_path))                                # neither a checkpoint nor a run's
