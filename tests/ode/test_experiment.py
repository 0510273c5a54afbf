"""The permuted-digits matrix-memory experiment: its gradients audit clean, and it runs."""

import torch
from torch import nn

from rankwise.experiments.ode_digits import MatrixMemoryClassifier
from rankwise.ode import FixedController, audit_gradients


def test_reversal_gradients_on_rank_deficient_float32_states():
    """The memory starts near zero and grows by rank-1 writes, so early cores are
    ill-conditioned: the reverse rebuilds the product but rotated factors. The backward must
    notice (factor-level check) and replay, or the gradient is wrong (cosine ≈ 0 before)."""
    torch.manual_seed(0)
    model = MatrixMemoryClassifier(FixedController(8, 8))
    g = torch.Generator().manual_seed(0)
    model.field.x = torch.rand(8, 64, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    F0 = 0.01 * torch.randn(8, 16, 16, generator=g)
    cos = audit_gradients(model.block, F0,
                          lambda s: nn.functional.cross_entropy(model.out(s.dense().flatten(1)), y))
    assert cos > 0.999


def test_ode_cli_rejects_unknown_controller():
    from typer.testing import CliRunner

    from rankwise.cli import app

    r = CliRunner().invoke(app, ["ode", "--controllers", "magic"])
    assert r.exit_code != 0 and "controller must be" in r.output
