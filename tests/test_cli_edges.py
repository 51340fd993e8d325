"""The command line's small edges: help text, a prime the model cannot read, a metric name mistyped,
the corpora's file mode."""
import hashlib
import json
import os
import stat

from rnnlm import config, download
from rnnlm.cli import tools
from rnnlm.cli.main import main, parser
from rnnlm.core.single import train

from conftest import HARBOUR


def test_generate_help_shows_each_default_once():
    text = " ".join(parser("generate").format_help().split())          # argparse wraps lines
    assert "text the sample continues (default: none) --length" in text, text
    assert "(default: )" not in text


def test_a_prime_outside_the_vocabulary_is_said(tmp_path, capsys):
    cfg = config.load(None, [f"data.train={HARBOUR}", "data.valid=", "data.level=char", "model.hidden=8",
                             "train.rounds=1", "train.bptt=8", "train.batch=2", "train.eval_every=0"])
    train(cfg, out=str(tmp_path / "ck"), log=lambda s: None)
    assert main(["generate", "--checkpoint", str(tmp_path / "ck"), "--prime", "The", "--length", "5",
                 "--seed", "1"]) == 0
    assert "note:" not in capsys.readouterr().err          # every character known: nothing to say
    assert main(["generate", "--checkpoint", str(tmp_path / "ck"), "--prime", "Thé ☃ é", "--length", "5",
                 "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert err == "note: --prime has 2 chars outside the model's vocabulary, read as its unknown token: 'é', '☃'\n"


def test_a_mistyped_metric_gets_a_did_you_mean(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"round": 1, "tokens": 10, "syncs": 1, "wall_s": 1.0,
                                                   "train_loss": 3.0, "valid_ppl": 20.0}) + "\n")
    (run / "run.json").write_text(json.dumps({"config": config.load(None, []).to_dict()}))
    assert main(["plot", "--runs", str(run), "--y", "valid_pp", "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err == "error: no run has 'valid_pp' in its metrics (did you mean valid_ppl?)\n"


def test_downloaded_corpora_are_readable_by_others_as_the_umask_allows(tmp_path, monkeypatch):
    """mkstemp makes 0600 files: a corpus fetched for a shared data/ directory was the fetcher's alone."""
    data = b"hello corpus\n"
    monkeypatch.setitem(download.CORPORA, "toy", {"toy.txt": ("https://example.invalid/toy.txt",
                                                              hashlib.sha256(data).hexdigest())})
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / "toy.txt").write_bytes(data)
    old = os.umask(0o022)
    try:
        [path] = download.fetch("toy", str(tmp_path / "data"), str(tmp_path / "mirror"), log=lambda s: None)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


def test_unknown_tokens_keeps_order_and_counts_each_once():
    from rnnlm.core.vocab import Vocab
    v = Vocab.build("the cat sat\n", "word")
    assert tools.unknown_tokens(v, "the dog and the dog") == ["dog", "and"]
