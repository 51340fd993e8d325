"""Tai and Xu's (2014) Figure 4 on Spark: 3 async workers, 2 killed mid-run, against 3 and 1 undisturbed.

    python benchmarks/worker_failure.py [--epochs 1] [--kill-at 0.4] [--out runs/worker_failure]
                                        [--figure 4|3] [--set section.key=value ...]

conf/nnlm_async.toml (the ffnn, AdaGrad on the server) with 3 partitions, each run a
``jobs/train.py`` process on ``local-cluster[N,1,1024]`` (real executor JVMs):

``3 workers``          three executors
``3 workers, kill 2``  three executors; when the run has trained ``--kill-at`` of its windows,
                       two executor JVMs are SIGKILLed
``1 worker``           one executor: the three partitions' tasks run one after another

Prints the valid loss against wall time of each run (the figure's data), the kill time,
and the failure counters of the killed run's last metrics line. On Spark a killed executor
is not gone for good as in the seed: the standalone worker starts a replacement and Spark
retries the dead tasks there, each resuming at its first window not applied.

``--figure 3`` runs Tai and Xu's Figure 3 instead: 1, 2 and 3 workers, each with as many
partitions (the corpus sharded over the workers), none killed. Each run's summary line is
also written to ``<out>/results.jsonl`` (kill times for plotting).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rnnlm.core.metrics import json_lines  # noqa: E402


def executor_pids() -> list:
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if b"CoarseGrainedExecutorBackend" in f.read():
                    pids.append(int(d))
        except (OSError, ValueError):
            continue
    return sorted(pids)


def metrics(out: str) -> list:
    try:
        with open(os.path.join(out, "metrics.jsonl"), "rb") as f:
            return json_lines(f.read())           # a line still being written is left out, not the file
    except FileNotFoundError:
        return []


def run(name: str, executors: int, partitions: int, kill_at: float | None, a) -> dict:
    out = os.path.join(a.out, name)
    sets = [f"data.partitions={partitions}", f"train.epochs={a.epochs}", "train.eval_every=10", "data.test=",
            "server.timeout_s=10", *a.set]
    cmd = [sys.executable, "jobs/train.py", "--config", "conf/nnlm_async.toml", "--out", out, "--samples", "0",
           "--master", f"local-cluster[{executors},1,1024]", *[x for s in sets for x in ("--set", s)]]
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    log = open(os.path.join(a.out, f"{name}.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
    killed_at = None
    while proc.poll() is None:
        m = metrics(out)
        if kill_at is not None and killed_at is None and m and m[-1]["epoch"] >= kill_at * a.epochs:
            pids = executor_pids()
            if len(pids) >= 3:
                for pid in pids[:2]:
                    os.kill(pid, signal.SIGKILL)
                killed_at = m[-1]["wall_s"]
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed, see {log.name}")
    m = metrics(out)
    curve = [(x["wall_s"], round(x["valid_loss"], 4)) for x in m if "valid_loss" in x]
    keys = ("syncs", "windows_lost", "windows_redone", "attempts_retried", "workers_lost", "refused_duplicate")
    return {"run": name, "killed_at_s": killed_at, "curve": curve, **{k: m[-1].get(k, 0) for k in keys}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--kill-at", type=float, default=0.4, help="fraction of the run trained when 2 are killed")
    ap.add_argument("--out", default="runs/worker_failure")
    ap.add_argument("--figure", type=int, choices=(3, 4), default=4)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.figure == 4:
        runs = (("3 workers", 3, 3, None), ("3 workers, kill 2", 3, 3, a.kill_at), ("1 worker", 1, 3, None))
    else:
        runs = tuple((f"{n} worker{'s' if n > 1 else ''}", n, n, None) for n in (1, 2, 3))
    for name, executors, partitions, kill in runs:
        r = run(name.replace(" ", "_").replace(",", ""), executors, partitions, kill, a)
        r["run"] = name
        print(json.dumps(r), flush=True)
        with open(os.path.join(a.out, "results.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
