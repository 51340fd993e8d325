"""The run directory both drivers write, without Spark (a LocalFS): the Spark tests run it end to end."""
import re

import pytest

from rnnlm import config
from rnnlm.core import checkpoint as ckpt
from rnnlm.core.files import LocalFS
from rnnlm.core.model import RNNLM
from rnnlm.core.vocab import Vocab
from rnnlm.spark.rundir import ASYNC_RESUME_KEYS, RunDir, TrainingError, check_resume


def test_an_async_resume_also_refuses_another_push_size_or_server_rule():
    cfg = config.load(None, ["train.mode=async", "train.push_every=3"])
    for section, key, value in (("train", "push_every", 4), ("server", "update", "adagrad"),
                                ("server", "staleness", "divide")):
        saved = config.replace(cfg, section, **{key: value})
        check_resume(cfg, saved, "ck")          # the same experiment to a synchronous run: it has no pushes
        mine, theirs = getattr(getattr(cfg, section), key), value
        with pytest.raises(TrainingError) as e:
            check_resume(cfg, saved, "ck", ASYNC_RESUME_KEYS)
        assert str(e.value) == f"cannot resume: {section}.{key} is {mine!r} here but {theirs!r} in ck"
    # the vocabulary's size is the corpus', never the configuration's choice
    check_resume(cfg, config.replace(cfg, "model", vocab_size=7), "ck", ASYNC_RESUME_KEYS)


def test_lines_checkpoints_and_a_resume_in_a_local_run_directory(tmp_path):
    logs = []
    out = RunDir(f"{tmp_path}/run/", fs=LocalFS(), log=logs.append)
    out.prepare(resume=False)
    for r in (1, 2, 3):
        out.add_line({"round": r}, 3, f"line {r}")
    assert logs == ["line 1", "line 2", "line 3"]
    assert out.kept() == "no checkpoint was written yet"
    vocab = Vocab.build("abracadabra", "char")
    cfg = config.replace(config.load(None, ["model.hidden=4"]), "model", vocab_size=len(vocab))
    position = {"round": 2, "tokens": 80, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 1.5}   # what a resume reads
    ck = ckpt.Checkpoint(params=RNNLM(cfg.model).init_params(1), config=cfg, vocab=vocab, position=position)
    out.write_checkpoint(ck, best=False)
    assert not (tmp_path / "run" / "best").exists()
    out.write_checkpoint(ck, best=True)
    assert ckpt.load(str(tmp_path / "run" / "best")).position == position
    assert out.kept() == f"the last good checkpoint is kept in {tmp_path}/run/checkpoint"

    again = RunDir(str(tmp_path / "run"), fs=LocalFS(), log=logs.append)
    with pytest.raises(TrainingError, match=f"^{re.escape(str(tmp_path))}/run already holds a run "):
        again.prepare(resume=False)
    again.prepare(resume=True)
    assert again.read_checkpoint(cfg).position == position
    assert again.saved_lines() == [{"round": 1}, {"round": 2}, {"round": 3}]
    again.keep_lines(again.saved_lines()[:2])         # round 3 runs again
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"round": 1}\n{"round": 2}\n'
    assert again.nothing_to_do(2, 2) == {"round": 2}
    assert logs[-1] == (f"nothing to do: {tmp_path}/run is at round 2 of 2 (raise train.rounds or train.epochs "
                        "to train on)")

    (tmp_path / "run" / "run.json").write_text("{}")
    again.prepare(resume=False, overwrite=True)
    assert list((tmp_path / "run").iterdir()) == []


@pytest.mark.parametrize("lines, key, taken", [
    ('{"round": 1}\n{"round": 2}\n{"rou', "round", [{"round": 1}, {"round": 2}]),    # a crash cut the last
    ('{"round": 0, "syncs": 0}\n', "syncs", [{"round": 0, "syncs": 0}]),
    ('{"round": 1}\n5\n{"round": 3}\n', "round", 2),                # a JSON number: m["round"] was a TypeError
    ('{"round": 1}\n{"loss": 2.0}\n', "round", 2),                  # no round: a KeyError
    ('{"round": "1"}\n', "round", 1),                               # a string: "1" <= 2 was a TypeError
    ('{"round": -1}\n', "round", 1),
    ('{"round": true}\n', "round", 1),
    ('{"round": 1}\n{"round": 2}\n', "syncs", 1),                   # an async resume reads syncs
    ('{"round": 1}\n{"rou\n{"round": 3}\n', "round", 2),           # only the last line may be cut short:
])                                                                  # json_lines dropped round 3 on resume
def test_saved_metrics_lines_are_metrics_lines_or_one_line_error(tmp_path, lines, key, taken):
    """What a resume reads back from metrics.jsonl: tables with the integer counts it filters on. A
    line of anything else was a traceback in the resume (or, before Spark, in the plateau check); a
    cut line before the last silently dropped every line after it when the resume rewrote the file."""
    (tmp_path / "metrics.jsonl").write_text(lines)
    run = RunDir(str(tmp_path), fs=LocalFS())
    keys = ("round", "syncs") if key == "syncs" else ("round",)
    if isinstance(taken, list):
        assert run.saved_lines(keys) == taken
        return
    with pytest.raises(TrainingError) as e:
        run.saved_lines(keys)
    assert str(e.value) == (f"{tmp_path}/metrics.jsonl: line {taken} is not a metrics line (a JSON table with "
                            f"integers {' and '.join(keys)} >= 0): mend or remove it, or start again with "
                            "--overwrite"), str(e.value)
