"""What the exchange buys in wall time on real links: PTB small on a Spark standalone cluster
whose executors each have a host of their own (rnnlm.netcluster), links shaped to each bandwidth.

    python benchmarks/links.py [--partitions 2,4] [--bandwidths 10gbit,1gbit,100mbit]
                               [--exchanges dense10,dense20,sparse,async] [--rounds 4]
                               (also dense20+ov, sparse+ov: with train.overlap = 1; sparse+eager;
                               dense20+direct: train.results = "direct")
                               [--converge 4] [--target-ppl 400] [--bytes-at 8] [--out runs/links.json]
    python benchmarks/links.py --plot runs/links.json [more.json ...]   # table and figure from saved runs

Per P (a cluster of P+1 hosts: the driver and master on host 0, one 1-core worker per other host)
and exchange, one driver process (in host 0) loads the corpus once, runs the dry run's probe
(four rounds, link unshaped: the per-round overhead and the bytes the prediction uses), then at
each bandwidth trains ``--rounds`` fresh rounds (round 1 excluded from medians: it broadcasts
the whole model and warms the executors). Reported per cell: round_s, compute_s (the slowest
task), sync fraction (1 - compute/round), tokens/s, bytes per round each way through the
driver's link (its own counters) and as the metrics count them, and the dry run's predicted
sync time with its error. ``async`` (the sparse preset's exchange pushed every 20 steps to the
driver's parameter server, staleness-aware) reports tokens/s and bytes per push instead.

Time to a validation perplexity (``--converge P``): one run per synchronous exchange on the
unshaped link, evaluating every few rounds, gives the round that first reaches ``--target-ppl``;
a synchronous run's numbers do not depend on the link (same seed, same numbers), so its time at
a bandwidth is that many rounds at the round time measured there (evaluation not counted).

The machine has 2 cores: P executors, the driver and Spark's daemons share them, so compute_s
at P=4 is about twice a dedicated core's; the bytes and the link times are what a cluster pays.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
SMALL, SPARSE = "conf/ptb_word_small.toml", "conf/ptb_word_small_sparse.toml"
EXCHANGES = {
    # through Spark's results, as measured before the preset sent them straight to the driver
    "dense10": (SMALL, ["train.results=spark"]),
    "dense20": (SMALL, ["train.local_steps=20", "train.results=spark"]),
    "dense20+direct": (SMALL, ["train.local_steps=20", "train.results=direct"]),     # the preset's setting
    "sparse": (SPARSE, []),
    # train.overlap = 1: the next round computes while this one's result travels and is applied
    "dense20+ov": (SMALL, ["train.local_steps=20", "train.overlap=1", "train.results=spark"]),
    "sparse+ov": (SPARSE, ["train.overlap=1"]),
    "sparse+eager": (SPARSE, ["train.overlap=1", "train.eager=true"]),     # Kale et al.'s eager updates
    "async": (SPARSE, ["train.mode=async", "exchange.broadcast=rows", "train.push_every=20",
                       "server.staleness=divide"]),
}


def settings(name: str, partitions: int, data: str) -> tuple:
    conf, extra = EXCHANGES[name]
    return conf, [f"data.train={data}/ptb.train.txt", f"data.valid={data}/ptb.valid.txt", "data.test=",
                  f"data.partitions={partitions}", f"data.eval_streams={partitions}", "train.checkpoint_every=0",
                  "train.checkpoint_s=0",
                  *extra]


def link_counters() -> tuple:
    """(bytes sent, bytes received) on this host's link (the child runs in the driver's namespace)."""
    base = "/sys/class/net/eth0/statistics"
    with open(f"{base}/tx_bytes") as t, open(f"{base}/rx_bytes") as r:
        return int(t.read()), int(r.read())


class Reached(Exception):
    """The convergence run reached its target."""


class Meter:
    """Receives each metrics line (the trainer's ``progress``) with the link's counters at that moment."""

    def __init__(self, target: float | None = None):
        self.lines, self.start, self.target = [], link_counters(), target

    def update(self, m, total, line):
        self.lines.append(dict(m, link=link_counters()))
        if self.target is not None and m.get("valid_ppl", float("inf")) <= self.target:
            raise Reached()

    def message(self, text):
        pass


def child(spec: dict) -> list:
    """In host 0: one exchange at every bandwidth, on one corpus load."""
    from rnnlm import config
    from rnnlm.cli import make_trainer
    from rnnlm.netcluster import NetCluster
    from rnnlm.spark import session
    from rnnlm.spark.dryrun import measured, probe
    from rnnlm.spark.corpus import load_corpus
    P, name = spec["partitions"], spec["exchange"]
    links = NetCluster.attach(spec["tag"], spec["hosts"])
    spark = session.get_spark("rnnlm-links", spec["master"], {
        "spark.driver.host": spec["driver"], "spark.driver.bindAddress": spec["driver"],
        "spark.executor.cores": "1", "spark.cores.max": str(P), "spark.executor.memory": "1500m",
        "spark.driver.memory": "2g", "spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    conf, sets = settings(name, P, spec["data"])
    base = config.load(os.path.join(ROOT, conf), sets)
    sync = base.train.mode == "sync"
    data = load_corpus(spark.sparkContext, base)
    base = config.resolve(base, len(data.vocab))
    rows = []
    if spec.get("converge"):
        links.shape(None)
        every = 4 if base.train.local_steps <= 10 else 2
        cfg = config.replace(base, "train", rounds=spec["max_rounds"], eval_every=every)
        with tempfile.TemporaryDirectory() as out:
            meter = Meter(spec["target"])
            try:
                make_trainer(spark, cfg, f"file://{out}", log=lambda s: None, progress=meter).run(data=data)
            except Reached:
                pass
        evals = [(m["round"], m["valid_ppl"], m["tokens"]) for m in meter.lines if "valid_ppl" in m]
        hit = next((e for e in evals if e[1] <= spec["target"]), None)
        rows.append({"partitions": P, "exchange": name, "converge": True, "target_ppl": spec["target"],
                     "rounds_to_target": hit[0] if hit else None, "tokens_to_target": hit[2] if hit else None,
                     "evals": evals})
        spark.stop()
        return rows
    est = None
    if sync:
        links.shape(None)
        est = measured(probe(spark, base, data), P, _params(base))
    quiet = dataclasses.replace(data, valid=None, test=None)
    for bw in spec["bandwidths"]:
        links.shape(bw)
        if sync:
            cfg = config.replace(base, "train", rounds=spec["rounds"], eval_every=0)
        else:   # async: a fixed number of push windows per worker (3 x --rounds), no evaluation
            cfg = config.replace(base, "train", epochs=3 * spec["rounds"] * P * base.train.push_every
                                 * base.train.batch * base.train.bptt / data.scored.epoch, eval_every=0)
        with tempfile.TemporaryDirectory() as out:
            meter = Meter()
            make_trainer(spark, cfg, f"file://{out}", log=lambda s: None, progress=meter).run(data=quiet)
        ls = meter.lines
        row = {"partitions": P, "exchange": name, "bandwidth": bw}
        if sync:
            ms = ls[1:]
            prev = [ls[0]] + ls[1:-1]
            row.update(
                round_s=statistics.median(m["round_s"] for m in ms),
                compute_s=statistics.median(m["compute_s"] for m in ms),
                sync_fraction=statistics.median(1 - m["compute_s"] / m["round_s"] for m in ms),
                tokens_per_s=sum(m["tokens"] - p["tokens"] for p, m in zip(prev, ms)) / sum(m["round_s"] for m in ms),
                sent=statistics.median(m["round_bytes_sent"] for m in ms),
                broadcast=statistics.median(m["round_bytes_broadcast"] for m in ms),
                driver_out=statistics.median(m["link"][0] - p["link"][0] for p, m in zip(prev, ms)),
                driver_in=statistics.median(m["link"][1] - p["link"][1] for p, m in zip(prev, ms)))
            row["sync_s"] = row["round_s"] - row["compute_s"]
            row["probe"] = est
        else:
            last = ls[-1]
            wall = last["wall_s"]
            pushes = max(1, last["syncs"])        # the server's version: pushes applied
            row.update(tokens_per_s=last["tokens"] / wall, pushes=pushes, wall_s=wall,
                       sent=last["bytes_sent"] / pushes, broadcast=last["bytes_broadcast"] / pushes,
                       driver_out=(last["link"][0] - meter.start[0]) / pushes,
                       driver_in=(last["link"][1] - meter.start[1]) / pushes)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "probe"}), file=sys.stderr, flush=True)
    spark.stop()
    return rows


def _params(cfg) -> int:
    from rnnlm.core.models import build
    return build(cfg.model).layout.size


def bytes_at(partitions: int, exchanges: list, data: str) -> list:
    """Exact bytes per round at ``partitions`` (local[2]: the bytes do not depend on where tasks run)."""
    from rnnlm import config
    from rnnlm.spark import session
    from rnnlm.spark.dryrun import measured, probe
    from rnnlm.spark.corpus import load_corpus, unpersist_corpus
    spark = session.get_spark("rnnlm-links-bytes", "local[2]", {"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    rows = []
    for name in exchanges:
        conf, sets = settings(name, partitions, data)
        cfg = config.load(os.path.join(ROOT, conf), sets)
        if cfg.train.mode != "sync":
            continue
        d = load_corpus(spark.sparkContext, cfg)
        cfg = config.resolve(cfg, len(d.vocab))
        est = measured(probe(spark, cfg, d, rounds=3), partitions, _params(cfg))
        rows.append({"partitions": partitions, "exchange": name, "bytes_only": True,
                     "sent": est["sent"], "broadcast": est["broadcast"]})
        unpersist_corpus(d)
    spark.stop()
    return rows


def run_child(cluster, spec: dict) -> list:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = dict(os.environ, SPARK_LOCAL_IP=cluster.address(0))
    env.pop("PYSPARK_GATEWAY_PORT", None)
    cmd = cluster.command(0, [sys.executable, __file__, "--child", json.dumps(spec), path])
    log = os.path.join(os.path.dirname(os.path.abspath(path)), f"links-P{spec['partitions']}-{spec['exchange']}.log")
    with open(log, "a") as err:     # Spark's executors log their shutdown at length; kept out of the table
        r = subprocess.run(cmd, cwd=ROOT, env=env, timeout=3600, stderr=err)
    if r.returncode != 0:
        raise SystemExit(f"links: {spec['exchange']} at P={spec['partitions']} failed (exit {r.returncode}; {log})")
    with open(path) as f:
        rows = json.load(f)
    os.remove(path)
    return rows


def predicted(r: dict) -> float:
    """The dry run's sync time for a cell, from the probe it ran on the unshaped link."""
    from rnnlm.spark.linkcost import parse_rate, predict
    e = r["probe"]
    return predict(e["sent"], e["broadcast"], r["partitions"], parse_rate(r["bandwidth"]),
                   overhead_s=e["overhead_s"])["sync_s"]


def table(rows: list) -> str:
    out = ["| P | bandwidth | exchange | round s | compute s | sync fraction | tokens/s | MB in / out of "
           "the driver's link per round | metrics: sent / broadcast MB | predicted sync s (error) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("converge") or r.get("bytes_only"):
            continue
        if "round_s" in r:
            err = predicted(r) / r["sync_s"] - 1
            out.append(f"| {r['partitions']} | {r['bandwidth']} | {r['exchange']} | {r['round_s']:.2f} | "
                       f"{r['compute_s']:.2f} | {r['sync_fraction']:.1%} | {r['tokens_per_s']:,.0f} | "
                       f"{r['driver_in'] / 1e6:.2f} / {r['driver_out'] / 1e6:.2f} | {r['sent'] / 1e6:.2f} / "
                       f"{r['broadcast'] / 1e6:.2f} | {predicted(r):.2f} ({err:+.0%}) |")
        else:
            out.append(f"| {r['partitions']} | {r['bandwidth']} | {r['exchange']} (per push) | | | | "
                       f"{r['tokens_per_s']:,.0f} | {r['driver_in'] / 1e6:.2f} / {r['driver_out'] / 1e6:.2f} | "
                       f"{r['sent'] / 1e6:.2f} / {r['broadcast'] / 1e6:.2f} | |")
    return "\n".join(out)


def time_to_target(rows: list) -> list:
    """Per P, bandwidth and synchronous exchange: rounds to the target at that bandwidth's round time."""
    conv = {(r["partitions"], r["exchange"]): r for r in rows if r.get("converge")}
    out = []
    for r in rows:
        c = conv.get((r["partitions"], r["exchange"]))
        if "round_s" in r and c and c["rounds_to_target"]:
            out.append({"partitions": r["partitions"], "bandwidth": r["bandwidth"], "exchange": r["exchange"],
                        "rounds": c["rounds_to_target"], "seconds": c["rounds_to_target"] * r["round_s"]})
    return out


def plot(rows: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    Ps = sorted({r["partitions"] for r in rows if "bandwidth" in r})
    fig, axes = plt.subplots(2, len(Ps), figsize=(5 * len(Ps), 7), squeeze=False)
    for j, P in enumerate(Ps):
        for ex in EXCHANGES:
            pts = [r for r in rows if r.get("partitions") == P and r.get("exchange") == ex and "bandwidth" in r]
            pts.sort(key=lambda r: _bits(r["bandwidth"]))
            if not pts:
                continue
            x = [_bits(r["bandwidth"]) / 1e9 for r in pts]
            if "sync_fraction" in pts[0]:
                axes[0][j].plot(x, [r["sync_fraction"] for r in pts], "o-", label=ex)
            axes[1][j].plot(x, [r["tokens_per_s"] for r in pts], "o-", label=ex)
        axes[0][j].set_title(f"P = {P} executors, one host each")
        axes[0][j].set_ylabel("sync fraction of a round")
        axes[1][j].set_ylabel("training tokens/s")
        for ax in axes[:, j]:
            ax.set_xscale("log")
            ax.set_xlabel("bandwidth of every host's link (Gbit/s)")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _bits(bw: str) -> float:
    from rnnlm.spark.linkcost import parse_rate
    return parse_rate(bw)


def summary(rows: list) -> str:
    cells = [r for r in rows if "round_s" in r or (r.get("exchange") == "async" and "bandwidth" in r)]
    pick = [r for r in cells if r["partitions"] == max(c["partitions"] for c in cells)]
    parts = []
    for bw in sorted({r["bandwidth"] for r in pick}, key=_bits):
        f = {r["exchange"]: r for r in pick if r["bandwidth"] == bw}
        syncs = " ".join(f"{k}_sync={v['sync_fraction']:.2f}" for k, v in f.items() if "sync_fraction" in v)
        toks = " ".join(f"{k}_tok/s={v['tokens_per_s']:.0f}" for k, v in f.items())
        parts.append(f"{bw} P={pick[0]['partitions']} {syncs} {toks}")
    errs = [abs(predicted(r) / r["sync_s"] - 1) for r in cells if "probe" in r]
    return "links: " + " | ".join(parts) + (f" | dry-run max error {max(errs):.0%}" if errs else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--partitions", default="2,4")
    ap.add_argument("--bandwidths", default="10gbit,1gbit,100mbit")
    ap.add_argument("--exchanges", default="dense10,dense20,sparse,async")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per cell (the first is not counted)")
    ap.add_argument("--converge", default="", help="partition counts at which to measure rounds to --target-ppl")
    ap.add_argument("--target-ppl", type=float, default=400.0)
    ap.add_argument("--max-rounds", type=int, default=80, help="the convergence runs' length")
    ap.add_argument("--bytes-at", default="8", help="partition counts whose bytes per round are measured only")
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--out", default="runs/links.json")
    ap.add_argument("--figure", default="docs/figures/links.png")
    ap.add_argument("--plot", nargs="+", default=None,
                    help="only print the table and draw the figure from these saved runs (their rows in one list)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        rows = child(json.loads(a.child[0]))
        with open(a.child[1], "w") as f:
            json.dump(rows, f)
        return 0
    if a.plot:
        rows = []
        for name in a.plot:
            with open(name) as f:
                rows += json.load(f)
    else:
        from rnnlm.netcluster import NetCluster, unavailable
        problem = unavailable()
        if problem:
            print(f"links: {problem}", file=sys.stderr)
            return 2
        rows = []
        exchanges = a.exchanges.split(",")
        converge = {int(p) for p in a.converge.split(",") if p}
        for P in [int(p) for p in a.partitions.split(",")]:
            with NetCluster(P + 1) as c:
                url = c.spark_standalone(cores=1, memory="1800m")
                common = {"partitions": P, "tag": c.tag, "hosts": c.hosts, "master": url, "driver": c.address(0),
                          "data": a.data, "rounds": a.rounds, "bandwidths": a.bandwidths.split(",")}
                for ex in exchanges:
                    rows += run_child(c, dict(common, exchange=ex))
                    if P in converge and ex != "async":
                        rows += run_child(c, dict(common, exchange=ex, converge=True, target=a.target_ppl,
                                                  max_rounds=a.max_rounds))
                    _save(a.out, rows)
        for P in [int(p) for p in a.bytes_at.split(",") if p]:
            rows += bytes_at(P, [e for e in exchanges if e != "async"], a.data)
        _save(a.out, rows)
    print(table(rows))
    for r in time_to_target(rows):
        print(f"P={r['partitions']} {r['bandwidth']} {r['exchange']}: {r['rounds']} rounds to the target ppl, "
              f"{r['seconds']:.0f} s")
    for r in rows:
        if r.get("bytes_only"):
            print(f"P={r['partitions']} {r['exchange']}: sent {r['sent'] / 1e6:.2f} MB, broadcast "
                  f"{r['broadcast'] / 1e6:.2f} MB per round")
    if a.figure:
        plot(rows, os.path.join(ROOT, a.figure))
    print(summary(rows))
    return 0


def _save(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
