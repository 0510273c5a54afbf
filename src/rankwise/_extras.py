"""Optional dependencies: a clear error naming the extra that brings a missing one."""

from __future__ import annotations

import importlib
import logging
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


def quiet_optional_logs() -> None:
    """Silence one import-time warning of a dependency of a dependency: bitsandbytes (pulled in by
    peft and galore-torch) logs "Failed to load CPU gemm_4bit_forward ... pip install kernels" on
    CPUs with AVX512-BF16 when its optional `kernels` package is absent, and with `kernels`
    present and the Hub offline (as here), `kernels` logs "Skipping publisher trust check for
    'kernels-community/quantization-bitsandbytes'". Both concern 4-bit matrix products rankwise
    never runs. Called by the command line and the experiments only (the library leaves other
    packages' logging alone)."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logging.getLogger("kernels").setLevel(logging.ERROR)
