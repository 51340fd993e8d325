import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import time
import typing

import numpy as np
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


def test_a_saved_configuration_without_a_later_key_runs_as_it_did():
    """data.balance came after checkpoints did: a saved configuration without it split its partitions by
    paragraph count, and a resume must read it so (today's default, tokens, would split another text)."""
    c = config.load()
    assert c.data.balance == "tokens" and config.from_json(c.to_json()) == c
    old = json.loads(c.to_json())
    del old["data"]["balance"]
    assert config.from_json(json.dumps(old)) == config.replace(c, "data", balance="paragraphs")
    with pytest.raises(ConfigError, match=r"data.balance = 'count': expected one of"):
        config.load(None, ["data.balance=count"])


@pytest.mark.parametrize("text,overrides,msg", [
    ("[model]\nhiden = 3\n", [], "unknown config key model.hiden"),
    ("[modle]\n", [], "unknown config section"),
    ("[model]\nhidden = '3'\n", [], "model.hidden = '3': expected int"),
    ("", ["model.hidden=3.5"], "expected int, got float"),
    ("", ["optim.nesterov=yes"], "expected bool"),
    ("", ["model.cell=gru"], "expected one of lstm, rnn"),
    ("", ["model"], "expected section.key=value"),
    ("", ["model.dropout=1.5"], r"model.dropout = 1.5 is out of range: a run takes model.dropout in \[0, 1\)$"),
    ("", ["data.min_count=0"], r"data.min_count = 0 is out of range: .* in \[1, "),
    ("", ["data.eval_streams=0"], r"data.eval_streams = 0 is out of range: .* in \[1, 10000\]"),
    ("", ["data.sample_fraction=0"], r"data.sample_fraction = 0.0 is out of range: .* in \(0, 1\]"),
    ("", ["optim.momentum=1.0"], r"optim.momentum = 1.0 is out of range: .* in \[0, 1\)"),
    ("", ["optim.beta2=1.5"], r"optim.beta2 = 1.5 is out of range"),
    ("", ["optim.eps=0"], r"optim.eps = 0.0 is out of range: .* in \(0, 1\]"),
    ("", ["optim.lr=inf"], r"optim.lr = inf is out of range: .* in \(0, inf\)"),
    ("", ["optim.min_lr=2", "optim.lr=1"], "optim.min_lr must be in"),
    ("", ["optim.decay_after=-1"], r"optim.decay_after = -1 is out of range"),
    ("", ["train.local_steps=-1"], r"train.local_steps = -1 is out of range"),
    ("", ["train.results=tcp"], "train.results = 'tcp': expected one of spark, direct"),
    ("", ["train.outer_momentum=1"], r"train.outer_momentum = 1.0 is out of range: .* in \[0, 1\)"),
    ("", ["train.epochs=nan"], r"train.epochs = nan is out of range"),
    ("", ["model.init_scale=0"], r"model.init_scale = 0.0 is out of range: .* in \(0, 100\]"),
    ("", ["exchange.hidden=dense+onebit"], "without exchange.feedback = true"),
    ("", ["exchange.softmax=rows+fp8"], "expected one of dense, dense[+]fp16"),
    ("", ["exchange.random=1.5"], r"exchange.random = 1.5 is out of range: .* in \[0, 1\]"),
    ("", ["exchange.mu=-0.1"], r"exchange.mu = -0.1 is out of range"),
    ("", ["exchange.broadcast=delta+onebit"], "exchange.broadcast"),
    ("", ["train.overlap=2"], r"train.overlap = 2 is out of range: .* in \[0, 1\]"),
    ("", ["train.overlap=1", "optim.name=adam", "train.optim_state=average"], "use train.optim_state = 'local'"),
    ("", ["train.eager=true"], "train.eager = true needs train.overlap = 1"),
    ("", ["train.eager=true", "train.overlap=1", "train.outer=momentum"], "and train.outer = 'average'"),
    ("[model\n", [], "not valid TOML"),
    # sections that are not tables of keys
    ("train = 5\n", [], r"c.toml: train must be a table of keys \(\[train\]\), not int$"),
    ('train = "ab"\n', ["train.rounds=2"], r"train must be a table of keys \(\[train\]\), not str$"),
    ('data = [["train", "x.txt"]]\n', [], r"data must be a table of keys \(\[data\]\), not an array$"),
    ("[[train]]\nrounds = 5\nbptt = 3\n", [], r"train must be a table of keys \(\[train\]\), not an array$"),
    # nested a thousand deep (a RecursionError traceback), a partition count past float's range (OverflowError)
    ("[train]\nrounds = " + "[" * 1000 + "]" * 1000 + "\n", [], "c.toml nests arrays or tables too deeply"),
    ("", ["train.rounds=" + "[" * 1000 + "]" * 1000], "train.rounds = '.*: expected int, got str$"),
    ("[train]\nouter = \"auto\"\n", ["data.partitions=1" + "0" * 400],
     r"data.partitions = a number of about 401 digits is out of range: a run takes data.partitions in \[1, 10000\]"),
])
def test_bad_config_is_one_clear_error(tmp_path, text, overrides, msg):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=msg) as e:
        config.load(str(f), overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["[]", "1", "null", '{"train": 5}', "[" * 3000 + "]" * 3000])
def test_a_saved_configuration_that_is_not_tables_of_keys_is_a_config_error(text):
    """A checkpoint's config.json of [] or 1 was an AttributeError or TypeError, nested deep a RecursionError."""
    with pytest.raises(ConfigError, match="^the configuration (is not a table of sections|nests too deeply)"):
        config.from_json(text)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        config.load("/nonexistent.toml")


def test_a_config_that_cannot_be_read_as_utf8_toml_says_so(tmp_path):
    """A directory or a file of another encoding: one line naming it (a directory was a traceback, and
    UTF-16 read as "a number of more than 4300 digits")."""
    with pytest.raises(ConfigError, match=r"^cannot read config file .*: Is a directory$"):
        config.load(str(tmp_path))
    f = tmp_path / "utf16.toml"
    f.write_bytes("[train]\nrounds = 2\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=r"utf16.toml is not UTF-8 text \(byte 0\): TOML is UTF-8$"):
        config.load(str(f))


def test_frozen():
    c = config.load()
    for section in (c, c.data, c.model, c.optim, c.train, c.server, c.exchange):
        with pytest.raises(dataclasses.FrozenInstanceError):
            section.seed = 3
    assert config.replace(c, "model", hidden=7).model.hidden == 7 and c.model.hidden == 128
    lines = c.to_json().splitlines()                     # config.json: sorted, two spaces deep
    assert lines[:3] == ["{", '  "data": {', '    "balance": "tokens",']


def _numeric_keys(kind):
    return [(s, k) for s, cls in typing.get_type_hints(config.Config).items()
            for k, t in typing.get_type_hints(cls).items() if t is kind]


@pytest.mark.parametrize("section,key", _numeric_keys(float))
def test_a_number_too_large_for_a_float_is_one_line(section, key):
    """1 followed by 400 zeros ended in OverflowError (config._coerce) for every float key."""
    with pytest.raises(ConfigError) as e:
        config.load(None, [f"{section}.{key}=1{'0' * 400}"])
    assert str(e.value).startswith(f"{section}.{key} = a number of about 401 digits is out of range: a run takes "
                                   f"{section}.{key} in "), str(e.value)


def test_a_number_of_more_digits_than_python_converts_is_one_line(tmp_path):
    """5,000 nines ended in ValueError: Exceeds the limit (4300 digits), from --set or a file."""
    with pytest.raises(ConfigError, match=r"^model.hidden: a number of 5000 characters is out of range: "
                                          r"a run takes model.hidden in \[1, 65536\]$"):
        config.load(None, ["model.hidden=" + "9" * 5000])
    f = tmp_path / "c.toml"
    f.write_text("[model]\nhidden = " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"holds a number of more than 4300 digits: out of range for every key$"):
        config.load(str(f))


# a value at a bound can break a rule tying it to another key: set that key too
_PARTNERS = {("server", "heartbeat_s"): ["server.timeout_s=86400"], ("train", "rounds"): ["train.epochs=1"],
             ("train", "epochs"): ["train.rounds=1"], ("train", "overlap"): ["optim.name=sgd"]}


def test_every_number_has_a_range_and_a_value_beyond_it_is_refused_naming_it():
    numeric = _numeric_keys(int) + _numeric_keys(float)
    assert sorted(config.RANGES) == sorted(numeric)
    for (section, key), (low, high, brackets) in config.RANGES.items():
        step = 1 if (section, key) in _numeric_keys(int) else 0.5
        beyond = [low - step] + ([high + step, high * 1000 + 1] if high != math.inf else [])
        for value in beyond:
            with pytest.raises(ConfigError) as e:
                config.load(None, [f"{section}.{key}={value}"] + _PARTNERS.get((section, key), []))
            assert str(e.value).startswith(f"{section}.{key} = ") and "is out of range" in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides,msg", [
    (["train.rounds=0", "train.epochs=1e308"], r"train.epochs = 1e\+308 is out of range: a run takes train.epochs "
                                               r"in \[0, 10000\]"),
    (["model.init_scale=1e308"], r"model.init_scale = 1e\+308 is out of range: .* in \(0, 100\]"),
    (["model.hidden=1000000000"], r"model.hidden = 1000000000 is out of range: .* in \[1, 65536\]"),
    (["model.layers=1000000"], r"model.layers = 1000000 is out of range: .* in \[1, 64\]"),
    (["model.layers=10000000"], r"model.layers = 10000000 is out of range"),
    (["server.timeout_s=1e300"], r"server.timeout_s = 1e\+300 is out of range: .* in \(0, 86400\]"),
    (["server.heartbeat_s=3600.5", "server.timeout_s=86400"],
     r"server.heartbeat_s = 3600.5 is out of range: .* in \(0, 3600\]"),
    (["model.cell=ffnn", "model.embed=5", "model.biases=two"], r"model.biases = 'two' is for the lstm and rnn"),
])
def test_values_that_crashed_after_spark_started_are_refused_by_the_validator(overrides, msg):
    """Each passed the validator and failed after Spark and the corpus (OverflowError, ValueError: array is
    too big, 20 s and 1.4 GB to build the layout of a million layers)."""
    with pytest.raises(ConfigError, match=msg):
        config.load(None, overrides)


def test_the_model_size_is_checked_against_memory_without_building_it():
    from rnnlm.core.models import build
    for sets in (["model.cell=lstm", "model.embed=7", "model.layers=3"], ["model.cell=rnn"],
                 ["model.cell=lstm", "model.layers=2", "model.biases=two"],
                 ["model.cell=ffnn", "model.embed=5", "model.context=4"]):
        m = config.load(None, sets + ["model.hidden=9", "model.vocab_size=13"]).model
        assert config.param_count(m) == build(m).layout.size, sets
    cfg = config.load(None, ["model.hidden=32", "optim.name=adam", "data.vocab_size=50"])
    need = config.param_count(cfg.model, 50) * 4 * 4              # params, gradient, adam's m and v; float32
    config.check_memory(cfg, memory=need)
    with pytest.raises(ConfigError, match=rf"^the model has {config.param_count(cfg.model, 50):,} parameters "
                                          r"\(vocabulary 50\): with its gradient and adam's state it needs "):
        config.check_memory(cfg, memory=need - 1)
    with pytest.raises(ConfigError, match="vocabulary 1,000"):      # the vocabulary, once known, is checked again
        config.check_memory(config.replace(cfg, "model", vocab_size=1000), memory=need)
    with pytest.raises(ConfigError, match=r"\(vocabulary 10,000,000\): with its gradient"):     # as trainers resolve it
        config.resolve(config.load(None, ["model.hidden=4096"]), 10_000_000)          # 3 TB: beyond any machine
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="more than this machine's"):           # 17 TB: beyond any machine
        config.check_trainable(config.load(None, ["model.hidden=65536", "model.layers=64"]))
    assert time.perf_counter() - t0 < 3.0          # refused from the arithmetic, not by allocating
    # a checkpoint of such a model still loads (to sample or score where it fits): only training checks
    config.from_json(config.load(None, ["model.hidden=65536", "model.layers=64"]).to_json())


@pytest.mark.parametrize("overrides,text", [
    (["data.train=/x\nerror: forged"], ""),
    (["model.hidden=64\nlayers = 9"], ""),
    (["data.valid=\x1b[31mred"], ""),
    ([], '[data]\ntrain = "a\\nerror: forged"\n'),
    ([], '[data]\ntrain = "a\\u001b[2Jb"\n'),
    (["data.train=/x\u2028error: forged"], ""),
    (["data.test=/x/\u202etxt.tset"], ""),
    ([], '[data]\ntrain = "a\\u2029b"\n'),
])
def test_a_control_character_in_a_value_is_refused(tmp_path, overrides, text):
    """A newline printed a forged second error: line; in a number it silently dropped ``layers = 9``."""
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"the value holds a control character \(U\+(000A|001B|2028|2029|202E)\); "
                                          r"refused$") as e:
        config.load(str(f), overrides)
    assert not any(c in str(e.value) for c in "\n\x1b\u2028\u2029\u202e")


@pytest.mark.parametrize("text, shown", [
    ('[train]\n"\\u001b[31mred\\u202etxt" = 1\n', r"unknown config key train.'\x1b[31mred\u202etxt'; "),
    ('["\\u001b[2Jx"]\nrounds = 1\n', r"unknown config section ['\x1b[2Jx']; "),
    ("[train]\n" + "k" * 5000 + " = 1\n", "unknown config key train.'" + "k" * 61 + "; "),
])
def test_an_unknown_name_is_shown_escaped_and_cut(tmp_path, text, shown):
    """A key's or a section's name was printed as written: ESC recoloured the terminal, U+202E reversed the
    line, a name of megabytes filled it."""
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        config.load(str(f))
    assert str(e.value).startswith(shown), str(e.value)[:200]
    assert not any(c in str(e.value) for c in "\n\x1b\u202e")


def test_a_config_file_saved_with_a_byte_order_mark_loads_and_a_damaged_saved_one_is_one_line(tmp_path):
    """Windows editors write a BOM: "not valid TOML: Invalid statement (at line 1, column 1)". A checkpoint's
    config.json that is not JSON, or holds a 5,000-digit number, said Python's words without naming the file."""
    f = tmp_path / "bom.toml"
    f.write_bytes(b"\xef\xbb\xbf[train]\nrounds = 7\n")
    assert config.load(str(f)).train.rounds == 7
    for text, said in (("{x", "Expecting property name enclosed in double quotes"),
                       ('{"train": ' + "1" * 5000 + "}", "Exceeds the limit (4300 digits) for integer string "
                                                         "conversion")):
        with pytest.raises(ConfigError) as e:
            config.from_json(text)
        assert str(e.value) == f"config.json is not a configuration's JSON ({said})"


def test_a_config_file_is_a_regular_file_of_at_most_1_mib_checked_before_it_is_read(tmp_path):
    """``--config /dev/zero`` read until memory ran out; a FIFO blocked the command for ever."""
    os.mkfifo(tmp_path / "fifo.toml")
    for path in ("/dev/zero", str(tmp_path / "fifo.toml")):
        with pytest.raises(ConfigError, match=f"^config file {path} is not a regular file$"):
            config.load(path)
    big = tmp_path / "big.toml"
    big.write_text("#" * config.MAX_CONFIG_FILE + "\n")
    with pytest.raises(ConfigError, match=r"big.toml is over 1 MiB: not a configuration$"):
        config.load(str(big))
    big.write_text("#" * (config.MAX_CONFIG_FILE - 20) + "\n[train]\nrounds = 7\n")     # 1 MiB exactly: taken
    assert big.stat().st_size == config.MAX_CONFIG_FILE and config.load(str(big)).train.rounds == 7


def test_a_config_file_that_holds_more_than_its_size_said_is_refused_not_cut(tmp_path, monkeypatch):
    """A file that grows while read, or one of /proc's (which say 0 bytes): its first MiB was parsed,
    and a table cut at the limit could load with keys missing."""
    big = tmp_path / "growing.toml"
    big.write_text("[train]\nrounds = 7\n" + "#" * config.MAX_CONFIG_FILE + "\n")
    real = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((*real(fd)[:6], 0, *real(fd)[7:])))   # says 0 bytes
    with pytest.raises(ConfigError, match=r"growing.toml is over 1 MiB: not a configuration$"):
        config.load(str(big))


def test_joiners_and_other_format_characters_of_real_names_are_taken():
    """A zero-width non-joiner (U+200C) is part of Persian words, a joiner (U+200D) of emoji: a path
    holding one is a name, and a checkpoint that saved it must load."""
    for name in ("/data/\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645.txt", "/data/\U0001f469\u200d\U0001f4bb.txt",
                 "/data/co\u00adop.txt"):
        cfg = config.load(None, [f"data.train={name}"])
        assert cfg.data.train == name and config.from_json(cfg.to_json()).data.train == name


def test_global_batch_splits_between_the_partitions_and_a_saved_config_loads_back():
    # strong scaling: G streams in all, G // P per partition (the nearest below G in all)
    got = {P: config.load(None, [f"data.partitions={P}", "train.global_batch=20"]).train.batch
           for P in (1, 2, 3, 8, 16, 20)}
    assert got == {1: 20, 2: 10, 3: 6, 8: 2, 16: 1, 20: 1}
    # fewer than one stream each: 40 partitions trained one each, twice the global batch asked for; a
    # checkpoint saved so before this was refused still loads (only training checks)
    few = config.load(None, ["data.partitions=40", "train.global_batch=20"])
    assert config.from_json(few.to_json()) == few
    with pytest.raises(ConfigError, match=r"^train.global_batch = 20 is fewer streams than data.partitions = 40 "):
        config.check_trainable(config.replace(few, "data", train="x.txt"))
    c = config.load(None, ["data.partitions=8", "train.global_batch=20", "train.batch=2"])   # the same, said twice
    assert config.from_json(c.to_json()) == c and c.train.batch == 2
    assert config.load(None, ["train.batch=7"]).train.batch == 7       # global_batch = 0: batch is per partition
    with pytest.raises(ConfigError, match=r"^train.batch = 10 contradicts train.global_batch = 20 on 8 partitions "
                                          r"\(2 streams each\): set train.global_batch = 0 to use train.batch, "
                                          r"or leave train.batch out \(of the config file and --set\) to use "
                                          r"train.global_batch$"):
        config.load(None, ["data.partitions=8", "train.global_batch=20", "train.batch=10"])


def test_outer_auto_follows_the_partitions_keeps_what_the_user_set_and_loads_back_resolved():
    def outer(*sets):
        t = config.load(None, ["train.outer=auto", *sets]).train
        return t.outer, t.outer_lr, t.outer_momentum
    assert outer("data.partitions=1") == outer("data.partitions=2") == ("average", 1.0, 0.9)
    assert [outer(f"data.partitions={p}") for p in (3, 4, 8, 16)] == [
        ("nesterov", 1.0, 0.3333), ("nesterov", 1.0, 0.5), ("nesterov", 1.0, 0.75), ("nesterov", 1.0, 0.875)]
    assert outer("data.partitions=8", "train.outer_lr=0.7") == ("nesterov", 0.7, 0.75)
    assert outer("data.partitions=8", "train.outer_momentum=0.9") == ("nesterov", 1.0, 0.9)
    assert outer("data.partitions=8", "train.mode=async", "exchange.broadcast=rows") == ("average", 1.0, 0.9)
    c = config.load(None, ["train.outer=auto", "data.partitions=8"])
    assert config.from_json(c.to_json()) == c and c.train.outer == "nesterov"      # a checkpoint holds the step
    # strong scaling: the streams in all stay those of 2 partitions, so the mean moves as far per token
    assert outer("data.partitions=8", "train.global_batch=20") == ("average", 1.0, 0.9)


def test_max_streams_caps_the_streams_in_all_and_the_outer_step_follows_the_streams_not_the_partitions():
    def got(P, *sets):
        t = config.load(None, ["train.outer=auto", "train.batch=10", "train.max_streams=80",
                               f"data.partitions={P}", *sets]).train
        return t.batch, t.outer, t.outer_momentum
    assert [got(P) for P in (1, 2, 4, 8, 12, 16, 100)] == [
        (10, "average", 0.9), (10, "average", 0.9), (10, "nesterov", 0.5), (10, "nesterov", 0.75),
        (6, "nesterov", 0.7222), (5, "nesterov", 0.75), (1, "nesterov", 0.8)]
    c = config.load(None, ["train.outer=auto", "train.batch=10", "train.max_streams=80", "data.partitions=16"])
    assert config.from_json(c.to_json()) == c          # a checkpoint holds batch 5 and momentum 0.75
    assert config.load(None, ["train.batch=10", "train.max_streams=80", "data.partitions=16"]).train.outer \
        == "average"                                   # the cap alone leaves the outer step as set
    with pytest.raises(ConfigError, match=r"^train.global_batch and train.max_streams: set one"):
        config.load(None, ["train.global_batch=20", "train.max_streams=80"])


def _documented_ranges():
    """``docs/usage.md``'s table of ranges: {(section, key): (low, high, brackets)}, read as a user reads it
    (a range applies to the keys listed before it: `` `bptt`, `batch` [1, 100000]``)."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    table = text[text.index("| section | ranges"):]
    table = table[:table.index("\n\n")]
    named = {"inf": math.inf, "10^12": 10 ** 12, "10^9": 10 ** 9, "2^63 - 1": 2 ** 63 - 1}
    token = re.compile(r"`(\w+)`|([\[(])([^,]+), ([^\])]+)([\])])")
    out = {}
    for row in table.splitlines()[2:]:
        section, cell = re.fullmatch(r"\| `\[(\w+)\]` \| (.*) \|", row).groups()
        keys = []
        for key, opening, low, high, closing in token.findall(cell):
            if key:
                keys.append(key)
                continue
            bounds = [named[v] if v in named else (int(v) if re.fullmatch(r"-?\d+", v) else float(v))
                      for v in (low.strip(), high.strip())]
            out.update({(section, k): (*bounds, opening + closing) for k in keys})
            keys = []
    return out


def test_the_ranges_usage_md_states_are_the_ones_a_run_takes():
    """Each documented bound probed: a value at an inclusive bound (or just inside an exclusive one)
    is not refused as out of range, one at an exclusive bound (or just beyond an inclusive one) is
    refused naming its key. Companion keys are set where another rule would refuse an inside value."""
    documented = _documented_ranges()
    ints = set(_numeric_keys(int))
    assert sorted(documented) == sorted(_numeric_keys(int) + _numeric_keys(float))
    for (section, key), (low, high, brackets) in documented.items():
        where = f"{section}.{key}"
        step = 1 if (section, key) in ints else 0.5 * min(1.0, (high - low) / 2)
        inside = [low if brackets[0] == "[" else low + step]
        outside = [low if brackets[0] == "(" else low - step]
        if brackets[1] == "]":
            inside.append(high)
            outside.append(high + step)
        else:
            inside.append(high - step if high < math.inf else sys.float_info.max)
            outside.append(high)
        for value in inside:
            extra = {"server.heartbeat_s": ["server.timeout_s=86400"],
                     "server.timeout_s": [f"server.heartbeat_s={value / 2}"],
                     "optim.min_lr": [f"optim.lr={max(value, 1.0)}"],
                     "train.epochs": ["train.rounds=1"]}.get(where, [])
            try:
                config.load(None, [f"{where}={value}", *extra])
            except ConfigError as e:
                assert f"{where} = " not in str(e) or "out of range" not in str(e), (where, value, str(e))
        for value in outside:
            with pytest.raises(ConfigError, match=re.escape(key)):          # "optim.clip_norm and clip_value ..."
                config.load(None, [f"{where}={value}"])


def test_a_value_at_each_bound_is_taken_or_refused_as_its_bracket_says():
    for (section, key), (low, high, brackets) in config.RANGES.items():
        typ = int if (section, key) in _numeric_keys(int) else float
        for value, inclusive in ((low, brackets[0] == "["), (high, brackets[1] == "]")):
            if value == math.inf:
                continue
            sets = [f"{section}.{key}={typ(value)!r}"] + _PARTNERS.get((section, key), [])
            if inclusive:
                assert getattr(getattr(config.load(None, sets), section), key) == value, sets
            else:
                with pytest.raises(ConfigError, match=f"^{section}.{key} = .* is out of range"):
                    config.load(None, sets)


@pytest.mark.parametrize("sets,msg", [
    (["data.vocab_size=2"], "data.vocab_size must be 0"),
    (["exchange.hidden=rows", "exchange.random=0"], "set exchange.random > 0"),
    (["model.cell=ffnn", "model.embed=0"], "model.cell = 'ffnn' needs"),
    (["model.cell=ffnn", "model.embed=4", "model.layers=2"], "model.cell = 'ffnn' needs"),
    (["model.cell=ffnn", "model.embed=4", "model.dropout=0.1"], "model.cell = 'ffnn' needs"),
    (["model.cell=ffnn", "model.embed=4", "exchange.sampled_softmax=true"], "model.cell = 'ffnn' needs"),
    (["train.global_batch=8", "train.max_streams=8"], "set one"),
    (["train.rounds=0", "train.epochs=0"], "set train.rounds or train.epochs"),
    (["train.mode=async", "data.strategy=sampled_windows"], "train.mode = 'async' needs"),
    (["train.mode=async", "exchange.broadcast=delta"], "train.mode = 'async' needs"),
    (["train.mode=async", "train.outer=momentum"], "train.mode = 'async' needs"),
    (["train.mode=async", "optim.schedule=plateau"], "no rounds to decay on a plateau"),
    (["train.mode=async", "train.patience=2"], "train.patience ends a run of synchronous rounds early"),
    (["train.mode=async", "train.overlap=1", "train.optim_state=local"], "train.overlap and train.eager shape"),
    (["train.mode=async", "train.overlap=1", "train.eager=true", "train.optim_state=local"],
     "train.overlap and train.eager shape"),
    (["server.heartbeat_s=60", "server.timeout_s=60"], "need heartbeat_s < timeout_s"),
    (["server.stall_factor=0.999"], "stall_factor is 0 (no stall watch) or at least 1"),
    (["data.strategy=sampled_paragraphs", "train.local_steps=1"], "train.local_steps = 1 contradicts"),
])
def test_the_rules_that_tie_keys_together(sets, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        config.load(None, sets)


@pytest.mark.parametrize("sets", [
    ["data.vocab_size=3"], ["exchange.hidden=rows", "exchange.random=0.1"],
    ["model.cell=ffnn", "model.embed=1"], ["train.global_batch=8"], ["train.rounds=0", "train.epochs=0.5"],
    ["train.rounds=1", "train.epochs=0"], ["train.mode=async", "data.strategy=windows"],
    ["server.heartbeat_s=59.5", "server.timeout_s=60"], ["data.strategy=sampled_windows", "train.local_steps=0"],
])
def test_what_the_rules_allow(sets):
    config.load(None, sets)


def test_streams_each_partition_trains():
    T = config.TrainConfig
    assert config.streams_each(T(batch=20), 4) == 20                              # weak scaling
    assert config.streams_each(T(batch=20, global_batch=64), 3) == 21           # strong: 64 split, rounded down
    assert config.streams_each(T(batch=20, global_batch=1), 1) == 1
    assert config.streams_each(T(batch=20, global_batch=2), 4) == 1             # at least one
    assert config.streams_each(T(batch=20, max_streams=48), 2) == 20            # under the cap
    assert config.streams_each(T(batch=20, max_streams=48), 4) == 12            # at the cap, split
    assert config.streams_each(T(batch=20, max_streams=1), 1) == 1
    assert config.load(None, ["train.global_batch=8", "data.partitions=1"]).train.batch == 8    # set at load


@pytest.mark.parametrize("sets", [["train.outer=auto"], ["train.global_batch=8"], ["train.max_streams=8"],
                                  ["train.outer=auto", "train.global_batch=8"]])
def test_no_partitions_is_out_of_range_before_streams_are_split(sets):
    with pytest.raises(ConfigError, match=r"^data.partitions = 0 is out of range"):
        config.load(None, sets + ["data.partitions=0"])


def test_a_huge_number_is_shown_by_its_size_past_128_bits():
    with pytest.raises(ConfigError, match=f"^model.hidden = {2 ** 128 - 1} is out of range"):
        config.load(None, [f"model.hidden={2 ** 128 - 1}"])
    with pytest.raises(ConfigError, match="^model.hidden = a number of about 39 digits is out of range"):
        config.load(None, [f"model.hidden={2 ** 128}"])


@pytest.mark.parametrize("item,msg", [
    ("hidden=3.5", "--set 'hidden=3.5': expected section.key=value (did you mean model.hidden=3.5?)"),
    ("hidden", "--set 'hidden': expected section.key=value"),
    ("model.hidden", "--set 'model.hidden': expected section.key=value"),
    ("model.hiden=3", "unknown config key model.hiden (did you mean model.hidden?); known in [model]: "),
    ("model.rounds=3", "unknown config key model.rounds (did you mean train.rounds?); known in [model]: "),
])
def test_a_mistyped_override_names_what_was_meant(item, msg):
    with pytest.raises(ConfigError) as e:
        config.load(None, [item])
    if msg.endswith(": "):                                   # the section's keys follow
        assert str(e.value).startswith(msg), str(e.value)
    else:
        assert str(e.value) == msg


@pytest.mark.parametrize("value,got", [(True, "bool"), ("x", "str"), ([1.0], "list")])
def test_a_float_key_takes_numbers_only(value, got):
    with pytest.raises(ConfigError, match=f"^optim.lr = .*: expected float, got {got}$"):
        config.from_dict({"optim": {"lr": value}})


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "adam"])
@pytest.mark.parametrize("dtype,size", [("float32", 4), ("float64", 8)])
def test_the_memory_check_counts_each_optimizers_state_and_the_dtype(name, dtype, size):
    """Parameters, gradient and the optimizer's slots, as its init_state allocates them."""
    from rnnlm.core.optim import make_optimizer
    cfg = config.load(None, ["model.hidden=4096", f"optim.name={name}", f"model.dtype={dtype}"])   # no vocabulary
    slots = len([k for k in make_optimizer(cfg.optim).init_state(np.zeros(3)) if k != "t"])
    assert config.OPTIMIZER_SLOTS[name] == slots
    need = config.param_count(cfg.model, 3) * (2 + slots) * size          # 3 tokens: the least there is
    config.check_memory(cfg, memory=need)
    with pytest.raises(ConfigError, match=rf"\(vocabulary 3\).* it needs {need / 2 ** 30:,.1f} GiB, more than this "
                                          rf"machine's {(need - 1) / 2 ** 30:,.1f} GiB"):
        config.check_memory(cfg, memory=need - 1)


def test_this_machines_memory_and_what_training_needs_beyond_the_ranges():
    assert config.memory_bytes() >= 1 << 30                       # any machine that runs these tests
    config.load(None, ["optim.min_lr=0.5", "optim.lr=0.5"])       # the floor may be the rate
    run = config.load(None, ["data.train=t.txt"])
    config.check_trainable(run)
    with pytest.raises(ConfigError, match="^data.train is not set$"):
        config.check_trainable(config.replace(run, "data", train=""))
    plateau = config.replace(run, "optim", schedule="plateau")
    with pytest.raises(ConfigError, match="set data.valid$"):
        config.check_trainable(config.replace(plateau, "data", valid=""))
    config.check_trainable(config.replace(plateau, "data", valid="v.txt"))
    patient = config.replace(run, "train", patience=3, eval_every=1)
    with pytest.raises(ConfigError, match=r"^train.patience = 3 ends the run when the validation loss stops "
                                          r"improving: set data.valid$"):
        config.check_trainable(patient)
    config.check_trainable(config.replace(patient, "data", valid="v.txt"))
    with pytest.raises(ConfigError, match=r"^train.patience = 3 counts evaluations, and train.eval_every = 0 makes "
                                          r"one, once the run has ended: set train.eval_every$"):
        config.check_trainable(config.replace(config.replace(patient, "data", valid="v.txt"), "train", eval_every=0))
    config.check_trainable(config.replace(run, "data", valid=""))         # constant: no validation needed


@pytest.mark.parametrize("key", ["optim.lr", "optim.eps", "server.lr", "server.eps"])
def test_a_rate_or_epsilon_below_the_parameters_types_normal_numbers_is_refused(key):
    """optim.eps = 1e-50 passed (0, 1] in float64 and was 0 in the float32 state: Adam's 0 / 0 for a parameter
    whose gradient is 0 read as "loss became nan"; a learning rate as small trained without moving."""
    assert np.finfo(np.float32).tiny == config.TINY["float32"] and np.finfo(np.float64).tiny == config.TINY["float64"]
    mode = ["train.mode=async"] if key.startswith("server.") else []      # the server's keys: read in async alone
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} = 1e-50 is below model.dtype = float32's smallest "
                                          r"normal number \(1.18e-38\), 0 or nearly"):
        config.load(None, [f"{key}=1e-50", *mode])
    section, name = key.split(".")
    assert getattr(getattr(config.load(None, [f"{key}=1e-50", "model.dtype=float64", *mode]), section), name) == 1e-50
    assert getattr(getattr(config.load(None, [f"{key}=1e-30", *mode]), section), name) == 1e-30
    if mode:                                                               # a sync run never reads them
        assert getattr(getattr(config.load(None, [f"{key}=1e-50"]), section), name) == 1e-50
