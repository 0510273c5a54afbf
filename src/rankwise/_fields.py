"""One source for a configuration's settings (torch-free).

Each field of a config dataclass that a command exposes declares its one-line help once,
``tau: float = setting(0.1, help="…")``. The command line derives from the config its options'
help, defaults (``TrainConfig.tau``) and flag names (:func:`rankwise.cli._common.config_option`),
and reads the config's own validation messages with the options in place of the fields
(:func:`options_named`): a setting is added or changed in the config, not in each command.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any


def setting(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None,
            default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its `help` (one paragraph: the command line's and the docstrings'
    text) and `flag` (default: ``--`` and the field's name with dashes)."""
    meta = {"help": help} | ({"flag": flag} if flag is not None else {})
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def fields_doc(cls: type, names: Iterable[str] | None = None, indent: str = "    ") -> str:
    """The helps of `cls`'s fields (`names`, default all with one) as a docstring's list."""
    import textwrap

    out = []
    for f in dataclasses.fields(cls):
        if "help" in f.metadata and (names is None or f.name in names):
            item = textwrap.fill(f"- `{f.name}`: {f.metadata['help']}", 96, subsequent_indent="  ")
            out.append(textwrap.indent(item, indent))
    return "\n".join(out)


def _field(cls: type, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def help_of(cls: type, name: str) -> str:
    """The help declared on `cls`'s field `name` (``KeyError`` if it declared none)."""
    return _field(cls, name).metadata["help"]


def flag_of(cls: type, name: str) -> str:
    """The command-line flag of `cls`'s field `name`: declared, or ``--`` + the name with dashes."""
    return _field(cls, name).metadata.get("flag") or "--" + name.replace("_", "-")


def options_named(message: str, cls: type, *, said: Mapping[str, str] | None = None,
                  only: Iterable[str] | None = None) -> str:
    """`message` (a validation error of config `cls`) with each field of `cls` written as the
    option that sets it: `` `tau_min` `` anywhere, or a bare name that starts the message
    (``omega must be …``), becomes ``--tau-min`` (or what `said` gives for it). `only` limits this
    to the fields a command exposes (the others keep their names)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if only is not None:
        names &= set(only)
    said = dict(said or {})

    def option(name: str) -> str:
        return said.get(name) or flag_of(cls, name)

    message = re.sub(r"`(\w+)`", lambda m: option(m.group(1)) if m.group(1) in names else m.group(0), message)
    head, sep, rest = message.partition(" ")
    return f"{option(head)} {rest}" if sep and head in names else message
