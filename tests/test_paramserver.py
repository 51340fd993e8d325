"""The parameter server's protocol, without a network: at-most-once, leases, updates, refusals."""
import threading
import time

import numpy as np
import pytest

from conftest import wait_for
from rnnlm import config
from rnnlm.core.layout import Layout
from rnnlm.exchange import plan
from rnnlm.server import paramserver, wire
from rnnlm.server.paramserver import ParameterServer
from rnnlm.server.worker import WorkerClient, blocks_to_wire, patch

LAYOUT = Layout([("embed", (6, 3)), ("W1", (4, 3)), ("b1", (4,)), ("Wo", (6, 4)), ("bo", (6,))])


def server(windows=3, partitions=2, **sv):
    cfg = config.load(None, [f"server.{k}={v}" for k, v in sv.items()])
    return ParameterServer(LAYOUT, np.zeros(LAYOUT.size, np.float32), cfg.server, windows, partitions,
                           log=lambda *_: None)


def push_msg(change, **ex):
    cfg = config.load(None, [f"exchange.{k}={v}" for k, v in ex.items()])
    blocks, _, _ = plan.encode(LAYOUT, change.astype(np.float32), cfg.exchange, np.array([1, 2]), 1, 1, 0, 2)
    return blocks_to_wire(blocks)


def push(ps, pid, lease, window, version, change, **stats):
    fields, arrays = push_msg(change)
    fields.update(stats, pid=pid, lease=lease, window=window, version=version)
    return ps.handle("test", "push", fields, arrays)


def hello(ps, pid):
    kind, f, a = ps.handle("test", "hello", {"pid": pid}, {})
    assert kind == "hello"
    return f, a["params"]


def hold_first_apply(ps, seconds=5.0):
    """Make the next push's apply wait (up to ``seconds``) until released: ``(applying, release)`` events.
    Later pushes apply at once."""
    applying, release, original = threading.Event(), threading.Event(), ps.apply

    def held(decoded, scale):
        if not applying.is_set():
            applying.set()
            release.wait(seconds)
        original(decoded, scale)

    ps.apply = held
    return applying, release


def held_push(ps, pid, window, version, change):
    """Partition ``pid``'s push started on a thread of its own and held mid-apply (the server's first
    apply): ``(thread, release)``."""
    applying, release = hold_first_apply(ps)
    th = threading.Thread(target=push, args=(ps, pid, 1, window, version, change))
    th.start()
    assert applying.wait(5)
    return th, release


def test_a_window_is_applied_at_most_once_and_a_retry_resumes_after_it():
    ps = server()
    f, p0 = hello(ps, 0)
    assert f["window"] == 0 and f["lease"] == 1 and not p0.any()
    one = np.ones(LAYOUT.size, np.float32)
    kind, r, a = push(ps, 0, 1, 0, 0, one, tokens=10, loss_sum=5.0)
    assert kind == "pushed" and r["applied"] and r["next"] == 1 and r["version"] == 1
    patch(LAYOUT, p0, r["pulled"], a)
    np.testing.assert_array_equal(p0, one)
    kind, r, a = push(ps, 0, 1, 0, 0, one)                    # the same window again
    assert not r["applied"] and ps.totals["refused_duplicate"] == 1
    np.testing.assert_array_equal(ps.params, one)
    # a retried attempt: resumes at window 1 and holds a new lease; the old attempt is shut out
    f, p = hello(ps, 0)
    assert f["window"] == 1 and f["lease"] == 2
    np.testing.assert_array_equal(p, one)
    kind, r, _ = push(ps, 0, 1, 1, 1, one)
    assert kind == "stop" and ps.totals["refused_superseded"] == 1
    np.testing.assert_array_equal(ps.params, one)
    kind, r, _ = push(ps, 0, 2, 2, 1, one)                    # skipping a window is refused too
    assert not r["applied"] and ps.totals["refused_out_of_order"] == 1
    assert ps.version == 1 and ps.done == [1, 0]


def test_a_float64_model_takes_float64_pushes_and_refuses_float32_ones():
    """model.dtype = float64: workers send their f32 blocks as float64; the server checked them as float32
    and refused every push, so async training of a float64 model never ran."""
    cfg = config.load(None, [])
    ps = ParameterServer(LAYOUT, np.zeros(LAYOUT.size, np.float64), cfg.server, 3, 2, log=lambda *_: None)
    hello(ps, 0)
    change = np.full(LAYOUT.size, 1 / 3)
    blocks, _, _ = plan.encode(LAYOUT, change, cfg.exchange, np.array([1, 2]), 1, 1, 0, 2)
    fields, arrays = blocks_to_wire(blocks)
    fields.update(pid=0, lease=1, window=0, version=0)
    kind, r, _ = ps.handle("t", "push", fields, arrays)
    assert kind == "pushed" and r["applied"]
    np.testing.assert_array_equal(ps.params, change)                # float64's 1/3, not float32's
    fields, arrays = push_msg(change)
    fields.update(pid=0, lease=1, window=1, version=1)
    kind, r, _ = ps.handle("t", "push", fields, arrays)
    assert kind == "refused" and "f32 data must be a float64[6, 3] array" in r["reason"]


def test_the_window_in_flight_when_an_attempt_died_is_counted_as_redone():
    ps = server()
    hello(ps, 1)
    ps.handle("t", "heartbeat", {"pid": 1, "lease": 1, "window": 0}, {})     # training window 0, then dies
    f, _ = hello(ps, 1)
    assert f["window"] == 0 and ps.totals["windows_redone"] == 1 and ps.totals["attempts_retried"] == 1
    f, _ = hello(ps, 0)                                     # a first attempt redoes nothing
    assert ps.totals["windows_redone"] == 1


def test_staleness_divides_a_change_by_one_plus_the_versions_behind():
    ps = server(staleness="divide")
    hello(ps, 0)
    hello(ps, 1)
    one = np.ones(LAYOUT.size, np.float32)
    push(ps, 0, 1, 0, 0, one)                               # version 0 -> 1, staleness 0
    push(ps, 0, 1, 1, 1, one)                               # 1 -> 2
    push(ps, 1, 1, 0, 0, one * 3)                           # computed at version 0, two behind: / 3
    assert ps.applied == 3
    np.testing.assert_allclose(ps.params, 3.0, rtol=1e-6)
    assert ps.drain()["staleness"] == {0: 2, 2: 1}


def test_staleness_counts_the_pushes_a_copy_lacks_not_those_landed_above_its_watermark():
    """Worker 1's push is held mid-apply while worker 0's lands: worker 0's copy then holds its own push,
    not worker 1's, and its version is the watermark 0 below both. Its next push is one push behind (divided
    by 2), where counting from the watermark made it two (divided by 3): its own push counted as missing."""
    ps = server(staleness="divide")
    _, p0 = hello(ps, 0)
    hello(ps, 1)
    one = np.ones(LAYOUT.size, np.float32)
    th, release = held_push(ps, 1, 0, 0, one)
    _, r, a = push(ps, 0, 1, 0, 0, one)
    patch(LAYOUT, p0, r["pulled"], a)
    assert r["version"] == 0 and (p0 == 1.0).all()      # the watermark below worker 1's claim; its own push held
    release.set()
    th.join()
    assert ps.drain()["staleness"] == {0: 2}
    push(ps, 0, 1, 1, r["version"], one * 6)
    np.testing.assert_allclose(ps.params, 2.0 + 3.0, rtol=1e-6)
    assert ps.drain()["staleness"] == {1: 1}


def test_a_superseded_attempts_pull_does_not_stand_for_the_new_attempts_copy():
    """Attempt A's push, reserved before attempt B's hello, lands after it: A's pull once recorded its copy
    as the partition's, and B's first push, from a copy lacking A's landed push, was charged nothing."""
    ps = server(staleness="divide")
    hello(ps, 0)                                            # attempt A (lease 1)
    hello(ps, 1)
    gates, entered, scales, original = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()], \
        [], ps.apply

    def held(decoded, scale):
        i = len(scales)
        scales.append(scale)
        if i < 2:
            entered[i].set()
            gates[i].wait(5)
        original(decoded, scale)
    ps.apply = held
    one = np.ones(LAYOUT.size, np.float32)
    t1 = threading.Thread(target=push, args=(ps, 1, 1, 0, 0, one))
    t1.start()
    assert entered[0].wait(5)                               # worker 1's push held mid-apply: the watermark stays 0
    ta = threading.Thread(target=push, args=(ps, 0, 1, 0, 0, one))
    ta.start()
    assert entered[1].wait(5)                               # A's push held mid-apply
    f, copy = hello(ps, 0)                                  # attempt B (lease 2): its copy holds neither
    assert f["lease"] == 2 and f["version"] == 0 and not copy.any()
    gates[1].set()
    ta.join()                                               # A's push lands, and A pulls
    push(ps, 0, 2, 1, f["version"], one)                    # B's first push: one landed push behind
    gates[0].set()
    t1.join()
    assert scales[2] == 0.5


def test_adagrad_on_the_server_follows_its_formula():
    ps = server(update="adagrad", lr=0.5, eps=1e-6)
    hello(ps, 0)
    rng = np.random.default_rng(0)
    c1, c2 = rng.normal(size=LAYOUT.size), rng.normal(size=LAYOUT.size)
    push(ps, 0, 1, 0, 0, c1)
    push(ps, 0, 1, 1, 1, c2)
    c1, c2 = c1.astype(np.float32).astype(np.float64), c2.astype(np.float32).astype(np.float64)
    a1 = c1 ** 2
    a2 = a1 + c2 ** 2
    want = 0.5 * c1 / (np.sqrt(a1) + 1e-6) + 0.5 * c2 / (np.sqrt(a2) + 1e-6)
    np.testing.assert_allclose(ps.params, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ps.acc, a2, rtol=1e-5)


def test_a_push_whose_squares_overflow_is_refused_by_adagrad_before_it_is_reserved():
    """A finite float32 change of 1e20 made AdaGrad's sum infinite: the push applied with no failure, the
    parameter stopped moving, and every later checkpoint was one the loader refuses."""
    ps = server(update="adagrad", lr=0.5, eps=1e-6)
    hello(ps, 0)
    change = np.ones(LAYOUT.size, np.float32)
    change[3] = 1e20
    fields, arrays = push_msg(change)
    fields.update(pid=0, lease=1, window=0, version=0)
    kind, f, _ = ps.handle("t", "push", fields, arrays)
    assert (kind, f) == ("refused", {"reason": "embed: a value of 1e+20 squares past float32's largest number "
                                               "(AdaGrad sums squares)"})
    assert ps.version == 0 and ps.done == [0, 0] and np.isfinite(ps.acc).all() and ps.failures == []
    change[3] = 1e19                                # its square, 1e38, is a float32
    push(ps, 0, 1, 0, 0, change)
    assert ps.version == 1 and np.isfinite(ps.acc).all() and np.isfinite(ps.params).all()


def test_a_float64_models_adagrad_sums_a_codecs_float32_values_in_float64():
    """bf16 blocks decode to float32: their squares were taken in float32, so a change of 1e20 (below the
    float64 bound the push was checked against) made the accumulator infinite and every later checkpoint
    one the loader refuses."""
    cfg = config.load(None, ["server.update=adagrad", "server.lr=0.5", "exchange.hidden=dense+bf16",
                             "exchange.embed=dense+bf16", "exchange.softmax=dense+bf16", "model.dtype=float64"])
    ps = ParameterServer(LAYOUT, np.zeros(LAYOUT.size, np.float64), cfg.server, 3, 1, log=lambda *_: None)
    hello(ps, 0)
    change = np.ones(LAYOUT.size, np.float64)
    change[3] = 1e20
    blocks, _, _ = plan.encode(LAYOUT, change, cfg.exchange, np.array([1, 2]), 1, 1, 0, 1)
    fields, arrays = blocks_to_wire(blocks)
    fields.update(pid=0, lease=1, window=0, version=0)
    assert ps.handle("t", "push", fields, arrays)[1]["applied"]
    assert np.isfinite(ps.acc).all() and ps.acc[3] == pytest.approx(1e40, rel=1e-2)
    np.testing.assert_allclose(ps.params, 0.5 / (1 + 1e-8), rtol=1e-6)


def test_pushes_that_add_up_past_the_types_range_stop_the_run_as_a_failure():
    """Each push is finite, their sum is not: the parameters went infinite with no failure recorded, and the
    next line's checkpoint held them. The push that overflows is now the run's failure, before any checkpoint."""
    ps = server()
    hello(ps, 0)
    hello(ps, 1)
    big = np.full(LAYOUT.size, 2e38, np.float32)
    push(ps, 0, 1, 0, 0, big)
    with pytest.raises(FloatingPointError, match="the server's parameters left float32's range"):
        push(ps, 1, 1, 0, 0, big)
    assert len(ps.failures) == 1 and "window 0 failed: embed: the server's parameters left" in ps.failures[0]


def test_row_blocks_in_a_codec_arrive_as_the_worker_encoded_them():
    ps = server()
    hello(ps, 0)
    rng = np.random.default_rng(1)
    change = rng.normal(size=LAYOUT.size).astype(np.float32)
    change[:18].reshape(6, 3)[[0, 3, 4, 5]] = 0                 # the embedding rows of words not read
    fields, arrays = push_msg(change, embed="rows+int8", softmax="rows+fp16", hidden="dense+bf16")
    assert fields["blocks"]["embed"]["codec"] == "int8" and arrays["embed.ids"].tolist() == [1, 2]
    fields.update(pid=0, lease=1, window=0, version=0)
    ps.handle("t", "push", fields, arrays)
    got, v = LAYOUT.views(ps.params), LAYOUT.views(change)
    top = np.abs(v["embed"]).max(axis=1, keepdims=True)
    assert np.all(np.abs(got["embed"] - v["embed"]) <= top / 254 + 1e-7)             # int8, per row
    assert not got["embed"][[0, 3, 4, 5]].any() and got["embed"][[1, 2]].all()
    for name in ("Wo", "bo"):          # fp16, V_all = the words read (no frequent or random rows here)
        np.testing.assert_allclose(got[name][[1, 2]], v[name][[1, 2]], rtol=2 ** -10, atol=1e-6)
        assert not got[name][[0, 3, 4, 5]].any()
    for name in ("W1", "b1"):                                                           # bf16
        np.testing.assert_allclose(got[name], v[name], rtol=2 ** -7)
        assert not np.array_equal(got[name], v[name])          # really rounded: the codec was applied


@pytest.mark.parametrize("breakage", ["unknown slot", "missing slot", "bad ids", "unsorted ids", "wrong dtype",
                                      "nan", "short data", "bad codec", "extra array", "blocks a list"])
def test_malformed_pushes_are_refused_before_anything_is_applied(breakage):
    ps = server()
    hello(ps, 0)
    fields, arrays = push_msg(np.ones(LAYOUT.size), embed="rows")
    meta = fields["blocks"]
    if breakage == "unknown slot":
        meta["Wz"] = meta.pop("W1")
    elif breakage == "missing slot":
        del meta["bo"]
    elif breakage == "bad ids":
        arrays["embed.ids"] = np.array([1, 9], np.int32)
    elif breakage == "unsorted ids":
        arrays["embed.ids"] = np.array([2, 1], np.int32)
    elif breakage == "wrong dtype":
        arrays["W1.data"] = arrays["W1.data"].astype(np.float64)
    elif breakage == "nan":
        arrays["W1.data"][0, 0] = np.nan
    elif breakage == "short data":
        arrays["Wo.data"] = arrays["Wo.data"][:3]
    elif breakage == "bad codec":
        meta["W1"]["codec"] = "pickle"
    elif breakage == "blocks a list":
        fields["blocks"] = sorted(meta)                        # the slots' names, not a table of them
    else:
        arrays["evil"] = np.zeros(3, np.float32)
    fields.update(pid=0, lease=1, window=0, version=0)
    kind, f, _ = ps.handle("t", "push", fields, arrays)
    assert kind == "refused" and f["reason"] and ps.totals["refused_protocol"] == 1
    assert not ps.params.any() and ps.done == [0, 0] and ps.version == 0


def test_requests_naming_no_partition_are_refused():
    ps = server(partitions=2)
    for i, pid in enumerate((2, -1, "0", None, True)):
        kind, f, _ = ps.handle("t", "hello", {"pid": pid}, {})
        assert kind == "refused" and "names no partition" in f["reason"] and ps.totals["refused_protocol"] == i + 1
    assert ps.lease == [0, 0]


def test_refusals_past_the_logs_burst_are_counted_in_one_line_at_the_end():
    lines = []
    ps = ParameterServer(LAYOUT, np.zeros(LAYOUT.size, np.float32), config.Config().server, 3, 1, log=lines.append)
    for _ in range(8):
        assert ps.handle("peer", "heartbeat", {"pid": 7}, {})[0] == "refused"
    assert len(lines) == 5 and ps.totals["refused_protocol"] == 8
    ps.flush_log()
    assert len(lines) == 6 and "3 more" in lines[-1], lines[-1]


def test_a_silent_worker_is_reported_once_until_it_says_hello_again():
    ps = server(heartbeat_s=0.1, timeout_s=1.0)
    hello(ps, 0)
    hello(ps, 1)
    now = ps.last_seen[0]
    assert ps.check_workers(now + 0.5) == []
    ps.handle("t", "heartbeat", {"pid": 1, "lease": 1, "window": 0}, {})
    assert ps.last_seen[1] > now                                        # a heartbeat counts as a sign of life
    ps.last_seen[1] = now + 1.0                                         # ... as if it came a second later
    assert ps.check_workers(now + 1.5) == [0]
    assert ps.check_workers(now + 1.6) == []                            # once
    assert ps.totals["workers_lost"] == 1
    hello(ps, 0)
    assert not ps.lost[0]


def test_a_partition_that_pushed_its_last_window_is_never_reported_lost():
    """Its task has ended: silence is expected, and a retry would find nothing left to train."""
    ps = server(windows=1, heartbeat_s=0.1, timeout_s=1.0)
    hello(ps, 0)
    hello(ps, 1)
    push(ps, 0, 1, 0, 0, np.ones(LAYOUT.size, np.float32))
    assert ps.check_workers(ps.last_seen[0] + 5.0) == [1] and ps.totals["workers_lost"] == 1


def standby(ps, pid, lease):
    return ps.handle("t", "standby", {"pid": pid, "lease": lease}, {})[0]


def test_a_superseded_attempt_stands_by_until_its_partition_is_finished_or_the_newer_attempt_is_gone():
    """A speculative copy's hello supersedes the original, which then asks instead of failing (a failed task counts
    against spark.task.maxFailures, and Spark starts no other attempt while it runs): wait while the newer attempt
    lives, resume when it left or went silent, finished when every window is applied."""
    ps = server(windows=2, partitions=1, heartbeat_s=0.1, timeout_s=1.0)
    one = np.ones(LAYOUT.size, np.float32)
    hello(ps, 0)                                                        # the original: lease 1
    hello(ps, 0)                                                        # the copy: lease 2
    assert standby(ps, 0, 1) == "wait"
    kind, f, _ = ps.handle("t", "standby", {"pid": 0, "lease": 2}, {})              # the newest does not stand by
    assert kind == "refused" and f["reason"] == "standby: lease 2 is partition 0's newest, not a superseded one"
    # silent: the original's questions do not keep the partition seen
    seen = ps.last_seen[0]
    ps.last_seen[0] = seen - 5.0
    assert standby(ps, 0, 1) == "wait" and ps.last_seen[0] == seen - 5.0
    assert ps.check_workers() == [0] and standby(ps, 0, 1) == "resume"
    f, _ = hello(ps, 0)                                                 # the original again: lease 3
    assert f["lease"] == 3 and f["window"] == 0 and standby(ps, 0, 2) == "wait"
    assert ps.handle("t", "leave", {"pid": 0, "lease": 3}, {})[0] == "ok"        # its task ended
    assert standby(ps, 0, 1) == "resume" and standby(ps, 0, 2) == "wait"          # one of them takes over
    ps.resuming[0] -= 1.5                                               # ... and says no hello for timeout_s
    assert standby(ps, 0, 2) == "resume" and standby(ps, 0, 1) == "wait"
    hello(ps, 0)                                                        # lease 4 finishes the partition
    push(ps, 0, 4, 0, 0, one)
    assert standby(ps, 0, 2) == "wait"
    push(ps, 0, 4, 1, 1, one)
    assert standby(ps, 0, 1) == standby(ps, 0, 3) == "finished"
    assert ps.totals["workers_lost"] == 1 and ps.totals["attempts_retried"] == 3 and ps.version == 2


ONE = np.ones(LAYOUT.size, np.float32)


def beat(ps, pid, lease, window=0):
    return ps.handle("t", "heartbeat", {"pid": pid, "lease": lease, "window": window}, {})[0]


def test_a_worker_heard_from_that_pushes_nothing_is_stuck_once_past_stall_factor_times_the_slowest_window():
    """Heartbeats come from a thread of their own: they said an attempt's process lived, not that it trained,
    so an attempt blocked in its training (a read that never returns) held its partition for ever and the run
    never ended. Now one with no window accepted for stall_factor x the slowest window seen (at least
    timeout_s) is reported stuck once, and its heartbeats are answered so."""
    ps = server(windows=3, heartbeat_s=0.1, timeout_s=1.0)            # stall_factor: 10 by default
    hello(ps, 0)
    hello(ps, 1)
    t0 = ps.progress_at[1]

    def alive(now):                                                    # heartbeats keep both listed
        ps.last_seen[0] = ps.last_seen[1] = now
        return ps.check_workers(now)
    assert alive(t0 + 60.0) == []                                      # no window yet: nothing to judge by
    push(ps, 0, 1, 0, 0, ONE)
    assert 0 < ps.slowest_s < 1.0 and ps.progress_at[0] > t0
    ps.slowest_s = 0.2                                                 # the slowest window: 10 x 0.2 s = 2 s
    ps.progress_at[0] = ps.progress_at[1] = t0
    assert alive(t0 + 1.9) == [] and beat(ps, 1, 1) == "ok"
    assert alive(t0 + 2.1) == [0, 1]
    assert alive(t0 + 2.2) == [] and ps.totals["workers_stuck"] == 2 and ps.totals.get("workers_lost", 0) == 0
    assert beat(ps, 1, 1) == "stuck" and ps.lost[1] and ps.told_stuck == {1}
    hello(ps, 1)                                                       # a retried task: a fresh start
    assert beat(ps, 1, 2) == "ok" and ps.totals["windows_redone"] == 1 and ps.told_stuck == set()
    ps.slowest_s = 0.01                                                # never below timeout_s
    assert alive(ps.progress_at[1] + 0.9) == [] and alive(ps.progress_at[1] + 1.1) == [1]
    # the slowest window is the longest wait for an accepted push since hello or the one before
    ps = server(windows=3, heartbeat_s=0.1, timeout_s=1.0)
    hello(ps, 0)
    ps.progress_at[0] -= 0.5
    push(ps, 0, 1, 0, 0, ONE)
    ps.progress_at[0] -= 0.25
    push(ps, 0, 1, 1, 1, ONE)
    assert 0.5 <= ps.slowest_s < 0.6
    push(ps, 0, 1, 1, 2, ONE)                                          # a duplicate: no progress
    assert ps.totals["refused_duplicate"] == 1 and ps.done[0] == 2
    never = server(windows=3, heartbeat_s=0.1, timeout_s=1.0, stall_factor=0)     # 0: never stuck
    hello(never, 0)
    push(never, 0, 1, 0, 0, ONE)
    never.last_seen[0] = never.progress_at[0] + 1e6
    assert never.check_workers(never.progress_at[0] + 1e6) == [] and beat(never, 0, 1) == "ok"


def stuck_at(ps, pid):
    """Make partition ``pid``'s newest attempt stuck now (heard from, no window for past the limit)."""
    ps.slowest_s = 0.2
    now = ps.progress_at[pid] + 5.0
    ps.last_seen[pid] = now
    assert pid in ps.check_workers(now)


def test_a_stuck_attempt_is_told_so_even_once_a_standby_has_taken_over():
    """Found stuck, the partition's newest attempt counts as gone, so one standing by resumes; its hello used
    to make the stuck attempt's next heartbeat a superseded one's ("stop"), and a blocked task heard nothing
    that would end it: Spark waited on it for ever."""
    ps = server(windows=3, partitions=1, heartbeat_s=0.1, timeout_s=1.0)
    hello(ps, 0)                                                       # the original: lease 1
    hello(ps, 0)                                                       # a copy: lease 2, then stuck
    push(ps, 0, 2, 0, 0, ONE)
    stuck_at(ps, 0)
    assert standby(ps, 0, 1) == "resume"
    f, _ = hello(ps, 0)                                                # the original again: lease 3
    assert f["window"] == 1 and beat(ps, 0, 2) == "stuck" and beat(ps, 0, 3) == "ok"
    assert ps.totals["refused_superseded"] == 0


def test_a_stuck_attempt_whose_window_comes_after_all_is_the_partitions_again():
    """Slow, not stuck: a push of the attempt found stuck is applied, and it is the partition's attempt again
    (heartbeats answered ok, not counted gone), unless a standby was told to resume meanwhile."""
    ps = server(windows=3, partitions=1, heartbeat_s=0.1, timeout_s=1.0)
    hello(ps, 0)
    push(ps, 0, 1, 0, 0, ONE)
    stuck_at(ps, 0)
    kind, f, _ = push(ps, 0, 1, 1, 1, ONE)
    assert kind == "pushed" and f["applied"] and beat(ps, 0, 1) == "ok" and not ps.lost[0]
    stuck_at(ps, 0)                                                    # stuck again: counted again
    assert ps.totals["workers_stuck"] == 2
    hello(ps, 0)                                                       # lease 2 supersedes, then stalls too
    stuck_at(ps, 0)
    assert standby(ps, 0, 1) == "resume"                               # lease 1 is told to resume, then
    assert push(ps, 0, 2, 2, 2, ONE)[0] == "pushed" and ps.lost[0]     # lease 2's window comes: still gone


def test_an_attempt_reported_lost_for_a_silence_is_judged_stuck_once_heard_from_again():
    """One silence longer than timeout_s (a pause of the whole executor) reported the attempt lost, after which it
    was never judged stuck again however long it then went without a window."""
    ps = server(windows=3, partitions=1, heartbeat_s=0.1, timeout_s=1.0)
    hello(ps, 0)
    push(ps, 0, 1, 0, 0, ONE)
    ps.slowest_s = 0.2
    t = ps.progress_at[0]
    assert ps.check_workers(t + 1.5) == [0] and ps.lost[0]             # silent: lost
    ps.last_seen[0] = t + 100.0                                        # its heartbeats again, no window
    assert ps.check_workers(t + 100.0) == [0] and ps.totals["workers_stuck"] == 1
    assert beat(ps, 0, 1) == "stuck"


def test_a_stuck_attempt_hears_so_on_its_heartbeats_thread_while_its_training_thread_is_blocked():
    """Through the real wire: the training thread pushes a window, then blocks; the heartbeats go on, the server
    finds it stuck, and the client's ``on_stuck`` runs on the heartbeats' thread (a Spark task ends its process
    there) with the server's reason."""
    ps = server(heartbeat_s=0.05, timeout_s=0.5)
    secret = wire.new_secret()
    frames = wire.FrameServer(ps.handle, secret, log=lambda *_: None).start()
    told = []
    client = WorkerClient(frames.address, secret, 1, ps.sv, LAYOUT,
                          on_stuck=lambda reason: told.append((threading.current_thread().name, reason)))
    try:
        first, _, version, params = client.hello()
        blocks, _, _ = plan.encode(LAYOUT, np.ones(LAYOUT.size, np.float32), config.load(None).exchange,
                                   np.array([1]), 1, 1, 1, 2)
        assert client.push(0, version, blocks, params, tokens=1) == 1
        client.training(1)                                             # ... and blocks: no push comes
        wait_for(lambda: ps.check_workers() == [1] or ps.stuck_lease[1], timeout=5.0)
        wait_for(lambda: told, timeout=5.0)
        assert told == [("heartbeat-1",
                         "no window pushed for longer than server.stall_factor allows, though heartbeats arrive")]
        assert ps.totals["workers_stuck"] == 1 and ps.totals.get("workers_lost", 0) == 0
    finally:
        client.close()
        frames.close()


def test_lock_free_pushes_from_threads_all_land_once():
    """Hogwild! applies without a lock, but the bookkeeping is exact: every window lands once."""
    P, W = 4, 30
    ps = server(windows=W, partitions=P)
    one = np.ones(LAYOUT.size, np.float32)

    def worker(pid):
        f, _ = hello(ps, pid)
        for w in range(W):
            push(ps, pid, f["lease"], w, ps.applied, one)
            push(ps, pid, f["lease"], w, ps.applied, one)         # a duplicate of every window: refused

    threads = [threading.Thread(target=worker, args=(p,)) for p in range(P)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert ps.version == ps.applied == P * W and ps.done == [W] * P
    assert ps.totals["refused_duplicate"] == P * W
    # lost updates are Hogwild!'s price: with 4 threads adding ones, the sum is at most P * W
    assert ps.params.max() <= P * W and ps.params.min() > 0


@pytest.mark.parametrize("update", ["add", "adagrad"])
def test_lock_free_row_blocks_landing_at_once_on_the_same_rows_lose_no_push(update):
    """Hogwild! allows a lost element where two pushes write it at the same instant, not a lost push: a row
    block's gather, change and scatter back took milliseconds, and a push landing meanwhile on the same rows
    was overwritten whole (about 60% of them, four threads). Dense slots are added in place."""
    R, C, P, N = 100_000, 16, 4, 15
    layout = Layout([("embed", (R, C))])
    cfg = config.load(None, [f"server.update={update}"])
    ps = ParameterServer(layout, np.zeros(layout.size, np.float32), cfg.server, 1, 1, log=lambda *_: None)
    slot = next(iter(layout))
    ids = np.arange(0, R, 2, dtype=np.int32)
    ones = np.ones((ids.size, C), np.float32)

    def worker():
        for _ in range(N):
            ps.apply([(slot, ids, ones)], 1.0)

    threads = [threading.Thread(target=worker) for _ in range(P)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    got = (ps.params if update == "add" else ps.acc).reshape(R, C)
    lo, hi = float(got[ids].min()), float(got[ids].max())
    assert lo == hi == P * N, (lo, hi)                          # every push's every row (adagrad: its square)
    assert not got[1::2].any()


def test_a_pull_sees_a_locked_push_with_its_bookkeeping_or_not_at_all(monkeypatch):
    """Under server.lock a push's bookkeeping (the pushes applied, its rows' stamps) was done after the lock was
    given back: a pull between held the push's change but not its count, so the puller's next push was
    divided as one push behind although its copy lacked none, and its first push, which did lack one, was not."""
    ps = server(staleness="divide", lock="true")
    hello(ps, 0)
    hello(ps, 1)
    one = np.ones(LAYOUT.size, np.float32)
    scales, apply = [], ps.apply
    monkeypatch.setattr(ps, "apply", lambda decoded, scale: (scales.append(scale), apply(decoded, scale)))
    entered, gate, landed = threading.Event(), threading.Event(), ps._landed

    def held_landed(*args):
        if not entered.is_set():                # worker 1's push: held between its change and its count
            entered.set()
            gate.wait(5)
        landed(*args)

    monkeypatch.setattr(ps, "_landed", held_landed)
    first = threading.Thread(target=push, args=(ps, 1, 1, 0, 0, one))
    first.start()
    assert entered.wait(5)
    replies = []
    second = threading.Thread(target=lambda: replies.append(push(ps, 0, 1, 0, 0, one)))
    second.start()
    time.sleep(0.3)
    gate.set()
    first.join()
    second.join()
    _, r, _ = replies[0]
    push(ps, 0, 1, 1, r["version"], one)
    assert scales == [1.0, 0.5, 1.0]            # worker 0's first push lacked worker 1's; its second lacked none
    assert ps.drain()["staleness"] == {0: 2, 1: 1}


def test_a_push_decoded_while_a_newer_attempt_says_hello_is_not_applied(monkeypatch):
    """The lease is checked again when the window is reserved: an attempt superseded while its push
    was being decoded cannot apply it (the zombie race)."""
    ps = server()
    hello(ps, 0)
    fields, arrays = push_msg(np.ones(LAYOUT.size))
    fields.update(pid=0, lease=1, window=0, version=0)
    decode = paramserver.blocks_from_wire

    def hello_during_decode(*args):
        hello(ps, 0)                     # the retry announces itself between the first check and the claim
        return decode(*args)

    monkeypatch.setattr(paramserver, "blocks_from_wire", hello_during_decode)
    kind, _, _ = ps.handle("t", "push", fields, arrays)
    assert kind == "stop" and ps.done == [0, 0] and not ps.params.any()


def test_a_worker_failure_and_a_refusal_reach_the_right_side():
    """Through the real wire: a refused push raises in the worker with the server's reason; a worker's
    failure report lands in the server's ``failures`` (the driver stops the run on it)."""
    ps, beats = server(), []

    def handle(peer, kind, fields, arrays):
        beats.append(kind == "heartbeat")
        return ps.handle(peer, kind, fields, arrays)
    secret = wire.new_secret()
    frames = wire.FrameServer(handle, secret, log=lambda *_: None).start()
    sv = config.load(None, ["server.heartbeat_s=0.1"]).server
    client = WorkerClient(frames.address, secret, 1, sv, LAYOUT)
    try:
        first, windows, version, params = client.hello()
        assert (first, windows, version) == (0, 3, 0) and params.shape == (LAYOUT.size,)
        blocks, _, _ = plan.encode(LAYOUT, np.ones(LAYOUT.size, np.float32), config.load(None).exchange,
                                   np.array([1]), 1, 1, 1, 2)
        blocks["params.bo"].data[0, 0] = np.nan
        with pytest.raises(RuntimeError, match="refused push: bo: non-finite"):
            client.push(0, 0, blocks, params, tokens=1)
        assert ps.totals["refused_protocol"] == 1 and ps.version == 0
        client.fail("loss became nan at local step 3")
        assert ps.failures == ["partition 1: loss became nan at local step 3"]
        client.fail("x" * 5000)                             # cut to what the server takes, not refused
        assert ps.failures[1] == "partition 1: " + "x" * 300
        wait_for(lambda: sum(beats) >= 2 and frames.connections == 2)      # heartbeats on the second connection
    finally:
        client.close()
        frames.close()
    # the worker's bytes, both connections and their handshakes, are the server's seen from the other side
    assert client.bytes == (frames.bytes_received, frames.bytes_sent) and frames.connections == 2


def test_a_snapshot_waits_for_a_push_being_applied():
    """Hogwild! applies a reserved push outside the bookkeeping lock: the checkpoint's copy must still hold
    exactly the windows it names, so a snapshot taken mid-apply waits for that push to land."""
    ps = server()
    hello(ps, 0)
    applying, original = threading.Event(), ps.apply

    def slow_apply(decoded, scale):
        applying.set()
        threading.Event().wait(0.3)
        original(decoded, scale)

    ps.apply = slow_apply
    th = threading.Thread(target=push, args=(ps, 0, 1, 0, 0, np.ones(LAYOUT.size, np.float32)))
    th.start()
    assert applying.wait(5)
    snap = ps.snapshot()
    th.join()
    assert snap["version"] == 1 and snap["done"] == [1, 0]
    np.testing.assert_array_equal(snap["params"], 1.0)


def test_a_pull_sends_the_rows_changed_since_the_last_and_the_copy_stays_exact():
    """Two workers push row blocks; each keeps a copy patched by its pulls. The copies equal the server's
    parameters after every pull, and a pull carries only the rows changed since the worker's previous one."""
    ps = server(windows=6)
    copies, versions = {}, {}
    for pid in (0, 1):
        f, copies[pid] = hello(ps, pid)
        versions[pid] = f["version"]
    rng = np.random.default_rng(3)
    for w in range(6):
        for pid in (0, 1):
            change = np.zeros(LAYOUT.size, np.float32)
            v = LAYOUT.views(change)
            word = (2 * w + pid) % 6
            v["embed"][word] = rng.normal(size=3)
            v["W1"][...] = rng.normal(size=(4, 3))
            fields, arrays = push_msg(change, embed="rows", softmax="rows")
            fields.update(pid=pid, lease=1, window=w, version=versions[pid])
            kind, r, a = ps.handle("t", "push", fields, arrays)
            assert r["applied"]
            sent_embed = a.get("embed.ids")
            # this worker's word and the other worker's word since its last pull: two rows, not six
            assert sent_embed is not None and len(sent_embed) == (1 if w == 0 and pid == 0 else 2)
            assert r["pulled"]["W1"] == "all"
            patch(LAYOUT, copies[pid], r["pulled"], a)
            versions[pid] = r["version"]
            np.testing.assert_array_equal(copies[pid], ps.params)


def test_a_locked_server_pulls_every_slot_at_one_instant(monkeypatch):
    """server.lock = true: one push or pull at a time touches the parameters. A pull took the lock per
    slot, so a whole push could land between two slots' copies: a worker's copy held it in some slots only."""
    ps = server(lock="true")
    hello(ps, 0)
    _, p1 = hello(ps, 1)
    lock, pushing, entries = ps._params_lock, threading.current_thread(), [0]

    def other_push():
        fields, arrays = push_msg(np.full(LAYOUT.size, 100.0, np.float32))
        fields.update(pid=1, lease=1, window=0, version=0)
        assert ps.handle("t", "push", fields, arrays)[1]["applied"]

    class Between:                                 # partition 1's push lands when this thread enters a 3rd time
        def __enter__(self):
            if threading.current_thread() is pushing:
                entries[0] += 1
                if entries[0] == 3:               # its push applied, its pull's first slot copied
                    t = threading.Thread(target=other_push)
                    t.start()
                    t.join()
            lock.acquire()

        def __exit__(self, *exc):
            lock.release()

    monkeypatch.setattr(ps, "_params_lock", Between())
    kind, r, a = push(ps, 0, 1, 0, 0, np.ones(LAYOUT.size, np.float32))
    assert kind == "pushed" and r["applied"]
    copy = np.zeros(LAYOUT.size, np.float32)
    patch(LAYOUT, copy, r["pulled"], a)
    assert len(set(copy.tolist())) == 1 and copy[0] in (1.0, 101.0)     # one instant: with or without 100


def test_a_push_in_flight_during_a_pull_is_sent_by_the_next_pull():
    """Hogwild! lands pushes out of order: rows a push still applies when another worker pulls are
    stamped above the watermark that pull returns, so that worker's next pull sends them."""
    ps = server()
    f0, p0 = hello(ps, 0)
    hello(ps, 1)
    one = np.ones(LAYOUT.size, np.float32)
    th, release = held_push(ps, 1, 0, 0, one * 2)
    kind, r, a = push(ps, 0, 1, 0, 0, one)             # lands while worker 1's push is held mid-apply
    patch(LAYOUT, p0, r["pulled"], a)
    assert r["version"] == 0                           # claim 1 (worker 1's) has not landed: watermark 0
    np.testing.assert_array_equal(p0, 1.0)             # its own change, not yet worker 1's
    release.set()
    th.join()
    kind, r, a = push(ps, 0, 1, 1, r["version"], np.zeros(LAYOUT.size, np.float32))
    patch(LAYOUT, p0, r["pulled"], a)
    np.testing.assert_array_equal(p0, 3.0)
    np.testing.assert_array_equal(p0, ps.params)


def within(seconds, fn, *args):
    """``fn(*args)``'s result or exception, or AssertionError if it has not returned in ``seconds``."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:
            out["error"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"{getattr(fn, '__name__', fn)} still waits after {seconds} s"
    return out.get("error", out.get("value"))


@pytest.mark.parametrize("field, value, reason", [
    ("tokens", 10 ** 400, "tokens must be an integer in [0, 2**53]"),        # once landed, then wedged the server
    ("tokens", -1, "tokens must be an integer in [0, 2**53]"),
    ("tokens", 2.5, "tokens must be an integer in [0, 2**53]"),
    ("steps", True, "steps must be an integer in [0, 2**53]"),
    ("loss_sum", float("nan"), "loss_sum must be a finite number in [0, 2**53]"),
    ("loss_sum", float("inf"), "loss_sum must be a finite number in [0, 2**53]"),
    ("loss_sum", -1.0, "loss_sum must be a finite number in [0, 2**53]"),
    ("compute_s", 10 ** 400, "compute_s must be a finite number in [0, 2**53]"),
    ("compute_s", "1", "compute_s must be a finite number in [0, 2**53]"),
    ("version", 1, "version 1 is not one this server has issued (0..0)"),
    ("version", -1, "version -1 is not one this server has issued (0..0)"),
    ("window", None, "push needs an integer window and version"),
], ids=lambda v: v if isinstance(v, str) else repr(v)[:12])
def test_every_number_of_a_push_is_checked_before_anything_is_reserved(field, value, reason):
    ps = server()
    hello(ps, 0)
    fields, arrays = push_msg(np.ones(LAYOUT.size))
    fields.update(pid=0, lease=1, window=0, version=0, tokens=10, loss_sum=5.0, steps=2, compute_s=0.5)
    fields[field] = value
    kind, f, _ = ps.handle("t", "push", fields, arrays)
    assert (kind, f) == ("refused", {"reason": reason}) and ps.totals["refused_protocol"] == 1
    assert ps.version == 0 and ps.done == [0, 0] and not ps.params.any()
    snap = within(2.0, ps.snapshot, True)                   # nothing left reserved: the checkpoint does not wait
    assert snap["version"] == 0 and snap["drained"]["syncs"] == 0


def test_push_statistics_are_counted_as_sent():
    ps = server()
    hello(ps, 0)
    push(ps, 0, 1, 0, 0, np.ones(LAYOUT.size), tokens=2 ** 53, loss_sum=7.5, steps=3, compute_s=0.25)
    d = ps.drain()
    assert (d["tokens"], d["loss_sum"], d["steps"], d["pushes"]) == (2 ** 53, 7.5, 3, 1)


def test_a_snapshot_waits_for_a_push_that_never_lands_at_most_timeout_s():
    """A push reserved but never landed (an apply that hangs) must not wedge the driver's checkpoint: the
    snapshot gives up after server.timeout_s with one line, and other partitions' pushes are served meanwhile."""
    ps = server(heartbeat_s=0.1, timeout_s=0.5)
    hello(ps, 0)
    hello(ps, 1)
    applying, release = hold_first_apply(ps, 20)
    th = threading.Thread(target=push, args=(ps, 0, 1, 0, 0, np.ones(LAYOUT.size, np.float32)), daemon=True)
    th.start()
    try:
        assert applying.wait(5)
        t0 = time.monotonic()
        e = within(3.0, ps.snapshot)
        assert type(e).__name__ == "Stalled", e             # (imported by name: it did not exist)
        assert str(e) == "parameter server: 1 push still being applied after 0.5 s (server.timeout_s)"
        assert 0.5 <= time.monotonic() - t0 < 3.0
        kind, r, _ = within(2.0, push, ps, 1, 1, 0, 0, np.ones(LAYOUT.size, np.float32))   # not frozen any more
        assert kind == "pushed" and r["applied"]
    finally:
        release.set()
        th.join(5)
    assert within(2.0, ps.snapshot)["done"] == [1, 1]


def test_a_push_for_a_window_past_the_run_is_refused():
    ps = server(windows=2)
    hello(ps, 0)
    one = np.ones(LAYOUT.size, np.float32)
    assert push(ps, 0, 1, 0, 0, one)[1]["applied"] and push(ps, 0, 1, 1, 1, one)[1]["applied"]
    kind, f, _ = push(ps, 0, 1, 2, 2, one)
    assert (kind, f) == ("refused", {"reason": "window 2 is not one of this run's 2 windows"})
    assert ps.done == [2, 0] and ps.version == 2 and ps.totals["refused_protocol"] == 1
    np.testing.assert_array_equal(ps.params, 2.0)


def test_requests_from_a_partition_that_never_said_hello_are_refused():
    ps = server()
    hello(ps, 0)
    fields, arrays = push_msg(np.ones(LAYOUT.size))
    requests = [("push", dict(fields, pid=1, lease=0, window=0, version=0), arrays),
                ("heartbeat", {"pid": 1, "lease": 0, "window": 1}, {}),
                ("failed", {"pid": 1, "lease": 0, "error": "made up"}, {})]
    for i, (kind, f, a) in enumerate(requests):
        got = ps.handle("t", kind, f, a)
        assert got == ("refused", {"reason": "partition 1 has not said hello"}, {}) and \
            ps.totals["refused_protocol"] == i + 1, got
    assert ps.version == 0 and not ps.params.any() and ps.started == [0, 0] and ps.failures == []


@pytest.mark.parametrize("kind, fields, reason", [
    ("push", {"lease": None}, "request 'push' needs a lease (an integer from hello), not None"),
    ("push", {"lease": True}, "request 'push' needs a lease (an integer from hello), not True"),
    ("push", {"lease": 2}, "lease 2 of partition 0 was never issued"),
    ("push", {"lease": 0}, "lease 0 of partition 0 was never issued"),          # not superseded: never issued
    ("heartbeat", {"lease": -3}, "lease -3 of partition 0 was never issued"),
    ("heartbeat", {"window": 4}, "heartbeat: window 4 is not in [0, 3]"),
    ("heartbeat", {"window": 10 ** 400}, "heartbeat: window 1000"),
    ("failed", {"error": ["x"]}, "failed: the error must be a string"),
    # a line break and a terminal escape would become the run's stop line, as written
    ("failed", {"error": "loss nan\n\x1b[31mFAKE LOG LINE"}, "failed: the error must be a string of 1 to 2000"),
])
def test_malformed_requests_of_a_known_partition_are_refused(kind, fields, reason):
    ps = server()
    hello(ps, 0)
    f, a = push_msg(np.ones(LAYOUT.size)) if kind == "push" else ({}, {})
    f = {**f, "pid": 0, "lease": 1, "window": 0, "version": 0, **fields}
    got_kind, got, _ = ps.handle("t", kind, f, a)
    assert got_kind == "refused" and got["reason"].startswith(reason) and len(got["reason"]) < 200, got
    assert ps.totals["refused_protocol"] == 1 and ps.version == 0 and ps.started == [0, 0] and ps.failures == []


def crafted(**ex):
    """A well-formed push of ones in the given exchange codecs (fields, arrays), for pid 0's first window."""
    fields, arrays = push_msg(np.ones(LAYOUT.size), **ex)
    fields.update(pid=0, lease=1, window=0, version=0)
    return fields, arrays


@pytest.mark.parametrize("breakage, reason", [
    ("fp16 scale 10**400", "W1: the fp16 scale must be a power of two in [2^-113, 2^127]"),
    ("fp16 scale 0", "W1: the fp16 scale must be a power of two in [2^-113, 2^127]"),
    ("fp16 scale array", "W1: carries an array W1.scale the fp16 codec does not have"),
    ("onebit scalar scale", "embed: onebit scale must be a float32[6, 2] array"),
    ("onebit zero groups", "embed: onebit scale must be a float32[6, 2] array"),
    ("onebit one-row scale", "embed: onebit scale must be a float32[6, 2] array"),
    ("onebit short data", "embed: onebit data must be a uint8[6, 1] array"),
    ("int8 broadcast scale", "embed: int8 data must be a int8[6, 3] array"),
    ("int8 nan scale", "embed: int8 scale must hold finite values"),
    ("ids 2-D", "embed: row ids must be sorted unique int32 in [0, 6)"),
    # int32 differences wrap: np.diff read these as increasing, the push was reserved, then half applied
    ("ids wrapping", "embed: row ids must be sorted unique int32 in [0, 6)"),
])
def test_malformed_codec_payloads_are_refused_with_their_reason(breakage, reason):
    codec = breakage.split()[0]
    ex = {"fp16": {"hidden": "dense+fp16"}, "onebit": {"embed": "rows+onebit", "feedback": "true"},
          "int8": {"embed": "rows+int8"}, "ids": {"embed": "rows"}}[codec]
    fields, arrays = crafted(**ex)
    meta = fields["blocks"]
    if breakage == "fp16 scale 10**400":
        meta["W1"]["scale"] = 10 ** 400
    elif breakage == "fp16 scale 0":
        meta["W1"]["scale"] = 0
    elif breakage == "fp16 scale array":
        arrays["W1.scale"] = np.ones((4, 1), np.float32)
    elif breakage == "onebit scalar scale":
        del arrays["embed.scale"]
        meta["embed"]["scale"] = 1.0
    elif breakage == "onebit zero groups":
        arrays["embed.scale"] = np.zeros((0, 2), np.float32)
    elif breakage == "onebit one-row scale":
        arrays["embed.scale"] = np.zeros((1, 2), np.float32)
    elif breakage == "onebit short data":
        arrays["embed.data"] = arrays["embed.data"][:2]
    elif breakage == "int8 broadcast scale":
        arrays["embed.data"] = np.ones((1, 6), np.int8)
    elif breakage == "int8 nan scale":
        arrays["embed.scale"][0, 0] = np.nan
    elif breakage == "ids wrapping":
        arrays["embed.ids"] = np.array([0, 2_000_000_000, -2_000_000_000, 3, 4, 5], np.int32)
    else:
        arrays["embed.ids"] = arrays["embed.ids"].reshape(2, 3)
    ps = server()
    hello(ps, 0)
    kind, f, _ = ps.handle("t", "push", fields, arrays)
    assert (kind, f) == ("refused", {"reason": reason}) and ps.totals["refused_protocol"] == 1
    assert ps.version == 0 and not ps.params.any()


BIG = Layout([("W", (4096, 256)), ("b", (4096,))])


@pytest.mark.parametrize("codec", ["onebit", "int8"])
def test_decoding_allocates_no_more_than_the_slot_before_a_payload_is_refused(codec):
    """A few bytes of onebit data under a one-row scale unpacked to rows x the slot's size; a one-row int8
    payload broadcast against a column of scales to rows x rows. Shapes are checked against the layout first."""
    import tracemalloc
    cfg = config.load(None)
    ps = ParameterServer(BIG, np.zeros(BIG.size, np.float32), cfg.server, 3, 1, log=lambda *_: None)
    hello(ps, 0)
    fields = {"pid": 0, "lease": 1, "window": 0, "version": 0,
              "blocks": {"W": {"codec": codec, "scale": None}, "b": {"codec": "f32", "scale": 1.0}}}
    if codec == "onebit":          # 8 bytes of sign bits, one scale row: decoded as 8 x 1M values
        arrays = {"W.data": np.zeros((8, 1), np.uint8), "W.scale": np.ones((1, 2), np.float32)}
    else:                          # 2 KiB of int8 times 2048 scales: a 2048 x 2048 float32 product
        arrays = {"W.data": np.ones((1, 2048), np.int8), "W.scale": np.ones((2048, 1), np.float32)}
    arrays["b.data"] = np.zeros((4096, 1), np.float32)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        kind, f, _ = ps.handle("t", "push", fields, arrays)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak / 2 ** 20:.1f} MiB allocated to refuse a {codec} push"
    want = {"onebit": "W: onebit data must be a uint8[4096, 32] array",
            "int8": "W: int8 data must be a int8[4096, 256] array"}[codec]
    assert (kind, f) == ("refused", {"reason": want}) and ps.version == 0


@pytest.mark.parametrize("codec", ["f32", "fp16", "int8", "onebit"])
def test_a_row_block_selecting_no_rows_is_applied_as_no_change(codec):
    """Zero rows are zero onebit groups: its decoder divided by the group count."""
    fields, arrays = crafted(embed="rows" if codec == "f32" else f"rows+{codec}", feedback="true")
    data_shape, scale_shape = {"f32": ((0, 3), None), "fp16": ((0, 3), None), "int8": ((0, 3), (0, 1)),
                               "onebit": ((0, 1), (0, 2))}[codec]
    arrays["embed.ids"] = np.zeros(0, np.int32)
    arrays["embed.data"] = np.zeros(data_shape, arrays["embed.data"].dtype)
    if scale_shape:
        arrays["embed.scale"] = np.zeros(scale_shape, np.float32)
    ps = server()
    hello(ps, 0)
    kind, f, _ = ps.handle("t", "push", fields, arrays)
    assert kind == "pushed" and f["applied"] and ps.totals["refused_protocol"] == 0
    views = LAYOUT.views(ps.params)
    assert not views["embed"].any() and views["W1"].all()


def test_a_worker_whose_window_outlasts_the_servers_idle_limit_still_pushes():
    """The server closes a connection idle for server_idle_s; a worker replaces one idle for timeout_s itself
    before pushing, so a long window never loses its push to the idle limit."""
    from rnnlm.server.paramserver import server_idle_s
    # a heartbeat may wake up to 0.8 s late before its own connection counts as idle (a loaded machine)
    sv = config.load(None, ["server.heartbeat_s=0.2", "server.timeout_s=1"]).server
    ps = ParameterServer(LAYOUT, np.zeros(LAYOUT.size, np.float32), sv, 3, 2, log=lambda *_: None)
    secret = wire.new_secret()
    frames = wire.FrameServer(ps.handle, secret, timeout=sv.timeout_s, idle=server_idle_s(sv),
                              log=lambda *_: None).start()
    client = WorkerClient(frames.address, secret, 0, sv, LAYOUT)
    try:
        _, _, version, params = client.hello()
        time.sleep(2 * server_idle_s(sv))                    # a long window: the server closed the connection
        assert frames.closed_idle == 1                       # (the heartbeats' connection stays busy)
        blocks, _, _ = plan.encode(LAYOUT, np.ones(LAYOUT.size, np.float32), config.load(None).exchange,
                                   np.array([1]), 1, 1, 0, 2)
        assert client.push(0, version, blocks, params, tokens=5) == 1
        np.testing.assert_array_equal(params, ps.params)
        assert ps.done == [1, 0] and frames.refused == {} and frames.connections == 3
    finally:
        client.close()
        frames.close()


def test_drains_count_pulls_per_window_and_syncs_over_the_run():
    """Every push is answered with a pull (a refused duplicate too); ``syncs`` adds up the applied pushes
    of every drain so far, while the other counters restart at each drain."""
    ps = server(windows=3)
    hello(ps, 0)
    hello(ps, 1)
    one = np.ones(LAYOUT.size, np.float32)
    push(ps, 0, 1, 0, 0, one)
    push(ps, 1, 1, 0, 1, one)
    push(ps, 0, 1, 0, 2, one)                                  # a duplicate: not applied, still pulls
    d = ps.drain()
    assert (d["pushes"], d["pulls"], d["syncs"]) == (2, 3, 2)
    assert (d["tokens"], d["loss_sum"], d["steps"]) == (0, 0.0, 0)         # no statistics sent: none counted
    push(ps, 0, 1, 1, 2, one)
    d = ps.drain()
    assert (d["pushes"], d["pulls"], d["syncs"]) == (1, 1, 3)
    d = ps.drain()
    assert "pushes" not in d and "pulls" not in d and d["syncs"] == 3


@pytest.mark.parametrize("window, accepted", [(-1, False), (0, True), (2, True), (3, True), (4, False)])
def test_a_heartbeat_names_a_window_of_the_run_or_the_end_of_it(window, accepted):
    """[0, windows]: ``windows`` itself is what an attempt that found nothing left to train reports."""
    ps = server(windows=3)
    hello(ps, 0)
    kind, f, _ = ps.handle("t", "heartbeat", {"pid": 0, "lease": 1, "window": window}, {})
    if accepted:
        assert (kind, f) == ("ok", {}) and ps.started == [window, 0]
    else:
        assert (kind, f) == ("refused", {"reason": f"heartbeat: window {window} is not in [0, 3]"})


@pytest.mark.parametrize("length, accepted", [(0, False), (1, True), (2000, True), (2001, False)])
def test_a_failure_report_carries_1_to_2000_characters(length, accepted):
    ps = server()
    hello(ps, 0)
    kind, f, _ = ps.handle("t", "failed", {"pid": 0, "lease": 1, "error": "e" * length}, {})
    if accepted:
        assert kind == "ok" and ps.failures == [f"partition 0: {'e' * min(length, 300)}"]
    else:
        assert kind == "refused" and f["reason"].startswith("failed: the error must be a string of 1 to 2000")
        assert ps.failures == []


def test_hello_gives_the_version_every_push_below_it_has_landed_in():
    """Hogwild! lands pushes out of order: with claim 2 still being applied, a retried attempt starts from
    version 1 (its copy holds claim 1, not claim 2), so its first pull sends claim 2's rows."""
    ps = server()
    hello(ps, 0)
    hello(ps, 1)
    one = np.ones(LAYOUT.size, np.float32)
    push(ps, 0, 1, 0, 0, one)                                   # claim 1, landed
    applying, release = hold_first_apply(ps)
    th = threading.Thread(target=push, args=(ps, 1, 1, 0, 1, one * 2))   # claim 2, held mid-apply
    th.start()
    try:
        assert applying.wait(5)
        f, p = hello(ps, 0)
        assert f["version"] == 1 and f["window"] == 1
        np.testing.assert_array_equal(p, 1.0)
    finally:
        release.set()
        th.join(5)
    kind, r, a = push(ps, 0, 2, 1, f["version"], np.zeros(LAYOUT.size, np.float32))
    patch(LAYOUT, p, r["pulled"], a)
    assert r["version"] == 3
    np.testing.assert_array_equal(p, 3.0)
    np.testing.assert_array_equal(p, ps.params)


def test_windows_redone_counts_the_window_after_the_last_push_and_none_after_the_last_window():
    ps = server(windows=3)
    hello(ps, 0)
    one = np.ones(LAYOUT.size, np.float32)
    push(ps, 0, 1, 0, 0, one)
    push(ps, 0, 1, 1, 1, one)                                  # dies training window 2, before a heartbeat
    f, _ = hello(ps, 0)
    assert f["window"] == 2 and ps.totals["windows_redone"] == 1
    push(ps, 0, 2, 2, 2, one)                                  # finishes, then its task is retried anyway
    f, _ = hello(ps, 0)
    assert f["window"] == 3 and ps.totals["windows_redone"] == 1 and ps.totals["attempts_retried"] == 2


def test_wait_returns_as_soon_as_the_pushes_asked_for_have_landed():
    ps = server()
    hello(ps, 0)
    hello(ps, 1)
    push(ps, 0, 1, 0, 0, np.ones(LAYOUT.size, np.float32))
    push(ps, 1, 1, 0, 1, np.ones(LAYOUT.size, np.float32))
    t0 = time.monotonic()
    assert ps.wait(2, timeout=3.0) == 2 and time.monotonic() - t0 < 1.0
    assert ps.wait(3, timeout=0.2) == 2                         # and gives up after timeout


@pytest.mark.parametrize("update", ["add", "adagrad"])
def test_staleness_divides_a_row_blocks_change_and_adagrads_step(update):
    """A push computed two versions behind lands at a third of its weight: for row blocks under ``add``, and
    for AdaGrad's step (its accumulator takes the change itself)."""
    ps = server(staleness="divide", update=update, lr=0.5, eps=1e-6)
    hello(ps, 0)
    hello(ps, 1)
    one = np.ones(LAYOUT.size, np.float32)
    push(ps, 0, 1, 0, 0, one)
    push(ps, 0, 1, 1, 1, one)
    before = ps.params.copy()
    change = np.zeros(LAYOUT.size, np.float32)
    LAYOUT.views(change)["embed"][[1, 2]] = 3.0               # the rows read (push_msg's words 1 and 2)
    fields, arrays = push_msg(change, embed="rows")
    assert arrays["embed.ids"].tolist() == [1, 2]
    fields.update(pid=1, lease=1, window=0, version=0)
    assert ps.handle("t", "push", fields, arrays)[1]["applied"]
    assert ps.drain()["staleness"] == {0: 2, 2: 1}
    got = LAYOUT.views(ps.params - before)["embed"][[1, 2]]
    if update == "add":
        want = 3.0 / 3
    else:                                   # accumulator 1 + 1 + 9 = 11: lr / 3 * 3 / sqrt(11)
        want = 0.5 / 3 * 3.0 / (np.sqrt(11.0) + 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_snapshot_holds_new_pushes_back_until_it_is_taken_and_drains_only_when_asked():
    """While a snapshot waits for a push being applied, a push of another partition waits for the snapshot
    (else a steady stream of pushes could keep it waiting for ever); the snapshot holds exactly the first."""
    ps = server()
    hello(ps, 0)
    hello(ps, 1)
    one = np.ones(LAYOUT.size, np.float32)
    first, release = held_push(ps, 0, 0, 0, one)
    snaps = []
    taker = threading.Thread(target=lambda: snaps.append(ps.snapshot()))
    taker.start()
    end = time.monotonic() + 5
    while not ps._frozen and time.monotonic() < end:          # (until the snapshot waits for the first push)
        time.sleep(0.005)
    second = threading.Thread(target=push, args=(ps, 1, 1, 0, 0, one * 2))
    second.start()
    second.join(0.3)
    assert second.is_alive() and ps.version == 1             # held back: not even reserved
    release.set()
    for th in (first, taker, second):
        th.join(5)
    assert snaps[0]["done"] == [1, 0] and snaps[0]["version"] == 1 and snaps[0]["drained"] is None
    np.testing.assert_array_equal(snaps[0]["params"], 1.0)
    assert ps.done == [1, 1] and ps.drain()["pushes"] == 2      # snapshot() alone drained nothing


def test_a_push_of_every_row_fits_the_bound_the_driver_checks_max_frame_against():
    """Row codecs send an int32 id a row: a push of every row of a 20,000-word model is larger than the
    model plus the 64 KiB that the async driver's start-up check once allowed (a max_frame_mb between
    the two passed it, and every such push was then refused by the wire)."""
    import json
    V, H = 20_000, 8
    layout = Layout([("embed", (V, H)), ("Wo", (V, H)), ("bo", (V,))])
    ex = config.load(None, ["exchange.embed=rows", "exchange.softmax=rows"]).exchange
    blocks, _, _ = plan.encode(layout, np.ones(layout.size, np.float32), ex, np.arange(V), 1, 1, 0, 1)
    fields, arrays = blocks_to_wire(blocks)
    body = sum(a.nbytes for a in arrays.values()) + len(json.dumps(fields))
    assert 4 * layout.size + (1 << 16) < body <= paramserver.max_push_bytes(layout, 4)
    assert paramserver.server_in_flight(layout, 4, 2, 1 << 30) == 3 * paramserver.max_push_bytes(layout, 4)
