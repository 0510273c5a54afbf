"""Shared problems and independent (dense, float64) references for the tests."""

from __future__ import annotations

import torch
from torch import nn

F64 = torch.float64


class DenseField(nn.Module):
    """A field seen only through f(t, F): hides a FactoredField's projections, so the KSL step
    takes the dense path (the reference the factored path is checked against)."""

    def __init__(self, field: nn.Module) -> None:
        super().__init__()
        self.inner = field

    def forward(self, t, F):
        return self.inner(t, F)


def rank3_problem(m: int = 30, n: int = 20, samples: int = 256, seed: int = 0):
    """Linear regression onto a rank-3 target matrix W* (m, n): inputs X (samples, n),
    targets Y = X W*ᵀ. Returns (X, Y, W*)."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(m, 3, generator=g, dtype=F64)
    B = torch.randn(n, 3, generator=g, dtype=F64)
    W = A @ B.T / 3
    X = torch.randn(samples, n, generator=g, dtype=F64)
    return X, X @ W.T, W


def mse_closure(opt, model, X, Y):
    def closure():
        opt.zero_grad()
        loss = ((model(X) - Y) ** 2).sum(-1).mean()
        loss.backward()
        return loss.detach()

    return closure


def xent_closure(opt, model, x, y):
    """``opt.step``'s closure: cross-entropy of ``model(x)`` against the class indices `y`."""
    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return closure


def projector(M: torch.Tensor) -> torch.Tensor:
    """Orthogonal projector onto span(M), via numpy's SVD (an independent code path)."""
    import numpy as np

    u, s, _ = np.linalg.svd(M.detach().cpu().numpy(), full_matrices=False)
    u = u[:, s > 1e-10 * max(s.max(), 1.0)]
    return torch.from_numpy(u @ u.T)


def dense_grad(layer, X, Y) -> torch.Tensor:
    """∇_W of the mse loss at W = layer's weight matrix, by dense autograd."""
    W = layer.weight_matrix().detach().clone().requires_grad_(True)
    loss = ((X @ W.T - Y) ** 2).sum(-1).mean()
    (g,) = torch.autograd.grad(loss, W)
    return g


class CliResult:
    """What one ``rankwise`` command line call did: `exit_code`, `stdout`, `stderr`, and
    `output` (both, whitespace-normalised, for message checks)."""

    def __init__(self, exit_code: int, stdout: str, stderr: str) -> None:
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr
        self.output = " ".join((stdout + "\n" + stderr).split())

    def __repr__(self) -> str:
        return f"CliResult({self.exit_code}, stdout={self.stdout[-2000:]!r}, stderr={self.stderr!r})"


def run_cli(*args: object) -> CliResult:
    """``rankwise *args`` in this process, through the console script's entry point
    (:func:`rankwise.cli.main`, which turns errors into one line and an exit status)."""
    import contextlib
    import io

    from rankwise.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return CliResult(code, out.getvalue(), err.getvalue())


def one_line_error(r: CliResult, command: str, code: int = 2) -> str:
    """The call failed with `code`, printing exactly one line on stderr naming `command`."""
    assert r.exit_code == code, r
    assert r.stderr.endswith("\n") and r.stderr.count("\n") == 1, r
    assert r.stderr.startswith(f"rankwise {command}: error: "), r
    assert "Traceback" not in r.stdout + r.stderr
    return r.stderr


def step_beside_torch(opt, torch_opt, model, ref, steps: int = 4) -> None:
    """`steps` steps of `opt` on `model` (a low-rank first layer, then dense layers) and of the
    torch optimizer `torch_opt` on `ref` (a copy of the dense layers), both on the first layer's
    features of one fixed batch (7, 6) against zero targets (2 outputs)."""
    x = torch.randn(7, 6, dtype=F64)
    for _ in range(steps):
        h = model[0](x).detach()
        opt.step(mse_closure(opt, model, x, torch.zeros(7, 2, dtype=F64)))
        torch_opt.zero_grad()
        (ref(h) ** 2).sum(-1).mean().backward()
        torch_opt.step()



def load_benchmark(name: str):
    """The module of ``benchmarks/<name>.py`` (benchmarks are scripts, not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod
