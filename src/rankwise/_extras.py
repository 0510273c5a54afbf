"""Optional dependencies: a clear error naming the extra that brings a missing one."""

from __future__ import annotations

import importlib
from types import ModuleType

# the application layer's packages (data sets, records, plots, the command line), pip extra "cli"
CLI_EXTRA = "pip install 'rankwise[cli]'"


def require(module: str, what: str, *, install: str = CLI_EXTRA) -> ModuleType:
    """Import `module` (e.g. ``"sklearn.datasets"``), or raise ``ImportError`` saying that
    `what` needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise ImportError(f"{what} needs the package {top!r}, which is not installed ({install})") from e
