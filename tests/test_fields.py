"""Issue 41, item 8: a config is the one source of its settings. The command line takes each
option's flag, help and default from the config's field, and names options (not fields) in the
config's own validation messages."""

from __future__ import annotations

import dataclasses

import pytest
import typer

from rankwise._fields import flag_of, help_of, options_named, setting
from rankwise.train_config import TrainConfig


@dataclasses.dataclass(frozen=True)
class _Cfg:
    tau_min: float = setting(0.0, help="A floor.")
    c: int = setting(8, help="Columns.", flag="--columns")
    hidden: int = 3


def test_setting_is_a_field_with_its_help_and_flag():
    assert _Cfg().tau_min == 0.0 and _Cfg.c == 8
    assert help_of(_Cfg, "tau_min") == "A floor." and flag_of(_Cfg, "tau_min") == "--tau-min"
    assert flag_of(_Cfg, "c") == "--columns" and flag_of(_Cfg, "hidden") == "--hidden"
    with pytest.raises(KeyError):
        help_of(_Cfg, "hidden")
    with pytest.raises(KeyError):
        help_of(_Cfg, "nope")


def test_options_named_rewrites_fields_only():
    msg = "`tau_min` must be in [0, tau]; `c` too; `other` and `hidden` stay"
    assert options_named(msg, _Cfg, only=("tau_min", "c")) == (
        "--tau-min must be in [0, tau]; --columns too; `other` and `hidden` stay")
    assert options_named("hidden must be >= 1", _Cfg) == "--hidden must be >= 1"  # a bare leading name
    assert options_named("hidden must be >= 1", _Cfg, only=()) == "hidden must be >= 1"
    assert options_named("`c` is 0", _Cfg, said={"c": "C in --grid"}) == "C in --grid is 0"


def test_the_train_command_takes_its_options_from_train_config():
    from rankwise.cli._app import app

    train = typer.main.get_command(app).commands["train"]
    derived = {f.name for f in dataclasses.fields(TrainConfig) if "help" in f.metadata}
    params = {p.name: p for p in train.params}
    assert derived <= set(params), derived - set(params)
    for name in derived:
        p = params[name]
        assert p.help == help_of(TrainConfig, name), name
        assert flag_of(TrainConfig, name) in p.opts, name
        if name != "tau":  # (None on the command line: "not given", so that dense can refuse it)
            default = getattr(TrainConfig, name)
            assert p.default == (default.value if hasattr(default, "value") else default) or \
                str(p.default) == str(default), name
