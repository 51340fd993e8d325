"""The single-process trainer (``rnnlm demo``'s engine): epochs into rounds, the held-out split, the
evaluations, the checkpoint."""
import math
import time

import numpy as np
import pytest

from rnnlm import config
from rnnlm.core import checkpoint
from rnnlm.core.single import train

TEXT = "".join(f"line {i % 7} of the harbour text\n" for i in range(60))      # 1,620 characters


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "all.txt").write_text(TEXT, encoding="utf-8")
    return tmp_path


def run(corpus, *sets):
    cfg = config.load(None, [f"data.train={corpus / 'all.txt'}", "data.valid=", "data.level=char", "model.hidden=8",
                             "train.bptt=5", "train.batch=2", "train.eval_every=0", *sets])
    said = []
    m = train(cfg, out=str(corpus / "ck"), log=said.append)
    return m, said


def figures(line: str) -> dict:
    """The opening log line's figures by name."""
    words = line.replace(",", "").replace("|", " ").split()
    return {"tokens": int(words[words.index("tokens") + 1]), "per_epoch": int(words[words.index("steps") - 1]),
            "rounds": int(words[words.index("rounds") - 1]), "k": int(words[words.index("rounds") + 2])}


@pytest.mark.parametrize("sets, k", [(["train.epochs=2", "train.local_steps=7"], 7),
                                     (["train.epochs=2", "train.local_steps=0"], None),
                                     (["train.rounds=3", "train.local_steps=4"], 4)])
def test_epochs_become_rounds_of_local_steps(corpus, sets, k):
    m, said = run(corpus, *sets)
    f = figures(said[0])
    tokens = int(len(TEXT) * 0.9)                          # no data.valid: the last 10% is held out
    assert f["tokens"] == tokens
    per_epoch = (tokens // 2 - 1) // 5                     # B = 2 streams of T = 5 steps
    assert f["per_epoch"] == per_epoch
    k = k or per_epoch                                     # local_steps = 0: a round is a pass
    rounds = 3 if "train.rounds=3" in sets else math.ceil(2 * per_epoch / k)
    assert (f["rounds"], f["k"]) == (rounds, k)
    assert m["round"] == rounds and m["epoch"] == round(rounds * k / per_epoch, 4)
    ck = checkpoint.load(str(corpus / "ck"))
    assert ck.position == {"round": rounds, "step": rounds * k}
    assert np.array_equal(ck.params, m["params"]) and ck.config.model.vocab_size == len(ck.vocab)


def test_a_whole_number_of_rounds_worth_of_epochs_is_not_rounded_up_by_the_quotients_last_bit(corpus):
    """2.2 epochs of 25 steps in rounds of one: 2.2 * 25 is 55.000000000000007 in floats, and the trainer
    ran 56 rounds where Spark's (rnnlm.spark.corpus.total_rounds) ran 55."""
    assert 2.2 * 25 > 55
    m, said = run(corpus, "train.bptt=29", "train.epochs=2.2", "train.local_steps=1")
    f = figures(said[0])
    assert (f["per_epoch"], f["rounds"], m["round"], m["epoch"]) == (25, 55, 55, 2.2)


def test_a_gzip_text_is_read_inflated_as_spark_reads_it_and_other_codecs_are_refused(corpus):
    """The demo decoded a .gz file's compressed bytes as text: a vocabulary of 219 "characters" and a
    valid perplexity of 4,409 where the plain text's was 10.65, with no error."""
    import gzip
    from rnnlm.core.single import read_text
    (corpus / "all.txt.gz").write_bytes(gzip.compress((corpus / "all.txt").read_bytes()))
    plain, _ = run(corpus, "train.rounds=2", "train.local_steps=3")
    packed, _ = run(corpus, "train.rounds=2", "train.local_steps=3", f"data.train={corpus / 'all.txt.gz'}")
    assert packed["vocab"] == plain["vocab"] and np.array_equal(packed["params"], plain["params"])
    (corpus / "bad.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"bad.gz is not gzip text \(Not a gzipped file"):
        read_text(str(corpus / "bad.gz"))
    (corpus / "all.txt.bz2").write_bytes(b"BZh9")
    with pytest.raises(ValueError, match=r"reads plain or gzip text \(Hadoop reads this codec\)"):
        read_text(str(corpus / "all.txt.bz2"))


def test_the_held_out_text_is_the_last_tenth_or_data_valid(corpus):
    """Without ``data.valid`` the last 10% of the tokens is evaluated; with it, that file: the same
    figures when the file holds that tenth."""
    cut = int(len(TEXT) * 0.9)
    (corpus / "head.txt").write_text(TEXT[:cut], encoding="utf-8")
    (corpus / "tail.txt").write_text(TEXT[cut:], encoding="utf-8")
    split, said = run(corpus, "train.rounds=2", "train.local_steps=3", "train.eval_every=1")
    assert [s.split(" | ")[0] for s in said[1:3]] == ["round 1", "round 2"]           # every round evaluated
    given, _ = run(corpus, "train.rounds=2", "train.local_steps=3", f"data.train={corpus / 'head.txt'}",
                   f"data.valid={corpus / 'tail.txt'}")
    assert given["valid_loss"] == split["valid_loss"] and given["train_loss"] == split["train_loss"]
    assert split["valid_bpc"] == pytest.approx(split["valid_loss"] / math.log(2))
    other, _ = run(corpus, "train.rounds=2", "train.local_steps=3", f"data.train={corpus / 'head.txt'}",
                   f"data.valid={corpus / 'head.txt'}")
    assert other["valid_loss"] != split["valid_loss"]


def test_each_round_takes_the_rate_of_the_epoch_it_starts_in_and_losses_are_per_token(corpus):
    """Zaremba's decay from the second epoch on: rounds of one pass each start at epochs 0, 1, 2."""
    t0 = time.perf_counter()
    m, said = run(corpus, "train.epochs=3", "train.local_steps=0", "train.eval_every=1", "optim.name=sgd",
                  "optim.lr=1", "optim.schedule=epoch_decay", "optim.decay_after=1", "optim.decay=0.5")
    wall = time.perf_counter() - t0
    lines = [dict(f.rsplit(" ", 1) for f in s.split(" | ")) for s in said[1:4]]
    assert [float(x["lr"]) for x in lines] == [1.0, 0.5, 0.25]
    assert [float(x["epoch"]) for x in lines] == [1.0, 2.0, 3.0]
    chance = math.log(len(m["vocab"]))                     # a model that knows nothing: ln V per token
    assert 0 < m["train_loss"] < chance + 0.5 and 0 < m["valid_loss"] < chance + 0.5, (m, chance)
    assert 0 < m["wall_s"] <= wall


def test_wall_s_counts_training_and_eval_s_the_evaluations(corpus, monkeypatch):
    """Each evaluation made 0.5 s slower: wall_s (training alone, as Spark's trainer counts it) does not
    grow with them, eval_s does (wall_s once took them in: 91% of a demo's last wall_s was evaluation)."""
    from rnnlm.core import single
    real = single.held_out_nll

    def slow(*args):
        time.sleep(0.5)
        return real(*args)
    monkeypatch.setattr(single, "held_out_nll", slow)
    t0 = time.perf_counter()
    m, said = run(corpus, "train.rounds=3", "train.local_steps=2", "train.eval_every=1")
    took = time.perf_counter() - t0
    lines = [dict(f.rsplit(" ", 1) for f in s.split(" | ")) for s in said[1:4]]
    assert [float(x["eval_s"]) >= 0.5 * (i + 1) for i, x in enumerate(lines)] == [True] * 3
    assert m["wall_s"] < 0.5 and 1.5 <= m["eval_s"] <= took


def test_a_short_validation_text_is_scored_and_one_too_short_is_refused_before_training(corpus):
    """The held-out text was scored in chunks of 100 tokens: one of 60 stopped the run at its first
    evaluation, after a round of training, with "60 tokens cannot fill 1 streams of 101 tokens"."""
    (corpus / "short.txt").write_text(TEXT[:60], encoding="utf-8")
    m, said = run(corpus, "train.rounds=2", "train.local_steps=3", "train.eval_every=1",
                  f"data.valid={corpus / 'short.txt'}")
    assert math.isfinite(m["valid_loss"]) and 0 < m["valid_loss"] < 10 and said[2].startswith("round 2 |")
    (corpus / "one.txt").write_text("l", encoding="utf-8")
    for valid, where in ((f"data.valid={corpus / 'one.txt'}", "data.valid"),
                         (f"data.train={corpus / 'one.txt'}", "the last 10% of data.train")):
        with pytest.raises(ValueError, match=rf"^the validation text has [01] tokens?: {where} must hold at least 2$"):
            run(corpus, "train.rounds=2", valid, *(["data.valid="] if "train" in valid else []))


def test_keys_this_trainer_does_not_read_are_named_at_the_start(corpus):
    """``rnnlm demo --set data.strategy=windows`` (or a sampled softmax, a test text) trained streams with the
    full softmax and said nothing: output byte for byte the default's."""
    _, said = run(corpus, "train.rounds=1")
    assert not said[0].startswith("note:")
    _, said = run(corpus, "train.rounds=1", "data.strategy=windows", "exchange.sampled_softmax=true",
                  f"data.test={corpus / 'all.txt'}")
    assert said[0] == (f"note: this trainer of one process trains streams with the full softmax and scores data.valid; "
                       f"it ignores data.strategy = 'windows', data.test = '{corpus / 'all.txt'}', "
                       "exchange.sampled_softmax = True (Spark's trainer reads them)")
    # the streams of all partitions together (conf/ptb_word_small.toml's max_streams = 80): one partition's share
    _, said = run(corpus, "train.rounds=1", "train.global_batch=6", "data.partitions=3")
    assert said[0] == ("note: this trainer of one process trains train.batch = 2 streams, one partition's share of "
                       "train.global_batch on data.partitions = 3; for 6 streams set data.partitions = 1")
    assert figures(said[1])["per_epoch"] == figures(run(corpus, "train.rounds=1")[1][0])["per_epoch"]   # B = 2 both


def test_a_plateau_that_would_see_one_loss_after_the_last_round_is_refused(corpus):
    """``optim.schedule = plateau`` with ``train.eval_every = 0`` observed one validation loss, after the last
    round: the rate never decayed."""
    with pytest.raises(config.ConfigError, match="train.eval_every = 0 measures only once the run has ended"):
        run(corpus, "optim.schedule=plateau", "train.eval_every=0", "train.rounds=2")
    m, _ = run(corpus, "optim.schedule=plateau", "train.eval_every=1", "train.rounds=2")
    assert m["round"] == 2


def test_patience_ends_the_run_at_the_evaluation_it_counts_to(corpus):
    """SGD at a rate of 3 goes up and down: with train.patience = 3 the run ends at the third evaluation after
    its best (a later best starts the count again), on the lines the longer run logged, and its checkpoint says
    which round; a run whose last round is that evaluation just ends."""
    sets = ("train.rounds=8", "train.local_steps=3", "train.eval_every=1", "optim.name=sgd", "optim.lr=3")
    whole, said = run(corpus, *sets)
    losses = [float(dict(f.rsplit(" ", 1) for f in s.split(" | "))["valid_loss"]) for s in said[1:9]]
    stop = next(r for r in range(1, 9) if r - (1 + int(np.argmin(losses[:r]))) >= 3)
    best = 1 + int(np.argmin(losses[:stop]))
    assert 1 < best and stop < 8 and min(losses[:best - 1]) > losses[best - 1], losses    # the best moved once
    m, cut = run(corpus, *sets, "train.patience=3")

    def untimed(lines):
        return [[f for f in s.split(" | ") if not f.split(" ")[0].endswith("_s")] for s in lines]
    assert untimed(cut[1:-2]) == untimed(said[1:stop + 1]) and m["round"] == stop
    said_best = cut[-2].rsplit(" its ", 1)[1].split(" ")[0]       # the logged loss shows 4 figures
    assert cut[-2] == (f"stopped early after round {stop} of 8: 3 evaluations since round {best} without a lower "
                       f"validation loss than its {said_best} (train.patience = 3)")
    assert abs(float(said_best) - losses[best - 1]) < 0.01
    assert checkpoint.load(str(corpus / "ck")).position["round"] == stop
    m, cut = run(corpus, *sets[1:], f"train.rounds={stop}", "train.patience=3")
    assert m["round"] == stop and not any(s.startswith("stopped early") for s in cut)


def test_the_rounds_are_the_core_steps_written_out(corpus):
    """Rounds of 50 steps in epochs of 145: each round's rate is its starting epoch's (not its number's),
    its dropout masks its own stream (seed, round, 0), its train_loss the mean NLL per token, and the
    checkpoint holds the parameters and the streams' hidden state where the last round left them."""
    from rnnlm.core import backend
    from rnnlm.core.local import train_steps
    from rnnlm.core.models import build as build_model
    from rnnlm.core.optim import make_optimizer
    from rnnlm.core.strategies import StreamBlock
    sets = ("train.rounds=4", "train.local_steps=50", "train.eval_every=1", "model.dropout=0.3", "optim.name=sgd",
            "optim.lr=1", "optim.schedule=epoch_decay", "optim.decay_after=1", "optim.decay=0.5", "train.seed=5")
    m, said = run(corpus, *sets)
    lines = [dict(f.rsplit(" ", 1) for f in s.split(" | ")) for s in said if s.startswith("round ")]
    ck = checkpoint.load(str(corpus / "ck"))
    ids = m["vocab"].encode(TEXT)[:int(len(TEXT) * 0.9)]
    block = StreamBlock(ids, 2, 5)
    assert block.steps_per_pass == 145                         # rounds start at epochs 0, .34, .69, 1.03
    rates = [1.0, 1.0, 1.0, 0.5]
    model, cfg = build_model(ck.config.model), ck.config
    params = model.init_params(5)
    opt = make_optimizer(cfg.optim)
    opt_state, state = opt.init_state(params), model.zero_state(2)
    for r, lr in enumerate(rates, 1):
        res = train_steps(model, opt, params, opt_state, block.batches(50 * (r - 1), 50), state, lr=lr,
                          clip_norm=cfg.optim.clip_norm, grad_norm=cfg.train.grad_norm,
                          dropout_rng=backend.rng_for(np, 5, r, 0))
        state = res.state
    assert [float(x["lr"]) for x in lines] == rates
    assert np.array_equal(ck.params, params) and np.array_equal(ck.hidden, state)
    assert m["train_loss"] == res.loss_sum / res.tokens and res.tokens == 50 * 5 * 2


def test_a_plateau_schedule_keeps_the_best_loss_per_token(corpus):
    """The checkpoint's schedule, which a resumed run's evaluations are compared with, holds the best
    validation loss per token (the log lines round it to 3 decimals)."""
    said = run(corpus, "train.rounds=3", "train.local_steps=20", "train.eval_every=1", "optim.schedule=plateau")[1]
    losses = [float(dict(f.rsplit(" ", 1) for f in s.split(" | "))["valid_loss"]) for s in said
              if s.startswith("round ")]
    assert len(losses) == 3
    assert checkpoint.load(str(corpus / "ck")).schedule["best"] == pytest.approx(min(losses), abs=5e-4)


def test_loss_fields_are_the_loss_its_perplexity_and_bits_per_character():
    from rnnlm.core.metrics import loss_fields
    assert loss_fields(2.0, "char", "v") == {"v_loss": 2.0, "v_ppl": math.exp(2.0), "v_bpc": 2.0 / math.log(2)}
    assert loss_fields(4.5, "word", "test") == {"test_loss": 4.5, "test_ppl": math.exp(4.5)}
    assert loss_fields(700.0, "word", "v")["v_ppl"] == math.exp(700.0)          # large, still finite
    assert loss_fields(709.7, "word", "v")["v_ppl"] == math.exp(709.7)          # float64's largest, nearly
    assert loss_fields(710.0, "word", "v")["v_ppl"] == math.inf                 # past float64's range
    assert loss_fields(math.inf, "word", "v")["v_ppl"] == math.inf
    assert math.isnan(loss_fields(math.nan, "word", "v")["v_ppl"])              # not an overflow: NaN said as NaN


def test_the_held_out_tenth_is_not_counted_into_the_vocabulary(tmp_path):
    """Without data.valid the last 10% of data.train is held out, yet its words were counted into the
    vocabulary first: a word only there got an id of its own, and <unk> never occurred in the held-out text."""
    (tmp_path / "all.txt").write_text("the harbour wall\n" * 90 + "the zebra wall\n" * 10, encoding="utf-8")
    cfg = config.load(None, [f"data.train={tmp_path / 'all.txt'}", "data.valid=", "data.level=word",
                             "model.hidden=8", "train.bptt=5", "train.batch=2", "train.rounds=1"])
    m = train(cfg, log=lambda _: None)
    vocab = m["vocab"]
    assert "zebra" not in vocab.index and "harbour" in vocab.index
    ids = vocab.index
    assert list(vocab.encode("the zebra wall\n")) == [ids["the"], vocab.unk_id, ids["wall"], ids["<eos>"]]
