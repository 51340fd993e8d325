"""Does adding executors buy time? Tokens and rounds to target validation perplexities at P partitions.

    python benchmarks/scaling.py [--preset dense,sparse] [--partitions 1,2,4,8,16] [--rules preset,auto]
                                 [--epochs 2] [--evals 8] [--targets 200,150] [--out runs/scaling]
                                 [--rule NAME=section.key=value,...] [--set section.key=value ...]

Every (preset, rule, P) is one ``jobs/train.py`` run in its own process (``local[2]``: how many
cores run the partitions changes when, never what, so ``local[2]`` runs P = 16 as a cluster of 16
executors would compute it), on the same data and seed, evaluating the validation text ``--evals``
times. ``preset`` averages the partitions' weights (``train.outer = "average"``, the presets' step when
the rule was named; they now set ``auto``); ``auto`` lets
``train.outer = "auto"`` choose it from ``data.partitions`` (:func:`rnnlm.config.outer_for`);
``--rule`` adds others. Runs already finished in ``--out`` are read, not run again (``--report``:
only those).

Printed per run: the valid ppl at each evaluation, the tokens and rounds to each target (linear
in log ppl between the evaluations around it), their ratio to P = 2's, and the time to the last target
projected for one executor per core: rounds x (compute + the sync of
:func:`rnnlm.spark.linkcost.predict` for the round's measured bytes at 1 and 10 Gbit/s). Compute and
the sync's fixed overhead (scheduling, the driver's own work) are P = 2's, measured with a core per
partition (``--round-s`` gives figures measured alone), the compute scaled by the tokens a partition
trains per round: with more partitions than cores ``local[2]`` runs tasks in waves, so its own round
times at P > 2 say nothing about a cluster's. The scaling is linear in tokens, though a step costs
more per token at fewer streams (ptb-small on one thread: 1.19x at 10 streams, 1.34x at 5, against 20):
projections for partitions of fewer streams than P = 2's are optimistic by that much on their compute.

A rule with ``train.mode=async`` runs on ``local[P]``, a task slot per partition: P workers push to
the server at once, as P executors would, so its pushes' staleness (versions between a worker's pull
and its push: mean, 90th percentile, max) is what P workers make; its tokens are compared with the
same rule's at P = 2, and nothing is projected (it has no rounds).
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rnnlm import config  # noqa: E402
from rnnlm.spark.linkcost import predict  # noqa: E402

PRESETS = {"dense": "conf/ptb_word_small.toml", "sparse": "conf/ptb_word_small_sparse.toml"}
RULES = {"preset": ["train.outer=average"], "auto": ["train.outer=auto"]}
LINKS = {"1gbit": 1e9, "10gbit": 10e9}


@functools.lru_cache(maxsize=None)
def corpus_tokens(path: str) -> int:
    """Training tokens of a word-level corpus read line by line (an end-of-sentence token per line)."""
    with open(path, encoding="utf-8") as f:
        return sum(len(line.split()) + 1 for line in f)


def run(preset: str, sets: list, out: str, epochs: float, evals: int, data: str, partitions: int) -> list:
    conf = os.path.join(ROOT, PRESETS[preset])
    sets = [f"data.partitions={partitions}", *sets]
    c = config.load(conf, sets)
    asynchronous = c.train.mode == "async"
    steps = c.train.push_every if asynchronous else c.train.local_steps
    per_round = partitions * c.train.batch * steps * c.train.bptt
    rounds = math.ceil(epochs * corpus_tokens(os.path.join(data, "ptb.train.txt")) / per_round)
    args = [f"train.epochs={epochs}", "train.checkpoint_every=0",
            "train.checkpoint_s=0", f"train.eval_every={max(1, round(rounds / evals))}",
            f"data.train={data}/ptb.train.txt", f"data.valid={data}/ptb.valid.txt", "data.test=", *sets]
    # async: a task slot per partition, so P workers push at once and staleness grows with P as on a cluster
    cmd = [sys.executable, "jobs/train.py", "--config", conf, "--out", out, "--samples", "0",
           "--master", f"local[{partitions if asynchronous else 2}]"]
    cmd += [a for s in args for a in ("--set", s)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{out} failed: {(r.stderr.strip().splitlines() or [''])[-1]}")
    return read(out)


def read(out: str) -> list:
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(x) for x in f]


def reach(evals: list, target: float, key: str) -> float | None:
    """``key`` (tokens or round) where the valid ppl first reaches ``target``, linear in log ppl
    between the evaluations around it; None when no evaluation reached it."""
    prev = None
    for m in evals:
        if m["valid_ppl"] <= target:
            if prev is None:
                return float(m[key])
            a, b = math.log(prev["valid_ppl"]), math.log(m["valid_ppl"])
            f = (a - math.log(target)) / (a - b)
            return prev[key] + f * (m[key] - prev[key])
        prev = m
    return None


def rates(lines: list) -> dict:
    """Median per-round figures after round 1 (which starts the executors' Python); for the
    asynchronous mode, its pushes' staleness (versions applied between a worker's pull and its push)."""
    if "compute_s" not in lines[-1]:
        seen = collections.Counter()
        for m in lines:
            seen.update({int(k): v for k, v in m.get("staleness", {}).items()})
        n = sum(seen.values()) or 1
        order = sorted(seen.elements())
        return {"staleness_mean": round(sum(k * v for k, v in seen.items()) / n, 2),
                "staleness_p90": order[int(0.9 * (len(order) - 1))] if order else None,
                "staleness_max": max(seen, default=None)}
    later = lines[1:] or lines
    return {"compute_s": statistics.median(m["compute_s"] for m in later),
            "overhead_s": statistics.median(max(0.0, m["round_s"] - m["compute_s"]) for m in later),
            "sent": statistics.median(m["round_bytes_sent"] for m in later),
            "broadcast": statistics.median(m["round_bytes_broadcast"] for m in later)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="dense,sparse")
    ap.add_argument("--partitions", default="1,2,4,8,16")
    ap.add_argument("--rules", default="preset,auto")
    ap.add_argument("--rule", action="append", default=[], metavar="NAME=SECTION.KEY=VALUE,...",
                    help="another rule to compare, by its settings")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--evals", type=int, default=8)
    ap.add_argument("--targets", default="200,150")
    ap.add_argument("--data", default=os.path.join(ROOT, "data"))
    ap.add_argument("--out", default="runs/scaling")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--round-s", default=None, metavar="COMPUTE,OVERHEAD",
                    help="P = 2's compute and overhead per round in seconds, measured alone (default: the runs')")
    ap.add_argument("--report", action="store_true", help="only the runs already in --out (train nothing)")
    a = ap.parse_args(argv)
    rules = dict(RULES)
    for r in a.rule:
        name, _, sets = r.partition("=")
        rules[name] = [s for s in sets.split(",") if s]
    targets = [float(t) for t in a.targets.split(",")]
    table = []
    for preset in a.preset.split(","):
        for rule in a.rules.split(","):
            for P in (int(p) for p in a.partitions.split(",")):
                out = os.path.join(a.out, f"{preset}-{rule}-p{P}")
                done = os.path.exists(os.path.join(out, "metrics.jsonl"))
                if a.report and not done:
                    continue
                lines = read(out) if done else run(preset, rules[rule] + a.set, out, a.epochs, a.evals, a.data, P)
                evals = [m for m in lines if "valid_ppl" in m]
                row = {"preset": preset, "rule": rule, "P": P, "tokens": lines[-1]["tokens"],
                       "rounds": lines[-1]["round"], "valid": [(m["tokens"], round(m["valid_ppl"], 1)) for m in evals],
                       **rates(lines)}
                if a.round_s and "compute_s" in row:
                    row["compute_s"], row["overhead_s"] = map(float, a.round_s.split(","))
                for t in targets:
                    row[f"tokens@{t:g}"] = reach(evals, t, "tokens")
                    row[f"rounds@{t:g}"] = reach(evals, t, "round")
                table.append(row)
                print(json.dumps(row), flush=True)
    _report(table, targets)
    return 0


def _report(table: list, targets: list) -> None:
    """A markdown table: per target, tokens (their ratio to the preset's at P = 2) and the projected
    time at 10 and 1 Gbit/s (P = 2's over it: how much faster)."""
    def ref_of(row):
        if "staleness_mean" in row:         # async: against the same mode at P = 2
            return next((r for r in table if r["preset"] == row["preset"] and r["P"] == 2 and r["rule"] == row["rule"]),
                        None)
        return next((r for r in table if r["preset"] == row["preset"] and r["P"] == 2 and r["rule"] == "preset"),
                    next((r for r in table if r["preset"] == row["preset"] and r["P"] == 2), None))

    cols = [f"tokens to {t:g}" for t in targets] + [f"s to {t:g} at {k}" for t in targets for k in LINKS]
    print("\n| preset | rule | P | final valid ppl | " + " | ".join(cols) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(cols))
    for row in table:
        ref, cells = ref_of(row), []
        for t in targets:
            v, r2 = row[f"tokens@{t:g}"], ref and ref[f"tokens@{t:g}"]
            cells.append("not reached" if v is None else f"{v:,.0f}" + (f" ({v / r2:.2f}x)" if r2 else ""))
        for t in targets:
            for bps in LINKS.values():
                v, r2 = projected(row, ref, t, bps), ref and projected(ref, ref, t, bps)
                cells.append("-" if v is None else f"{v:,.0f}" + (f" ({r2 / v:.2f}x faster)" if r2 else ""))
        final = row["valid"][-1][1] if row["valid"] else "-"
        rule = row["rule"] + (f" (staleness mean {row['staleness_mean']}, p90 {row['staleness_p90']}, max "
                              f"{row['staleness_max']})" if "staleness_mean" in row else "")
        print(f"| {row['preset']} | {rule} | {row['P']} | {final} | " + " | ".join(cells) + " |")


def projected(row: dict, ref: dict | None, target: float, bits_per_s: float) -> float | None:
    """Seconds to ``target`` with one executor per partition (see the module's docstring)."""
    rounds = row[f"rounds@{target:g}"]
    if rounds is None or "compute_s" not in row:      # async: no rounds to project
        return None
    ref = ref or row
    # a partition's compute per round: P = 2's, per token it trains in a round (what local[2] measures
    # at P > 2 waits for cores a cluster would not share)
    per_partition = row["tokens"] / row["rounds"] / row["P"]
    compute = ref["compute_s"] * per_partition / (ref["tokens"] / ref["rounds"] / ref["P"])
    sync = predict(row["sent"], row["broadcast"], row["P"], bits_per_s, overhead_s=ref["overhead_s"])["sync_s"]
    return rounds * (compute + sync)


if __name__ == "__main__":
    sys.exit(main())
