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


def _module_graph() -> dict[str, set[str]]:
    """rankwise's modules -> the rankwise modules each imports, anywhere in it (inside functions
    and ``TYPE_CHECKING`` blocks too); importing ``a.b.c`` runs ``a.b`` first, so it counts too
    (a module's own ancestors aside: they always run first)."""
    import ast
    from pathlib import Path

    src = Path(rankwise.__file__).parent.parent
    mods = {}
    for p in (src / "rankwise").rglob("*.py"):
        parts = list(p.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, (p, is_pkg) in mods.items():
        pkg = m if is_pkg else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                parts = t.split(".")
                for i in range(1, len(parts) + 1):
                    x = ".".join(parts[:i])
                    if x in mods and x != m and not m.startswith(x + "."):
                        graph[m].add(x)
    return graph


def test_no_import_circles_not_even_inside_functions():
    graph = _module_graph()
    seen: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for n in sorted(graph[m]):
            if n == "rankwise":  # (the package's lazy namespace)
                continue
            if seen.get(n) == 1:
                circles.append([*path[path.index(n):], n])
            elif n not in seen:
                visit(n, [*path, n])
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m, [m])
    assert circles == []


@pytest.mark.parametrize(("package", "never"), [
    ("rankwise.nn", ("rankwise.optim", "rankwise.peft", "rankwise.ode", "rankwise.ckpt", "rankwise.train")),
    ("rankwise.optim", ("rankwise.peft", "rankwise.ode", "rankwise.ckpt", "rankwise.train")),
    ("rankwise.ode", ("rankwise.nn", "rankwise.optim", "rankwise.peft", "rankwise.ckpt", "rankwise.train")),
    ("rankwise.ckpt", ("rankwise.nn", "rankwise.optim", "rankwise.peft", "rankwise.ode", "rankwise.train")),
    ("rankwise.peft", ("rankwise.ode", "rankwise.ckpt", "rankwise.train")),
])
def test_the_packages_import_in_one_direction(package, never):
    """docs/layout.md's map: optim → nn, peft → nn and optim; ode and ckpt import neither."""
    graph = _module_graph()
    bad = sorted((m, n) for m, ns in graph.items() if m == package or m.startswith(package + ".")
                 for n in ns if any(n == x or n.startswith(x + ".") for x in never))
    assert bad == []


@pytest.mark.parametrize("name", ["rankwise.nn", "rankwise.optim", "rankwise.dist", "rankwise.ckpt",
                                  "rankwise.ode", "rankwise.peft", "rankwise.train", "rankwise.data",
                                  "rankwise.optim.functional", "rankwise.models", "rankwise.linalg"])
def test_a_public_namespace_lists_only_what_it_exports(name):
    """``dir()`` of a public package shows its ``__all__`` and its public subpackages, never its
    own imports (``os``, ``torch``, ``timedelta``, ``TYPE_CHECKING``)."""
    import importlib
    import types

    mod = importlib.import_module(name)
    public = [n for n in dir(mod) if not n.startswith("_")]
    stray = [n for n in public if n not in mod.__all__
             and not isinstance(getattr(mod, n), types.ModuleType)]
    assert stray == []
    assert all(hasattr(mod, n) for n in mod.__all__)
