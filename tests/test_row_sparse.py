"""Row-sparse steps on NumPy: SGD moves only the rows of the vocabulary tables a step's gradient names
(the embedding's input words; with a sampled softmax, Wo's and bo's v_all), the same update as the dense
step's, to the bit while no global-norm clip scales the gradient."""
import numpy as np
import pytest

from rnnlm.config import ModelConfig, OptimConfig
from rnnlm.core import backend
from rnnlm.core.layout import RowGrad, dense_ranges
from rnnlm.core.local import train_steps
from rnnlm.core.model import RNNLM
from rnnlm.core.optim import SGD, clip_factor, make_optimizer
from rnnlm.core.sampled import corrected_sets, presence, softmax_sets
from rnnlm.core.strategies import StreamBlock

V = 1500                       # above backend.ONE_HOT_MAX_V: the embedding's gradient is summed by rows


class DenseSGD(SGD):
    """SGD told to take every slot's gradient dense: the reference."""
    row_sparse = False


def _setup(dropout=0.0, T=12, B=8):
    rng = np.random.default_rng(5)
    ids = (rng.zipf(1.3, 6000) % V).astype(np.int32)          # many repeats in a chunk, as in text
    m = RNNLM(ModelConfig(cell="lstm", vocab_size=V, embed=16, hidden=24, layers=2, dropout=dropout), xp=np)
    return m, StreamBlock(ids, B=B, T=T), ids


def _sets(kind, ids, T):
    r = np.random.default_rng(9)
    beta = np.sort(r.choice(V, 15, replace=False))
    freq = presence(ids, T, V)
    if kind == "sampled":
        return lambda k, y: softmax_sets(y, V, 15, beta, 0.1, r)
    if kind == "corrected":
        return lambda k, y: corrected_sets(y, V, 15, beta, 0.1, r, freq)
    return None


def _train(opt, m, blk, ids, softmax, clip_norm=0.0, clip_value=0.0, dropout=False):
    p = m.init_params(1)
    res = train_steps(m, opt, p, opt.init_state(p), blk.batches(0, 5), m.zero_state(8), lr=0.7,
                      clip_norm=clip_norm, clip_value=clip_value, softmax_sets=_sets(softmax, ids, 12),
                      dropout_rng=backend.rng_for(np, 3, 1) if dropout else None)
    return res


@pytest.mark.parametrize("softmax", [None, "sampled", "corrected"])
@pytest.mark.parametrize("clip_value,dropout", [(0.0, False), (0.01, True)])
def test_row_sparse_sgd_steps_equal_dense_ones_bit_for_bit(softmax, clip_value, dropout):
    m, blk, ids = _setup(dropout=0.3 if dropout else 0.0)
    cfg = OptimConfig(name="sgd", lr=0.7)
    a = _train(SGD(cfg), m, blk, ids, softmax, clip_value=clip_value, dropout=dropout)
    b = _train(DenseSGD(cfg), m, blk, ids, softmax, clip_value=clip_value, dropout=dropout)
    assert np.array_equal(a.params, b.params) and np.array_equal(a.state, b.state)
    assert a.loss_sum == b.loss_sum and a.tokens == b.tokens
    assert not np.array_equal(a.params, m.init_params(1))


@pytest.mark.parametrize("softmax,names", [(None, ["embed"]), ("corrected", ["embed", "Wo", "bo"])])
def test_the_model_names_the_tables_and_their_rows(softmax, names):
    m, blk, ids = _setup()
    p, b = m.init_params(1), blk.batch(1)
    sets = _sets(softmax, ids, 12)
    s = None if sets is None else sets(0, b.y)
    dense = np.empty_like(p)
    loss_d, _, _ = m.loss_and_grad(p, dense, b.x, b.y, m.zero_state(8), softmax=s, grad_scale=0.125)
    sparse = np.full_like(p, np.nan)
    loss_s, _, _, tables = m.loss_and_sparse_grad(p, sparse, b.x, b.y, m.zero_state(8), softmax=s,
                                                  grad_scale=0.125)
    assert loss_s == loss_d and [t.slot.name for t in tables] == names
    for t in tables:
        full = t.slot.view(dense)
        nonzero = np.flatnonzero(np.any(full != 0, axis=tuple(range(1, full.ndim))))
        assert set(nonzero.tolist()) <= set(t.rows.tolist())                  # every nonzero row named
        assert np.array_equal(np.unique(t.rows), np.sort(t.rows))             # ...once
        assert np.array_equal(full[t.rows], t.values)
        assert np.isnan(t.slot.view(sparse)).all()                                 # the slot is left alone
    assert tables[0].rows.tolist() == np.unique(b.x).tolist()
    for r in dense_ranges(p.size, tables):
        assert np.array_equal(sparse[r], dense[r])


def test_with_the_clip_the_norm_and_the_update_agree_within_rounding():
    m, blk, ids = _setup()
    p, b = m.init_params(1), blk.batch(0)
    dense, sparse = np.empty_like(p), np.empty_like(p)
    m.loss_and_grad(p, dense, b.x, b.y, m.zero_state(8), grad_scale=0.125)
    tables = m.loss_and_sparse_grad(p, sparse, b.x, b.y, m.zero_state(8), grad_scale=0.125)[3]
    n_d, f_d = clip_factor(dense, 0.05)
    n_s, f_s = clip_factor(sparse, 0.05, tables=tables)
    assert f_d < 1 and n_s == pytest.approx(n_d, rel=1e-6) and f_s == pytest.approx(f_d, rel=1e-6)
    cfg = OptimConfig(name="sgd", lr=0.7)
    a = _train(SGD(cfg), m, blk, ids, "corrected", clip_norm=0.05)
    c = _train(DenseSGD(cfg), m, blk, ids, "corrected", clip_norm=0.05)
    assert np.allclose(a.params, c.params, rtol=0, atol=1e-6) and a.loss_sum == pytest.approx(c.loss_sum, rel=1e-6)
    again = _train(SGD(cfg), m, blk, ids, "corrected", clip_norm=0.05)
    assert np.array_equal(a.params, again.params)                             # deterministic all the same


def test_an_optimizer_that_moves_every_row_refuses_a_row_sparse_gradient():
    m, _, _ = _setup()
    p = m.init_params(0)
    opt = make_optimizer(OptimConfig(name="momentum", lr=0.1))
    assert not opt.row_sparse
    t = RowGrad(m.layout["bo"], np.array([3]), np.ones(1, dtype=p.dtype))
    with pytest.raises(ValueError, match="takes no row-sparse gradient"):
        opt.step(p, np.zeros_like(p), opt.init_state(p), 0.1, tables=(t,))


def test_sum_rows_sums_each_id_the_same_way_every_run():
    rng = np.random.default_rng(2)
    idx = rng.integers(0, 40, 300)
    src = rng.standard_normal((300, 5))
    rows, sums = backend.sum_rows(idx, src.astype(np.float32))
    ref = np.zeros((40, 5))
    np.add.at(ref, idx, src)                                # float64
    assert rows.tolist() == sorted(set(idx.tolist())) and sums.dtype == np.float32
    assert np.allclose(sums, ref[rows], rtol=1e-5, atol=1e-5)
    again = backend.sum_rows(idx.copy(), src.astype(np.float32))
    assert np.array_equal(again[0], rows) and np.array_equal(again[1], sums)
