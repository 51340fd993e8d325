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
    with pytest.raises(Exception):
        c.model.hidden = 3
    assert config.replace(c, "model", hidden=7).model.hidden == 7 and c.model.hidden == 128
