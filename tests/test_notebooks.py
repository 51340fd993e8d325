"""The notebooks execute (nbclient) on small runs made here, and are committed without outputs."""
import json
import os
import shutil

import nbclient
import nbformat

from rnnlm import config
from conftest import HARBOUR, HARBOUR_VALID, ROOT, metrics

NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(ROOT, "notebooks")) if f.endswith(".ipynb"))


def execute(name, env, root=ROOT):
    """Run notebook ``name`` as its kernel would in the checkout ``root`` (in ``root/notebooks``)."""
    nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)          # the kernel inherits the environment
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": os.path.join(root, "notebooks")}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return nb


def outputs(nb):
    return "".join(o.get("text", "") + json.dumps(o.get("data", {}).get("text/plain", ""))
                   for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_committed_notebooks_carry_no_outputs():
    assert NOTEBOOKS == ["convergence_vs_communication.ipynb", "zipf.ipynb"]
    for name in NOTEBOOKS:
        nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
        for c in nb.cells:
            if c.cell_type == "code":
                assert c.outputs == [] and c.execution_count is None, name


def test_convergence_notebook_runs_on_real_runs(spark, tiny_cfg, tmp_path):
    from rnnlm.spark.trainer import Trainer
    held = HARBOUR_VALID
    for k, embed in ((2, "dense"), (4, "dense"), (4, "rows+fp16")):
        cfg = config.replace(tiny_cfg, "train", local_steps=k, rounds=3, eval_every=3)
        cfg = config.replace(config.replace(cfg, "data", valid=held), "exchange", embed=embed)
        Trainer(spark, cfg, str(tmp_path / "sweep" / f"{k}{embed}"), log=lambda s: None).run()
    # a last line that counts no push and so carries no loss, as an async run's often does
    with open(tmp_path / "sweep" / "2dense" / "metrics.jsonl", "r+") as f:
        last = json.loads(f.read().splitlines()[-1])
        f.write(json.dumps({k: v for k, v in last.items() if k != "train_loss"}) + "\n")
    # a run whose first line is still being written: left out, and said (it vanished from every figure)
    (tmp_path / "sweep" / "starting").mkdir()
    (tmp_path / "sweep" / "starting" / "metrics.jsonl").write_text('{"round": 1, "tok')
    # relative, as a user types it from the repository root: the kernel itself runs in notebooks/
    relative = os.path.relpath(tmp_path / "sweep", ROOT)
    # and a path mistyped beside it: left out alone (it dropped every run, with "train one")
    typo = os.path.relpath(tmp_path / "sweeep", ROOT)
    nb = execute("convergence_vs_communication.ipynb", {"RNNLM_RUNS": f"{relative},{typo}"})
    text = outputs(nb)
    starting = os.path.join(ROOT, relative, "starting")
    assert f"left out: {starting}: metrics.jsonl holds no complete line yet\n" in text, text
    assert f"left out: {os.path.join(ROOT, typo)}: not a run (no such directory)\n" in text, text
    assert (f"runs (relative paths from the repository root {ROOT}): {os.path.join(ROOT, relative)}, "
            f"{os.path.join(ROOT, typo)}\n") in text
    assert "train_loss nan " in text
    assert "local_steps=2, embed=dense" in text and "local_steps=4, embed=rows+fp16" in text
    assert "'dense': [(2," in text
    # the frontier's rows, from the runs' own metrics: bytes per token over the run, the best perplexity, and
    # whether another run is at most as costly and as bad, and better on one
    points = {}
    for name, label in (("2dense", "local_steps=2, embed=dense"), ("4dense", "local_steps=4, embed=dense"),
                        ("4rows+fp16", "local_steps=4, embed=rows+fp16")):
        m = metrics(tmp_path / "sweep" / name)
        points[label] = ((m[-1]["bytes_sent"] + m[-1]["bytes_broadcast"]) / m[-1]["tokens"],
                         min(x["valid_ppl"] for x in m if "valid_ppl" in x))
    beaten = {label for label, (c, v) in points.items()
              if any(c2 <= c and v2 <= v and (c2, v2) != (c, v) for c2, v2 in points.values())}
    assert beaten and len(beaten) < len(points)        # the sweep has runs on the front and off it
    for label, (c, v) in points.items():
        row = f"{label:45s} {c:10.0f} B/token  ppl {v:8.2f}  {'' if label in beaten else 'front'}"
        assert row + "\n" in text, (row, text)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3            # the four clocks, the frontier, the sync fraction


def checkout(tmp_path):
    """A checkout as the README's first command leaves it, without its runs yet: setup.cfg (what the
    notebooks look for), notebooks/ and the shipped text; no data/ (nothing downloaded)."""
    root = tmp_path / "checkout"
    (root / "notebooks").mkdir(parents=True)
    (root / "rnnlm" / "data").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "setup.cfg"), root)
    shutil.copy(HARBOUR, root / "rnnlm" / "data")
    return root


def test_notebooks_run_as_they_stand_after_the_readmes_first_command(spark, tiny_cfg, tmp_path, capfd):
    """No variable set: the convergence notebook reads every run under runs/ (the README's runs/demo) and
    says in one line what to set when there is none; the Zipf notebook (Spark in its kernel) counts Penn
    Treebank when downloaded, else the shipped text, and says so. No Java stack trace reaches the output."""
    from rnnlm.spark.trainer import Trainer
    root = checkout(tmp_path)
    env = {"RNNLM_RUNS": "", "RNNLM_CORPUS": "", "RNNLM_ZIPF_LONGEST": ""}
    text = outputs(execute("convergence_vs_communication.ipynb", env, str(root)))
    assert text.startswith("no runs to read: train one (rnnlm train --config conf/demo.toml --out runs/demo) or "
                           f"set RNNLM_RUNS=DIR[,DIR...]\nleft out: {root}/runs: not a run (no such directory)\n"), text
    assert "Error" not in text and "Traceback" not in text
    Trainer(spark, config.replace(tiny_cfg, "data", valid=HARBOUR_VALID), str(root / "runs" / "demo"),
            log=lambda s: None).run()
    text = outputs(execute("convergence_vs_communication.ipynb", env, str(root)))
    assert f"runs (relative paths from the repository root {root}): {root / 'runs'}\n" in text, text
    assert text.count(" rounds     2  tokens ") == 1, text
    nb = execute("zipf.ipynb", dict(env, RNNLM_ZIPF_LONGEST="300"), str(root))
    text = outputs(nb)
    assert f"{root}/data/ptb.train.txt is not here (rnnlm download ptb fetches it): counting the shipped " \
           "harbour.txt" in text, text
    assert f"{root}/rnnlm/data/harbour.txt: U = " in text and "N = 10 .. 300" in text, text
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    exponent = float(text.split(" N^")[1].split(" ")[0])
    assert 0.4 < exponent < 1.0          # distinct words grow slower than the text
    err = capfd.readouterr().err
    assert "Exception" not in err and "\tat " not in err, err[-3000:]
