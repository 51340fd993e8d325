"""The synchronous round's rules without Spark (rnnlm.exchange.round): the outer step, the optimizer
state across rounds, the carries and the checkpoint's keys, each against arithmetic done by hand.
The Spark tests (test_spark_train, test_continue) run the same rules end to end."""
import numpy as np
import pytest

from rnnlm import config
from rnnlm.config import TrainConfig
from rnnlm.core.checkpoint import Checkpoint
from rnnlm.core.layout import Layout
from rnnlm.core.vocab import Vocab
from rnnlm.exchange.aggregate import Aggregate
from rnnlm.exchange.blocks import Block
from rnnlm.exchange.round import OPT, Carry, RoundMessage, StateKeys, SyncRound, view
from rnnlm.spark.allreduce import SyncState
from rnnlm.spark.memo import Memo
from rnnlm.spark.rundir import TrainingError
from rnnlm.spark.trainer import RunState, round_metrics, round_phases

LAYOUT = Layout([("w", (2, 2)), ("b", (2,))])          # 6 parameters


def _leaf(pid, change, weight, steps=4, opt=None, state=None, local_opt=None):
    """Partition ``pid``'s contribution: its change (6,), its optimizer slot m (6,) if any."""
    blocks = {"params.w": np.asarray(change[:4], np.float32).reshape(2, 2),
              "params.b": np.asarray(change[4:], np.float32)}
    if opt is not None:
        blocks[OPT + "m"] = np.asarray(opt, np.float32)
    return Aggregate.contribution(weight, blocks, {pid: Carry(state=state, opt=local_opt)}, steps=steps)


def _round(outer="average", optim_state="average", momentum=0.5, lr=2.0, partitions=2):
    t = TrainConfig(outer=outer, optim_state=optim_state, outer_momentum=momentum, outer_lr=lr)
    return SyncRound(LAYOUT, t, partitions)


def _agg(opt=(None, None), **kw):
    a = _leaf(0, [1, 2, 3, 4, 5, 6], 1.0, opt=opt[0], **kw)
    b = _leaf(1, [3, 2, 1, 0, -1, -2], 3.0, opt=opt[1])
    return Aggregate().merge(a).merge(b)              # the token-weighted mean: (a + 3 b) / 4


MEAN = np.array([2.5, 2.0, 1.5, 1.0, 0.5, 0.0])


def test_average_adds_the_token_weighted_mean_change():
    st = SyncState(params=np.ones(6, np.float32))
    _round().apply(st, _agg())
    assert st.params.dtype == np.float32 and np.array_equal(st.params, 1 + MEAN)
    assert st.velocity is None


def test_a_round_in_which_no_partition_scored_a_token_changes_no_weight():
    """A sample of empty lines (sampled_paragraphs at character level), or a last step on a paragraph's
    end: every weight 0, and the mean divided by zero (a traceback on the driver)."""
    for outer in ("average", "momentum"):
        st = SyncState(params=np.ones(6, np.float32), opt={"m": np.full(6, 2.0, np.float32), "t": 4},
                       velocity=None if outer == "average" else np.ones(6, np.float32))
        r = _round(outer, momentum=0.5, lr=1.0)
        r.apply(st, Aggregate().merge(_leaf(0, np.zeros(6), 0.0, opt=np.zeros(6))).merge(
            _leaf(1, np.zeros(6), 0.0, opt=np.zeros(6))))
        moved = 0.0 if outer == "average" else 0.5                 # momentum's velocity decays, as with a zero mean
        assert np.array_equal(st.params, np.full(6, 1.0 + moved, np.float32)) and st.params.dtype == np.float32
        assert np.array_equal(st.opt["m"], np.full(6, 2.0)) and st.opt["t"] == 4     # the averaged state kept


def test_momentum_and_nesterov_step_with_a_velocity_kept_across_rounds():
    for outer in ("momentum", "nesterov"):
        st = SyncState(params=np.zeros(6, np.float32))
        r = _round(outer, momentum=0.5, lr=2.0)
        r.apply(st, _agg())                                     # v = d; momentum: p = 2 v; nesterov: 2 (d + v / 2)
        assert np.allclose(st.velocity, MEAN)
        first = 2 * MEAN if outer == "momentum" else 2 * (MEAN + 0.5 * MEAN)
        assert np.allclose(st.params, first, rtol=1e-6)
        r.apply(st, _agg())                                     # v = v / 2 + d = 1.5 d
        assert np.allclose(st.velocity, 1.5 * MEAN)
        second = 2 * 1.5 * MEAN if outer == "momentum" else 2 * (MEAN + 0.5 * 1.5 * MEAN)
        assert np.allclose(st.params, first + second, rtol=1e-6) and st.params.dtype == np.float32


def test_averaged_optimizer_state_is_the_weighted_mean_and_counts_the_steps():
    st = SyncState(params=np.zeros(6, np.float32))
    agg = _agg(opt=(np.full(6, 4.0), np.full(6, 8.0)))          # (4 + 3 * 8) / 4 = 7
    _round(optim_state="average").apply(st, agg)
    assert set(st.opt) == {"m", "t"} and np.array_equal(st.opt["m"], np.full(6, 7.0, np.float32))
    assert st.opt["t"] == 4                                   # 8 steps on 2 partitions: 4 each
    _round(optim_state="average").apply(st, _agg(opt=(np.zeros(6), np.zeros(6))))
    assert st.opt["t"] == 8
    _round(optim_state="average").apply(st, _agg())            # sgd: no slots, no state
    assert st.opt is None


def test_local_optimizer_state_and_hidden_states_go_back_to_their_partitions():
    st = SyncState(params=np.zeros(6, np.float32), opt_local={5: {"t": 1}})
    mine = {"t": 3, "m": np.arange(6.0)}
    h = np.ones((1, 1, 2, 3), np.float32)
    r = _round(optim_state="local")
    r.apply(st, _agg(state=h, local_opt=mine))
    assert list(st.opt_local) == [0] and st.opt_local[0] is mine          # pid 1 sent none: dropped
    assert list(st.states) == [0] and st.states[0] is h
    assert st.opt is None
    carries = r.carries(st)
    assert carries[0] == Carry(state=h, opt=mine)
    assert r.message(st, "base", {}).opt is None
    reset = SyncState(params=np.zeros(6, np.float32), opt={"t": 9, "m": np.ones(6)}, opt_local={0: mine})
    _round(optim_state="reset").apply(reset, _agg(local_opt=mine))
    assert reset.opt == {"t": 9, "m": reset.opt["m"]} and reset.opt_local == {0: mine}   # untouched
    assert _round(optim_state="reset").carries(reset) == {}


def test_what_a_partition_starts_its_round_with():
    class Opt:
        def init_state(self, params):
            return {"t": 0, "fresh": True}
    avg = {"t": 4, "m": np.ones(2)}
    own = {"t": 2, "m": np.zeros(2)}
    msg = RoundMessage("b", {}, avg)
    on = []

    def to_device(a):
        on.append(a)
        return a
    assert _round(optim_state="average").start(msg, Carry(opt=own), Opt(), None, to_device) == avg
    assert _round(optim_state="local").start(msg, Carry(opt=own), Opt(), None, to_device) == own
    assert len(on) == 2 and on[0] is avg["m"] and on[1] is own["m"]        # the arrays, not the step count
    assert _round(optim_state="local").start(msg, Carry(), Opt(), None, to_device)["fresh"]      # round 1
    assert _round(optim_state="reset").start(msg, Carry(opt=own), Opt(), None, to_device)["fresh"]
    assert _round(optim_state="average").start(RoundMessage("b", {}, None), Carry(), Opt(), None,
                                               to_device)["fresh"]
    st = SyncState(params=np.zeros(6), opt=avg)
    assert _round(optim_state="average").message(st, "b", {}).opt is avg


def test_a_contribution_carries_what_its_optimizer_state_mode_needs():
    class Res:
        tokens, loss_sum, steps = 40, 80.0, 4
        state = np.ones((1, 1, 2, 2), np.float32)
        opt_state = {"t": 4, "m": np.full(6, 2.0, np.float32)}
    blocks = {"params.w": np.zeros((2, 2), np.float32), "params.b": np.zeros(2, np.float32)}
    a = _round(optim_state="average").contribution(3, Res(), blocks, {"block_bytes.x": 7}, True, [1], 0.5, np.asarray)
    assert sorted(a.dense) == ["opt.m", "params.b", "params.w"] and a.local[3].opt is None
    assert a.weight == 40 and a.stats["block_bytes.x"] == 7 and a.stats["steps"] == 4
    assert np.array_equal(a.local[3].state, Res.state)
    b = _round(optim_state="local").contribution(3, Res(), blocks, {}, False, [1], 0.5, np.copy)
    assert sorted(b.dense) == ["params.b", "params.w"] and b.local[3].state is None
    assert type(b.local[3].opt["t"]) is int and b.local[3].opt["t"] == 4          # a count, not an array
    m = b.local[3].opt["m"]
    assert m is not Res.opt_state["m"] and np.array_equal(m, Res.opt_state["m"])   # copied to the host


def test_the_checkpoint_keys_round_trip():
    st = SyncState(params=np.zeros(6), opt={"t": 7, "m": np.ones(6)}, opt_local={2: {"t": 9, "v": np.zeros(6)}},
                   velocity=np.full(6, 3.0))
    view = np.full(6, 5.0)
    held = {1: {"feedback": np.ones(6)}, 2: {"eager": np.full(6, 2.0)}}
    optim, t, t_local = SyncRound.to_optim(st, view, held)
    assert t == 7 and t_local == {2: 9}
    assert sorted(optim) == ["eager.p2", "feedback.p1", "m", "outer.velocity", "outer.view", "p2/v"]
    back = SyncRound.from_optim(optim, t, t_local)
    assert set(back["opt"]) == {"m", "t"} and back["opt"]["t"] == 7
    assert list(back["opt_local"]) == [2] and back["opt_local"][2]["t"] == 9
    assert back["velocity"] is optim["outer.velocity"] and back["view"] is optim["outer.view"]
    assert {p: sorted(d) for p, d in back["held"].items()} == {1: ["feedback"], 2: ["eager"]}
    assert SyncRound.from_optim(optim, 7, {})["opt_local"][2]["t"] == 7       # a checkpoint without the counts
    nothing, t0, none = SyncRound.to_optim(SyncState(params=np.zeros(6)), None, None)
    assert nothing == {} and t0 == 0 and none == {}
    assert SyncRound.from_optim({}, 0, {}) == {"opt": None, "opt_local": {}, "velocity": None, "view": None,
                                               "held": {}}
    only_local, t, t_local = SyncRound.to_optim(SyncState(params=np.zeros(6), opt_local={0: {"t": 3}}), None, None)
    assert t == 3 and t_local == {0: 3}


def test_each_partitions_own_optimizer_step_count_survives_a_checkpoint(tmp_path):
    """Under ``train.optim_state = "local"`` partitions that train different numbers of steps (one
    pass each of unequal shares, a sample) have different Adam step counts, and Adam's bias correction
    reads them: the checkpoint kept one count, partition 0's, and a resumed run gave it to every
    partition, so it was not the uninterrupted run."""
    from rnnlm.core import checkpoint
    from rnnlm.core.model import RNNLM
    vocab = Vocab.build("ab", "char")
    cfg = config.replace(config.load(None, ["data.partitions=3", "train.optim_state=local", "optim.name=adam",
                                            "model.hidden=2"]), "model", vocab_size=len(vocab))
    params = RNNLM(cfg.model).init_params(1)
    m = {pid: np.full(params.size, pid + 0.5, np.float32) for pid in range(3)}
    st = SyncState(params=params,
                   opt_local={pid: {"t": t, "m": m[pid], "v": m[pid] * 2} for pid, t in ((0, 30), (1, 37), (2, 0))})
    optim, t, t_local = SyncRound.to_optim(st, None, None)
    ck = Checkpoint(params=params, config=cfg, vocab=vocab, optim=optim, optim_t=t, optim_t_local=t_local,
                    position={"round": 4})
    checkpoint.save(str(tmp_path / "ck"), ck)
    back = SyncState.resumed(checkpoint.load(str(tmp_path / "ck")), cfg, "ck")
    assert {pid: o["t"] for pid, o in back.opt_local.items()} == {0: 30, 1: 37, 2: 0}
    assert all(np.array_equal(back.opt_local[pid]["m"], m[pid]) for pid in range(3))
    carries = SyncRound(LAYOUT, cfg.train, 3).carries(back)
    assert {pid: c.opt["t"] for pid, c in carries.items()} == {0: 30, 1: 37, 2: 0}


@pytest.mark.parametrize("key,slot,held", [
    ("m", True, None), ("p3/m", False, None), ("outer.velocity", False, None),
    ("feedback.p12", False, ("feedback", 12)), ("eager.p0", False, ("eager", 0)),
    ("feedback.px", False, None), ("other.p1", True, None),
])
def test_state_keys(key, slot, held):
    assert StateKeys.is_slot(key) is slot and StateKeys.held(key) == held


def test_the_round_messages_are_frozen():
    with pytest.raises(AttributeError):
        RoundMessage("b", {}, None).base = "c"
    with pytest.raises(AttributeError):
        Carry().state = 1


class _Handle:
    """A broadcast's stand-in: counts the reads of ``value`` (on Spark a read may fetch)."""

    def __init__(self, value):
        self._value, self.reads = value, 0

    @property
    def value(self):
        self.reads += 1
        return self._value


def test_the_executors_view_adds_each_delta_once_and_reads_the_base_only_to_rebuild():
    base = _Handle(np.zeros(6, np.float32))
    msg = RoundMessage("base-1", {"b": (None, np.array([[1.0], [2.0]], np.float32))}, None)   # b = (1, 2)

    def delta(k):
        return _Handle({"w": Block(np.full((1, 2), k, np.float32), (2, 2), np.array([k % 2], np.int32))})
    d1, d2, d3 = delta(1), delta(2), delta(3)        # rows 1, 0, 1 of w
    cache = Memo()
    first = view(LAYOUT, base, msg, [d1, d2], cache)
    assert first.tolist() == [2, 2, 1, 1, 1, 2] and base.reads == 1      # w = [[2, 2], [1, 1]]
    again = view(LAYOUT, base, msg, [d1, d2, d3], cache)                  # only d3 is new
    assert again.tolist() == [2, 2, 4, 4, 1, 2] and base.reads == 1
    assert (d1.reads, d2.reads, d3.reads) == (1, 1, 1)
    view(LAYOUT, base, msg, [d1, d2, d3], cache)                          # nothing new: nothing read
    assert base.reads == 1 and d3.reads == 1
    fresh = view(LAYOUT, base, msg, [d1], cache)            # fewer deltas than the cache holds: rebuilt
    assert fresh.tolist() == [0, 0, 1, 1, 1, 2] and base.reads == 2
    plain = view(LAYOUT, base, msg, [], Memo())                            # no delta broadcast: base + rows
    assert plain.tolist() == [0, 0, 0, 0, 1, 2]


def test_a_failed_partition_weighs_nothing():
    failed = SyncRound.failed(3, "loss became nan")
    assert failed.weight == 0.0 and failed.dense == {} and failed.local == {3: Carry(error="loss became nan")}


def test_averaged_optimizer_state_is_counted_in_what_a_round_sends():
    """Adam's two slots travel beside the change, uncoded: the compression figure left them out (54x printed
    where a round sent twice a dense float32 exchange's bytes)."""
    from rnnlm.core.local import LocalResult
    slots = {"m": np.ones(6, np.float32), "v": np.ones(6, np.float32), "t": 3}
    res = LocalResult(params=None, opt_state=slots, state=None, tokens=10, loss_sum=20.0, steps=2)
    blocks = {"params.w": np.zeros((2, 2), np.float32)}
    for optim_state, counted in (("average", 48), ("reset", None), ("local", None)):
        r = _round(optim_state=optim_state)
        c = r.contribution(0, res, blocks, {"block_bytes.w": 5}, False, [1], 0.1, lambda a: a)
        assert c.stats.get("optim_bytes") == counted and c.stats["block_bytes.w"] == 5
    agg = Aggregate()
    agg.stats.update(tokens=10, loss_sum=20.0, steps=2, compute_s=0.1, **{"block_bytes.embed": 12, "optim_bytes": 48})
    st = RunState(round=1, tokens=10, bytes_sent=100, bytes_broadcast=100, wall_s=1.0)
    m = round_metrics(config.load(None, []), LAYOUT, st, 100, agg, 0, False, 0.5, 1.0)
    assert m["optim_bytes"] == 48 and m["compression"] == round(6 * 4 * 2 / 60, 3)     # 48 of 60 bytes: the state


def test_a_rounds_metrics_line_by_hand():
    cfg = config.load(None, ["data.partitions=4", "exchange.embed=rows", "exchange.seed_groups=log2",
                             "exchange.sampled_softmax=true"])
    agg = Aggregate()
    agg.stats.update(tokens=800, loss_sum=1600.0, steps=8, compute_s=1.23456, gpu_partitions=2, softmax_v_all=100,
                     **{"block_bytes.embed": 12, "block_bytes.softmax": 11, "rows_embed": 5,
                        "executor.0a1b2c3d4e5f": 3, "executor.ffffffffffff": 1})     # 4 partitions on 2 executors
    agg.words, agg.wire_bytes = np.array([1, 4, 9], np.int32), 4096
    st = RunState(round=3, tokens=2000, bytes_sent=9000, bytes_broadcast=7000, wall_s=12.34567)
    m = round_metrics(cfg, LAYOUT, st, 3000, agg, 512, True, 0.5, 4.00049)
    assert m == {"round": 3, "epoch": 0.66667, "tokens": 2000, "syncs": 3, "bytes_sent": 9000, "bytes_broadcast": 7000,
                 "round_bytes_sent": 4096, "round_bytes_broadcast": 512, "rebased": True, "wall_s": 12.346,
                 "round_s": 4.0, "compute_s": 1.235, "tokens_per_s": 200, "train_loss": 2.0, "lr": 0.5,
                 "unique_words": 3, "executors": 2, "device": "gpu+cpu", "block_bytes.embed": 12,
                 "block_bytes.softmax": 11, "rows_embed": 5,
                 "compression": 4.174,        # 6 float32 parameters from 4 partitions in 23 bytes
                 "seed_groups": 2, "softmax_v_all": 12.5, "softmax_v_f": 0.0}
    dense = round_metrics(config.load(None, ["data.partitions=4"]), LAYOUT, st, 4000, Aggregate(), 0, False, 0.5, 0.0)
    assert dense["train_loss"] == 0.0 and dense["tokens_per_s"] == 0 and dense["compression"] == 96.0
    assert dense["device"] == "cpu" and "softmax_v_all" not in dense
    none = Aggregate()                                   # a round that ran no step: no division by zero
    none.stats["tokens"] = 5
    quiet = round_metrics(cfg, LAYOUT, st, 4000, none, 0, False, 0.5, 0.0)
    assert quiet["softmax_v_all"] == 0.0 and quiet["tokens_per_s"] == 5_000_000_000


def test_a_rounds_phases():
    stats = {"task_start": 10.5, "task_end": 12.0, "view_s": 0.1, "steps_s": 1.0, "encode_s": 0.25}
    assert round_phases(stats, 0.2, 10.0, 12.75, 0.05, 0.3) == {
        "phase.prepare_s": 0.2, "phase.apply_s": 0.05, "phase.launch_s": 0.5, "phase.collect_s": 0.75,
        "phase.view_s": 0.1, "phase.steps_s": 1.0, "phase.encode_s": 0.25, "phase.between_s": 0.3}
    assert round_phases({}, 0.123456, 1.0, 2.0, 0.0, None) == {"phase.prepare_s": 0.1235, "phase.apply_s": 0.0}


def _ck(position=None, optim=None, hidden=None):
    return Checkpoint(params=np.arange(6.0, dtype=np.float32), config=config.load(None, []),
                      vocab=Vocab.build("ab", "char"), optim=optim or {}, position=position or {"round": 2},
                      hidden=hidden, optim_t=5)


def test_a_run_started_from_a_checkpoint_with_its_optimizer_leaves_that_checkpoint_as_it_was():
    """The outer momentum's velocity is updated in place: a run from ``--init-from`` with the optimizer kept
    changed the checkpoint object's, so the next run of a sweep from the same Init started elsewhere."""
    from rnnlm.spark.rundir import Init
    velocity, m = np.ones(6, np.float32), np.full(6, 2.0, np.float32)
    init = Init(_ck(optim={"outer.velocity": velocity, "m": m}), "ck", keep_optimizer=True)
    for _ in range(2):
        st = SyncState.start_from(init)
        assert np.array_equal(st.velocity, np.ones(6)) and np.array_equal(st.opt["m"], m)
        _round("momentum", momentum=0.5, lr=1.0).apply(st, _agg())
        assert not np.array_equal(st.velocity, np.ones(6))
    assert np.array_equal(velocity, np.ones(6)) and np.array_equal(m, np.full(6, 2.0))


def test_a_resumed_state_takes_each_part_of_the_checkpoint_where_the_run_needs_it():
    view = np.full(6, 7.0, np.float32)
    plain = config.load(None, ["optim.name=adam"])       # its slots: m, v
    st = SyncState.resumed(_ck(optim={"m": np.ones(6), "outer.view": view}), plain, "ck")
    assert st.view is None and st.next_params is None and st.opt["t"] == 5 and st.states == {}
    delta = config.load(None, ["exchange.broadcast=delta"])
    assert SyncState.resumed(_ck(optim={"outer.view": view}), delta, "ck").view is view
    overlap = config.load(None, ["train.overlap=1", "train.optim_state=local"])
    st = SyncState.resumed(_ck({"round": 2, "pending_lr": 0.5}, {"outer.view": view}), overlap, "ck")
    assert st.next_params is view and st.next_lr == 0.5 and st.view is None
    lacking = [({"round": 2}, {"outer.view": view}), ({"round": 2, "pending_lr": 1}, {"outer.view": view}),
               ({"round": 2, "pending_lr": -0.5}, {"outer.view": view}),
               ({"round": 2, "pending_lr": float("nan")}, {"outer.view": view}),
               ({"round": 2, "pending_lr": 0.5}, {}), ({"round": 2, "pending_lr": 0.5}, {"outer.view": view[:5]})]
    for position, optim in lacking:
        with pytest.raises(TrainingError, match="^cannot resume: ck lacks the next round's parameters or lea"):
            SyncState.resumed(_ck(position, optim), overlap, "ck")
    assert SyncState.resumed(_ck({"round": 2, "pending_lr": 0.0}, {"outer.view": view}), overlap, "ck").next_lr == 0.0
    h = np.zeros((2, 1, 1, 4, 3), np.float32)                             # two partitions' (L, S, H, B)
    st = SyncState.resumed(_ck(hidden=h), plain, "ck")
    assert sorted(st.states) == [0, 1] and st.states[1].shape == (1, 1, 4, 3)
    with pytest.raises(TrainingError, match="one stream's hidden state"):
        SyncState.resumed(_ck(hidden=h[0]), plain, "ck")


def test_optimizer_state_that_no_run_writes_is_named():
    slots, written = ("m", "v"), ["m", "v", "p0/m", "p1/v", "outer.view", "outer.velocity", "feedback.p1", "eager.p0"]
    assert SyncRound.foreign(written, slots, 2) is None
    for foreign in ("p2/m", "p0/s", "s", "feedback.p2", "outer.x", "q0/m", "p/m", "p0/", "residual.p0"):
        assert SyncRound.foreign(written + [foreign], slots, 2) == foreign
