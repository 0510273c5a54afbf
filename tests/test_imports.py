"""What importing rankwise does: the library imports neither the studies nor the command line,
and importing the studies prints no warning about kernels rankwise never runs."""

from __future__ import annotations

import pytest

import rankwise


def test_the_library_imports_neither_the_studies_nor_the_command_line():
    """Issue 41, item 8: no module of the library packages imports rankwise.experiments or
    rankwise.cli (the package's lazy namespace and ``python -m rankwise`` aside)."""
    import ast
    from pathlib import Path

    root = Path(rankwise.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] in ("experiments", "cli") or str(rel) in ("__init__.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = "." * node.level + (node.module or "")
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.lstrip(".").split(".")[0] in ("experiments", "cli")
                   or n.startswith(("rankwise.experiments", "rankwise.cli")) for n in names):
                offenders.append(str(rel))
    assert offenders == []


def test_the_optional_4bit_kernels_warning_is_not_printed():
    """Issue 41, newcomer round: every `peft`/`lm` run first printed bitsandbytes' "Failed to load
    CPU gemm_4bit_forward … pip install kernels" (kernels rankwise never runs)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed here: there is no warning to silence")
    code = "import rankwise.experiments, peft, bitsandbytes"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "gemm_4bit" not in r.stderr and "kernels" not in r.stderr, r.stderr
