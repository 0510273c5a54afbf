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


def _ode_spec():
    from rankwise.experiments._ode_spec import OdeRunConfig

    return OdeRunConfig


def _lm_spec():
    from rankwise.experiments.lm._lm_spec import LmRunSpec

    return LmRunSpec


def _peft_spec():
    from rankwise.experiments.peft._peft_spec import PeftRunSpec

    return PeftRunSpec


@pytest.mark.parametrize("command,config", [("train", lambda: TrainConfig), ("ode", _ode_spec),
                                            ("lm", _lm_spec), ("peft", _peft_spec)])
def test_commands_take_their_options_from_their_config(command, config):
    from rankwise.cli._app import app

    cls = config()
    cmd = typer.main.get_command(app).commands[command]
    derived = {f.name for f in dataclasses.fields(cls) if "help" in f.metadata}
    params = {p.name: p for p in cmd.params}
    assert derived <= set(params), derived - set(params)
    for name in derived:
        p = params[name]
        assert p.help == help_of(cls, name), name
        assert flag_of(cls, name).split("/")[0] in p.opts, name
        if name != "tau":  # (train: None on the command line, "not given", so that dense can refuse it)
            default = getattr(cls, name)
            assert p.default == default or str(p.default) == str(default), name


def test_the_ode_and_lm_specs_are_torch_free_and_agree_with_the_model():
    import subprocess
    import sys

    code = ("import sys; from rankwise.experiments._ode_spec import OdeRunConfig; OdeRunConfig(); "
            "from rankwise.experiments.lm._lm_spec import LmRunSpec; LmRunSpec('dense'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    from rankwise.experiments._ode_spec import RECURRENCES
    from rankwise.ode._gated import RECURRENCES as MODEL_RECURRENCES

    assert RECURRENCES == MODEL_RECURRENCES
