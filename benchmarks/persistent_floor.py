"""What a round would cost without a Spark job per round: the floor of persistent round tasks.

    python benchmarks/persistent_floor.py [--masters "local[2];local-cluster[2,1,2048]"] [--rounds 12]

Today every round is a Spark job: its tasks are scheduled and shipped, read the round's
broadcasts, and their contributions come back through Spark or the direct channel. Here one job's
2 tasks loop over the rounds, as the asynchronous mode's workers do, with the sparse preset's
payloads on PTB small and tasks that sleep 0.3 s instead of training:

* a task pulls the round's message from the driver over :mod:`rnnlm.server.wire` (the preset's
  int8 delta, 4.7 MB) and adds it to its view (:func:`rnnlm.exchange.rebase.apply_delta`);
* sleeps; sends its contribution (the preset's 1-bit blocks of a random change,
  :func:`rnnlm.exchange.plan.encode`, checked on arrival by :mod:`rnnlm.exchange.frames`);
* the driver merges the round's contributions in partition order (float64), applies their mean,
  and encodes the next round's delta.

Beside it, in the same Spark context, ``job per round``: a job of 2 tasks that only sleep (Spark's
floor for a round, ``nothing`` in ``benchmarks/carry_cost.py``), which a round of the trainer pays
before any of its payloads. Printed per master: seconds per round beyond the sleep, median of rounds
3..N. A measurement of what the execution model would save, not a trainer: no failure handling.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SLEEP, P, MAX_FRAME = 0.3, 2, 64 << 20


def preset():
    from rnnlm import config
    from rnnlm.core.models import build
    cfg = config.resolve(config.load(os.path.join(ROOT, "conf/ptb_word_small_sparse.toml")), 10000)
    return cfg, build(cfg.model).layout


def message(layout, delta_blocks) -> tuple:
    from rnnlm.exchange.frames import block_to_wire
    meta, arrays = {}, {}
    for name, b in delta_blocks.items():
        meta[name], more = block_to_wire(name, b)
        arrays.update(more)
    return {"blocks": meta}, arrays


def worker(host, port, secret, rounds):
    def go(it):
        from rnnlm.exchange import plan
        from rnnlm.exchange.aggregate import Aggregate
        from rnnlm.exchange.frames import block_from_wire, contribution_to_wire
        from rnnlm.exchange.rebase import apply_delta
        from rnnlm.exchange.round import Carry
        from rnnlm.server import wire
        cfg, layout = preset()
        for pid in it:
            rng = np.random.default_rng(pid)
            words = np.unique(rng.integers(0, 10000, 3000)).astype(np.int32)
            change = (rng.normal(size=layout.size) * 1e-3).astype(np.float32)
            blocks, _, _ = plan.encode(layout, change, cfg.exchange, words, 1, 1, pid, P, np.zeros_like(change))
            agg = Aggregate.contribution(8000.0, blocks, {pid: Carry()}, words=words, tokens=8000, steps=20)
            fields, arrays = contribution_to_wire(pid, agg)
            view = np.zeros(layout.size, np.float32)
            client = wire.Client(host, port, secret, MAX_FRAME, timeout=60.0)
            slots = {s.name: s for s in layout}
            for r in range(1, rounds + 1):
                _, f, a = client.call("pull", {"round": r})
                apply_delta(layout, view, {n: block_from_wire(n, slots[n].shape, m, a)
                                           for n, m in f["blocks"].items()})
                time.sleep(SLEEP)
                client.call("push", dict(fields, round=r), arrays)
            client.close()
            yield pid
    return go


class Driver:
    """The rounds' driver: publishes each round's message, takes the contributions, merges, encodes."""

    def __init__(self, layout, expect):
        self.layout, self.expect = layout, expect
        self.cond, self.published, self.msg, self.boxes = threading.Condition(), 0, None, {}

    def handle(self, peer, kind, fields, arrays):
        from rnnlm.exchange.frames import contribution_from_wire
        r = fields.get("round")
        if kind == "pull":
            with self.cond:
                self.cond.wait_for(lambda: self.published >= r, timeout=60)
                f, a = self.msg
            return "msg", f, a
        pid, leaf = contribution_from_wire(fields, arrays, self.expect)
        with self.cond:
            self.boxes[r].put(pid, leaf)
            self.cond.notify_all()
        return "taken", {}, {}

    def run(self, rounds) -> list:
        from rnnlm.exchange import plan
        from rnnlm.exchange.rebase import apply_delta, delta_blocks
        from rnnlm.spark.channel import Inbox
        rng = np.random.default_rng(0)
        params = rng.normal(size=self.layout.size).astype(np.float32) * 0.1
        view = np.zeros_like(params)
        times, t_prev, self.sent = [], None, []
        for r in range(1, rounds + 1):
            blocks = delta_blocks(self.layout, params - view, "int8")        # the next round's broadcast
            apply_delta(self.layout, view, blocks)
            box = Inbox(P)
            msg = message(self.layout, blocks)
            self.sent.append(sum(a.nbytes for a in msg[1].values()))
            with self.cond:
                self.boxes[r], self.msg, self.published = box, msg, r
                self.cond.notify_all()
            now = time.perf_counter()
            if t_prev is not None:
                times.append(now - t_prev - SLEEP)
            t_prev = now
            with self.cond:
                self.cond.wait_for(lambda: not box.missing, timeout=120)
            box.drain()
            params = params + plan.mean_change(self.layout, box.agg, np.float32)
            del self.boxes[r]
        return times


def measure(master: str, rounds: int) -> dict:
    from rnnlm.exchange.frames import Expected
    from rnnlm.exchange.plan import PARAMS
    from rnnlm.server import wire
    from rnnlm.spark import session
    spark = session.get_spark("rnnlm-persistent-floor", master, {"spark.ui.enabled": "false"})
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    _, layout = preset()
    expect = Expected({PARAMS + s.name: tuple(s.shape) for s in layout}, P, 10000, None, None, layout.size)
    driver = Driver(layout, expect)
    secret = wire.new_secret()
    server = wire.FrameServer(driver.handle, secret, "127.0.0.1", 0, MAX_FRAME, timeout=60.0).start()
    data = sc.parallelize(range(P), P).cache()
    data.count()
    job = threading.Thread(target=lambda: data.mapPartitions(worker(*server.address, secret, rounds)).count())
    job.start()
    persistent = driver.run(rounds)
    job.join()
    server.close()
    per_job = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        data.map(lambda x: time.sleep(SLEEP)).count()
        per_job.append(time.perf_counter() - t0 - SLEEP)
    spark.stop()
    return {"persistent": statistics.median(persistent[1:]), "job per round": statistics.median(per_job[2:]),
            "message MB": statistics.median(driver.sent[2:]) / 1e6}


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        r = measure(sys.argv[2], int(sys.argv[3]))
        print(" ".join(f"{k}={v:.4f}" for k, v in r.items()))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--masters", default="local[2];local-cluster[2,1,2048]")
    ap.add_argument("--rounds", type=int, default=12)
    a = ap.parse_args(argv)
    print("# seconds per round beyond a 0.3 s sleep, median of rounds 3..N; 2 partitions, the sparse preset's payloads")
    for master in a.masters.split(";"):
        env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
        out = subprocess.run([sys.executable, __file__, "--child", master, str(a.rounds)], env=env, cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        print(f"{master:26s} {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
