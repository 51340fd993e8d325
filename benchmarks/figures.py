"""The papers' figures, reproduced from this project's runs (PNGs in docs/figures/).

    python benchmarks/figures.py [--only spark_rnn,sampling,zipf,paramserver,frontier,shakespeare] [--draw-only]
                                 [--out runs/figures] [--figures docs/figures]

Every training run is a ``jobs/train.py`` process (its own SparkSession, ``run.json``
and ``metrics.jsonl`` under ``<out>/<stage>/<run>``), sized so this 2-core machine
finishes a stage in minutes; ``--draw-only`` redraws from the runs already there.

``spark_rnn``  Tiny Shakespeare, char LSTM 1x25 (the report's size), 2 partitions, T=25:
             paragraphs / all windows / sampled windows / sampled paragraphs, loss
             against characters seen and against all-reduces (Figs. 3-4); paragraphs
             with K = 1, 5, 25 local steps per all-reduce at equal work (Fig. 5).
``sampling``   PTB small: training tokens/s against workers (1 partition on local[1],
             2 on local[2]) per exchange setting (Fig. 3); learning curves of the
             corrected sampled softmax for several mu, and of the paper's literal
             variant at mu = 5%, against the full softmax (Fig. 6).
``zipf``  unique words U against tokens N, log-log, with the fitted power law, on
             PTB and on Tiny Shakespeare's words (Fig. 1); no training.
``paramserver``  the async ffnn (conf/nnlm_async.toml) through benchmarks/worker_failure.py:
             validation loss against time for 1, 2, 3 workers (Fig. 3) and with 2 of 3
             workers killed (Fig. 4).
``frontier`` PTB small, 0.5 epoch per exchange setting: best validation perplexity against
             bytes per training token with the Pareto front (with the sampling stage's mu runs); and
             the sync fraction against K for dense and the sparse conf's exchange.
``shakespeare`` conf/shakespeare_char.toml as it stands (2x512 char LSTM, 2 partitions, 10
             epochs, ~14 minutes): training and validation loss against wall time, with
             nanoGPT's 1.47 on the same split.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STAGES = ("spark_rnn", "sampling", "zipf", "paramserver", "frontier", "shakespeare")
NANOGPT_CHAR = 1.47           # nanoGPT's baby char transformer, validation nats/char on the same 90/10 split
SHAKESPEARE = ("data/tinyshakespeare.train.txt", "data/tinyshakespeare.valid.txt")

# the Spark RNN report: 1x25 LSTM, T=25, B=16, 10 local steps a round; sampled strategies train on a sample
# holding about as many characters as those steps read (benchmarks/strategies.py's rule)
S001 = ["data.level=char", "data.partitions=2", "data.window_stride=1", "model.cell=lstm", "model.hidden=25",
        "model.layers=1", "model.init_scale=0.08", "optim.name=adam", "optim.lr=0.01", "optim.clip_norm=5.0",
        "train.bptt=25", "train.batch=16", "train.grad_norm=token", "train.seed=1", "train.checkpoint_every=0"]
S001_ROUNDS, S001_K = 150, 10
S001_KS = (1, 5, 25)          # Fig. 5: equal work, S001_ROUNDS * S001_K // 2 steps in all

# Xiao et al. (2017): PTB small (conf/ptb_word_small.toml) with these exchanges
EXCHANGES = {
    "dense": [],
    "rows": ["exchange.embed=rows", "exchange.softmax=rows", "exchange.frequent=0.02", "exchange.random=0.02",
             "exchange.seed_groups=one"],
    "rows + sampled softmax": ["exchange.embed=rows", "exchange.softmax=rows", "exchange.frequent=0.02",
                               "exchange.random=0.02", "exchange.seed_groups=one", "exchange.sampled_softmax=true"],
    "rows + 1-bit (sparse conf)": "conf/ptb_word_small_sparse.toml",
}
S000_ROUNDS = 14
MUS = (0.0, 0.01, 0.03, 0.05, 0.2)     # the corrected sampled softmax
LITERAL_MU = 0.05                      # the paper's literal variant, for reference
S000_MU_EPOCHS = 0.5


def train(out: str, config: str, sets: list, master: str = "local[2]") -> str:
    """Run ``jobs/train.py`` into a fresh ``out``; return ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cmd = [sys.executable, "jobs/train.py", "--config", config, "--out", out, "--samples", "0", "--master", master,
           *[x for s in sets for x in ("--set", s)]]
    with open(out + ".log", "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1"), stdout=log,
                             stderr=log)
    if rc != 0:
        raise SystemExit(f"{out} failed, see {out}.log")
    print(f"  {os.path.relpath(out, ROOT)}", flush=True)
    return out


def run_spark_rnn(out: str):
    per_part = len(open(os.path.join(ROOT, SHAKESPEARE[0]), encoding="utf-8").read()) / 2
    chars = S001_K * 16 * 25
    fractions = {"sampled_windows": chars / 25 / per_part, "sampled_paragraphs": chars / per_part}
    data = [f"data.train={SHAKESPEARE[0]}", f"data.valid={SHAKESPEARE[1]}"]
    for strategy in ("paragraphs", "windows", "sampled_windows", "sampled_paragraphs"):
        sampled = strategy in fractions
        train(os.path.join(out, "strategies", strategy), "conf/demo.toml", [
            *data, *S001, f"data.strategy={strategy}", f"data.sample_fraction={fractions.get(strategy, 1.0)}",
            f"train.local_steps={0 if sampled else S001_K}", f"train.rounds={S001_ROUNDS}",
            f"train.eval_every={S001_ROUNDS // 5}"])
    steps = S001_ROUNDS * S001_K // 2
    for k in S001_KS:
        train(os.path.join(out, "local_steps", f"K{k}"), "conf/demo.toml", [
            *data, *S001, "data.strategy=paragraphs", f"train.local_steps={k}", f"train.rounds={steps // k}",
            f"train.eval_every={max(1, steps // k // 5)}"])


def run_sampling(out: str):
    base = ["data.test=", "train.checkpoint_every=0"]
    for name, ex in EXCHANGES.items():
        conf = ex if isinstance(ex, str) else "conf/ptb_word_small.toml"
        sets = [] if isinstance(ex, str) else ex
        for workers in (1, 2):
            train(os.path.join(out, "speed", f"{name.split(' (')[0].replace(' ', '')}_{workers}w"), conf, [
                *base, *sets, "data.valid=", f"data.partitions={workers}", "train.local_steps=20",
                f"train.rounds={S000_ROUNDS}", "train.eval_every=0"], master=f"local[{workers}]")
    runs = [("full_softmax", EXCHANGES["rows"])]
    runs += [(f"mu{mu}", EXCHANGES["rows + sampled softmax"] + [f"exchange.mu={mu}"]) for mu in MUS]
    runs.append((f"literal_mu{LITERAL_MU}", EXCHANGES["rows + sampled softmax"] + [
        f"exchange.mu={LITERAL_MU}", "exchange.sampled_variant=literal"]))
    for name, sets in runs:
        train(os.path.join(out, "mu", name), "conf/ptb_word_small.toml",
              [*base, *sets, f"train.epochs={S000_MU_EPOCHS}", "train.eval_every=10"])


FRONTIER = {
    "dense_K20": ["train.local_steps=20"],
    "dense_K5": ["train.local_steps=5"],
    "rows_fp16_K20": ["train.local_steps=20", "exchange.embed=rows+fp16", "exchange.softmax=rows+fp16",
                      "exchange.hidden=dense+fp16", "exchange.frequent=0.02", "exchange.random=0.02",
                      "exchange.seed_groups=one"],
}
SYNC_KS = (1, 5, 20, 50)


def run_frontier(out: str):
    base = ["data.test=", "train.checkpoint_every=0", f"train.epochs={S000_MU_EPOCHS}", "train.eval_every=10"]
    for name, sets in FRONTIER.items():
        train(os.path.join(out, "quality", name), "conf/ptb_word_small.toml", [*base, *sets])
    train(os.path.join(out, "quality", "sparse_conf_K20"), "conf/ptb_word_small_sparse.toml", base)
    train(os.path.join(out, "quality", "sparse_conf_sampled_K20"), "conf/ptb_word_small_sparse.toml",
          base + ["exchange.sampled_softmax=true"])
    for conf, name in (("conf/ptb_word_small.toml", "dense"), ("conf/ptb_word_small_sparse.toml", "sparse")):
        for k in SYNC_KS:
            train(os.path.join(out, "sync", f"{name}_K{k}"), conf, [
                "data.valid=", "data.test=", "train.checkpoint_every=0", "train.eval_every=0",
                f"train.local_steps={k}", f"train.rounds={max(6, 60 // k)}"])


def run_paramserver(out: str):
    for fig in (3, 4):
        d = os.path.join(out, f"fig{fig}")
        shutil.rmtree(d, ignore_errors=True)
        rc = subprocess.call([sys.executable, "benchmarks/worker_failure.py", "--figure", str(fig), "--out", d],
                             cwd=ROOT)
        if rc != 0:
            raise SystemExit(f"benchmarks/worker_failure.py --figure {fig} failed")


def run_shakespeare(out: str):
    train(os.path.join(out, "char"), "conf/shakespeare_char.toml", [])


def _speed(run) -> float:
    """Training tokens/s over rounds 2.. (the first warms up workers and caches), from round_s."""
    ms = run.metrics[1:]
    return (ms[-1]["tokens"] - run.metrics[0]["tokens"]) / sum(m["round_s"] for m in ms)


def _pair(plots, rs, labels, title, smooth=1):
    fig, axes = plots.pyplot().subplots(1, 2, figsize=(11, 4), sharey=True)
    plots.plot_metric(rs, "tokens", "train_loss", ax=axes[0], labels=labels, smooth=smooth)
    plots.plot_metric(rs, "syncs", "train_loss", ax=axes[1], labels=labels, smooth=smooth)
    axes[0].set_xlabel("characters seen (all partitions)")
    axes[1].set_xlabel("all-reduces")
    fig.suptitle(title, fontsize=10)
    return fig


def draw_spark_rnn(d: str, out: str) -> list:
    from rnnlm import plots, runs
    done = []
    rs = runs.load_all([os.path.join(d, "strategies")])
    fig = _pair(plots, rs, [r.name for r in rs], "The Spark RNN report, Figs. 3-4: Tiny Shakespeare, 1x25 char LSTM, "
                "2 partitions (training loss, mean of 5 rounds)", smooth=5)
    done.append((plots.save(fig, os.path.join(out, "spark_rnn_strategies.png")),
                 {r.name: round(r.metrics[-1]["valid_loss"], 3) for r in rs}))
    rs = runs.load_all([os.path.join(d, "local_steps")])
    rs.sort(key=lambda r: r.config["train"]["local_steps"])
    fig = _pair(plots, rs, [f"K = {r.config['train']['local_steps']}" for r in rs],
                "The Spark RNN report, Fig. 5: paragraphs, K local steps per all-reduce, equal work (mean of 5 rounds)",
                smooth=5)
    done.append((plots.save(fig, os.path.join(out, "spark_rnn_local_steps.png")),
                 {r.name: round(r.metrics[-1]["valid_loss"], 3) for r in rs}))
    return done


def draw_sampling(d: str, out: str) -> list:
    from rnnlm import plots, runs
    done = []
    rs = runs.load_all([os.path.join(d, "speed")])
    _, ax = plots.pyplot().subplots(figsize=(6.4, 4.2))
    table = {}
    for name in EXCHANGES:
        key = name.split(" (")[0].replace(" ", "")
        pts = sorted((r.config["data"]["partitions"], _speed(r)) for r in rs if r.name.rsplit("_", 1)[0] == key)
        ax.plot([w for w, _ in pts], [v for _, v in pts], marker="o", label=name)
        table[name] = {f"{w}w": round(v) for w, v in pts}
    ax.set_xticks([1, 2])
    ax.set_xlabel("workers (partitions; local[1] / local[2])")
    ax.set_ylabel("training tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("Xiao et al. (2017), Fig. 3: PTB small, K = 20, speed against workers", fontsize=10)
    done.append((plots.save(ax, os.path.join(out, "sampling_speed.png")), table))
    rs = runs.load_all([os.path.join(d, "mu")])

    def variant(r):
        ex = r.config["exchange"]
        return ex.get("sampled_variant", "corrected") if ex["sampled_softmax"] else "full"
    rs.sort(key=lambda r: ({"full": 0, "corrected": 1}.get(variant(r), 2), r.config["exchange"]["mu"]))
    labels = [{"full": "full softmax", "corrected": f"corrected sampled softmax, mu = {r.config['exchange']['mu']:g}",
               }.get(variant(r), f"the paper's literal variant, mu = {r.config['exchange']['mu']:g}") for r in rs]
    ax = plots.plot_metric(rs, "tokens", "valid_ppl", labels=labels)
    ax.set_yscale("log")
    ax.set_title("Xiao et al. (2017), Fig. 6: PTB small, rows exchange, learning curves against mu", fontsize=10)
    done.append((plots.save(ax, os.path.join(out, "sampling_mu.png")),
                 {lab: round(r.metrics[-1]["valid_ppl"], 1) for lab, r in zip(labels, rs)}))
    return done


def draw_zipf(d: str, out: str) -> list:
    from rnnlm import plots
    from rnnlm.core import zipf
    _, ax = plots.pyplot().subplots(figsize=(6.4, 4.6))
    summary = {}
    for name, path in (("PTB train", "data/ptb.train.txt"), ("Tiny Shakespeare (words)", "data/tinyshakespeare.txt")):
        lines = open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines()
        tokens = zipf.token_ids((x + "\n" for x in lines), "word")
        ns = zipf.sizes(min(len(tokens) // 2, 300_000))
        u = zipf.unique_counts(tokens, ns, draws=8) / 8
        # fitted over benchmarks/zipf.py's range, where rounds live (a PTB small round reads 8,000
        # tokens); the local exponent falls as N grows (PTB's vocabulary is capped at 10,000 words)
        fit = (ns >= 200) & (ns <= 40_000)
        c, a = zipf.fit_power_law(ns[fit], u[fit])
        pts = ax.loglog(ns, u, "o", markersize=3, label=f"{name}: {len(tokens):,} tokens")
        ax.loglog(ns, c * ns.astype(float) ** a, "--", color=pts[0].get_color(),
                  label=f"U = {c:.2f} N^{a:.3f} (fit on 200 <= N <= 40,000)")
        summary[name] = {"c": round(c, 3), "a": round(a, 3), "U(400)": round(float(np.interp(400, ns, u)), 1)}
    ax.set_xlabel("tokens N (consecutive)")
    ax.set_ylabel("distinct words U")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    ax.set_title("Patwary et al. (2018), Fig. 1: distinct words against tokens", fontsize=10)
    return [(plots.save(ax, os.path.join(out, "zipf.png")), summary)]


def draw_paramserver(d: str, out: str) -> list:
    from rnnlm import plots, runs
    done = []
    for fig, title in ((3, "Tai and Xu (2014), Fig. 3: async ffnn on PTB, 1, 2, 3 workers (as many partitions)"),
                       (4, "Tai and Xu (2014), Fig. 4: 3 workers, 2 executors SIGKILLed (dotted), against 3 and 1")):
        results = [json.loads(x) for x in open(os.path.join(d, f"fig{fig}", "results.jsonl"))]
        rs = [runs.load(os.path.join(d, f"fig{fig}", r["run"].replace(" ", "_").replace(",", ""))) for r in results]
        ax = plots.plot_metric(rs, "wall", "valid_loss", labels=[r["run"] for r in results])
        for r in results:
            if r["killed_at_s"] is not None:
                ax.axvline(r["killed_at_s"], ls=":", color="gray")
        ax.set_title(title, fontsize=10)
        summary = {r["run"]: {"end_s": round(run.metrics[-1]["wall_s"]), "killed_at_s": r["killed_at_s"],
                              "valid_loss": round(run.metrics[-1]["valid_loss"], 3)} for r, run in zip(results, rs)}
        done.append((plots.save(ax, os.path.join(out, f"paramserver_fig{fig}.png")), summary))
    return done


def draw_frontier(d: str, out: str) -> list:
    from rnnlm import plots, runs
    rs = runs.load_all([os.path.join(d, "quality"), os.path.join(os.path.dirname(d), "sampling", "mu")])
    labels = [r.name.replace("_", " ") for r in rs]
    ax = plots.plot_frontier(rs, "valid_ppl", "best", labels=labels)
    ax.set_title("PTB small, 2 partitions, 0.5 epoch: quality against communication", fontsize=10)
    rows = plots.frontier(rs, "valid_ppl", "best", labels=labels)
    done = [(plots.save(ax, os.path.join(out, "frontier.png")),
             {r["label"]: [round(r["bytes_per_token"]), round(r["value"], 1), r["pareto"]] for r in rows})]
    rs = runs.load_all([os.path.join(d, "sync")])
    names = {plots.codec(r.config): "conf/ptb_word_small_sparse.toml (1-bit rows, int8 deltas)"
             for r in rs if r.name.startswith("sparse")}
    ax = plots.plot_sync_fraction(rs, names=names)
    ax.set_title("PTB small, 2 partitions on local[2]: share of a round spent synchronising", fontsize=10)
    done.append((plots.save(ax, os.path.join(out, "sync_fraction.png")),
                 {c: [(k, round(f, 3)) for k, f in v] for c, v in plots.sync_fractions(rs).items()}))
    return done


def draw_shakespeare(d: str, out: str) -> list:
    from rnnlm import plots, runs
    run = runs.load(os.path.join(d, "char"))
    ax = plots.axes()
    for y, label in (("train_loss", "training (mean of the round's steps, dropout on)"), ("valid_loss", "validation")):
        xs, ys = plots.series(run, "wall", y)
        ax.plot(xs, ys, label=label, marker="." if y == "valid_loss" else None)
    ax.axhline(NANOGPT_CHAR, color="grey", linestyle="--", label=f"nanoGPT char transformer, {NANOGPT_CHAR}")
    ax.set_ylim(1.0, 2.4)
    ax.set_xlabel("wall time (s), 2 partitions on local[2]")
    ax.set_ylabel("loss (nats/char)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Tiny Shakespeare, raw text, conf/shakespeare_char.toml (2x512 LSTM)", fontsize=10)
    last = [m for m in run.metrics if "valid_loss" in m][-1]
    return [(plots.save(ax, os.path.join(out, "shakespeare_char.png")),
             {"valid_loss": round(last["valid_loss"], 3), "epoch": round(last["epoch"], 2),
              "wall_s": round(last["wall_s"])})]


def draw(stage: str, d: str, out: str) -> list:
    return {"spark_rnn": draw_spark_rnn, "sampling": draw_sampling, "zipf": draw_zipf, "paramserver": draw_paramserver,
            "frontier": draw_frontier, "shakespeare": draw_shakespeare}[stage](d, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(STAGES))
    ap.add_argument("--draw-only", action="store_true")
    ap.add_argument("--no-draw", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs/figures"))
    ap.add_argument("--figures", default=os.path.join(ROOT, "docs/figures"))
    a = ap.parse_args(argv)
    stages = [s for s in a.only.split(",") if s]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise SystemExit(f"--only: unknown stage {bad[0]} (choose from {', '.join(STAGES)})")
    runners = {"spark_rnn": run_spark_rnn, "sampling": run_sampling, "paramserver": run_paramserver,
               "frontier": run_frontier, "shakespeare": run_shakespeare}
    if not a.draw_only:
        for s in stages:
            if s in runners:
                print(f"{s}: training", flush=True)
                runners[s](os.path.join(a.out, s))
    if not a.no_draw:
        os.makedirs(a.figures, exist_ok=True)
        for s in stages:
            for path, summary in draw(s, os.path.join(a.out, s), a.figures):
                print(f"{s}: {os.path.relpath(path, ROOT)}  {json.dumps(summary)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
