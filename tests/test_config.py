import dataclasses

import pytest

from rnnlm import config
from rnnlm.config import ConfigError


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\ncell = "rnn"\nhidden = 32\n[optim]\nlr = 2\n')
    c = config.load(str(f), ["model.layers=3", "optim.nesterov=true", "data.train=a b.txt", "optim.lr=0.5"])
    assert (c.model.cell, c.model.hidden, c.model.layers) == ("rnn", 32, 3)
    assert c.optim.nesterov is True and c.optim.lr == 0.5 and isinstance(c.optim.lr, float)
    assert c.data.train == "a b.txt"
    assert config.from_json(c.to_json()) == c


@pytest.mark.parametrize("text,overrides,msg", [
    ("[model]\nhiden = 3\n", [], "unknown config key model.hiden"),
    ("[modle]\n", [], "unknown config section"),
    ("[model]\nhidden = '3'\n", [], "model.hidden = '3': expected int"),
    ("", ["model.hidden=3.5"], "expected int, got float"),
    ("", ["optim.nesterov=yes"], "expected bool"),
    ("", ["model.cell=gru"], "expected one of lstm, rnn"),
    ("", ["model"], "expected section.key=value"),
    ("", ["model.dropout=1.5"], "model.dropout must be in"),
    ("", ["data.min_count=0"], "data.min_count must be >= 1"),
    ("", ["data.eval_streams=0"], "data.eval_streams must be > 0"),
    ("", ["data.sample_fraction=0"], "data.sample_fraction must be in"),
    ("", ["optim.momentum=1.0"], "optim.momentum must be in"),
    ("", ["optim.beta2=1.5"], "optim.beta2 must be in"),
    ("", ["optim.eps=0"], "optim.eps must be > 0"),
    ("", ["optim.lr=inf"], "optim.lr must be > 0"),
    ("", ["optim.min_lr=2", "optim.lr=1"], "optim.min_lr must be in"),
    ("", ["optim.decay_after=-1"], "optim.decay_after must be >= 0"),
    ("", ["train.local_steps=-1"], "train.local_steps must be >= 0"),
    ("", ["train.results=tcp"], "train.results = 'tcp': expected one of spark, direct"),
    ("", ["train.outer_momentum=1"], "train.outer_momentum must be in"),
    ("", ["train.epochs=nan"], "train.rounds and train.epochs must be >= 0"),
    ("", ["model.init_scale=0"], "model.init_scale must be > 0"),
    ("", ["exchange.hidden=dense+onebit"], "without exchange.feedback = true"),
    ("", ["exchange.softmax=rows+fp8"], "expected one of dense, dense[+]fp16"),
    ("", ["exchange.random=1.5"], "exchange.random must be in"),
    ("", ["exchange.mu=-0.1"], "exchange.mu must be in"),
    ("", ["exchange.broadcast=delta+onebit"], "exchange.broadcast"),
    ("", ["train.overlap=2"], "train.overlap must be 0 or 1"),
    ("", ["train.overlap=1", "optim.name=adam", "train.optim_state=average"], "use train.optim_state = 'local'"),
    ("", ["train.eager=true"], "train.eager = true needs train.overlap = 1"),
    ("", ["train.eager=true", "train.overlap=1", "train.outer=momentum"], "and train.outer = 'average'"),
    ("[model\n", [], "not valid TOML"),
])
def test_bad_config_is_one_clear_error(tmp_path, text, overrides, msg):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=msg) as e:
        config.load(str(f), overrides)
    assert "\n" not in str(e.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        config.load("/nonexistent.toml")


def test_frozen():
    c = config.load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.model.hidden = 3
    assert config.replace(c, "model", hidden=7).model.hidden == 7 and c.model.hidden == 128
