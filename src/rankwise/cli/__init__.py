"""The ``rankwise`` command line; a thin typer app (:func:`main` is the console script).

It needs the ``rankwise[cli]`` extra (typer, rich, TensorBoard, matplotlib, scikit-learn,
mnist1d); without it, :func:`main` says so in one line and returns 1.
"""

from __future__ import annotations

import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    """Run the command line (see :func:`rankwise.cli._app.main`)."""
    from .._extras import require

    for module in ("typer", "rich"):
        try:
            require(module, "the command line")
        except ImportError as e:
            print(f"rankwise: error: {e}", file=sys.stderr)
            return 1
    from ._app import main as _main

    return _main(argv)


def __getattr__(name: str) -> Any:
    if name == "app":
        from ._app import app

        return app
    raise AttributeError(f"module 'rankwise.cli' has no attribute {name!r}")
