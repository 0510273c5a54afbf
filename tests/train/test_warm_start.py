"""DenseWarmStart: the dense phase is a plain dense run, the switch to full-rank factors changes
no output, and the integrator then reaches its compression target."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rankwise
from rankwise.train import DenseWarmStart, fit

F64 = torch.float64


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3)).to(F64)


def _data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(96, 10, generator=g, dtype=F64)
    return x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()


def test_the_dense_phase_is_a_plain_run_and_the_switch_changes_nothing():
    x, y = _data()
    plain, warm = _mlp(), _mlp()
    fit(plain, torch.optim.Adam(plain.parameters(), 1e-2), x, y, epochs=None, max_steps=12, batch_size=16,
        shuffle=torch.Generator().manual_seed(0))
    made = []

    def make(m):
        made.append(rankwise.DLRT(m, 0.5, tau=0.1, optimizer="adam"))
        return made[-1]

    cb = DenseWarmStart(12, make)
    loop = fit(warm, torch.optim.Adam(warm.parameters(), 1e-2), x, y, epochs=None, max_steps=12,
               batch_size=16, shuffle=torch.Generator().manual_seed(0), callbacks=[cb])
    layers = [m for m in warm.modules() if isinstance(m, rankwise.LowRankLinear)]
    assert len(layers) == 3 and [m.rank for m in layers] == [10, 24, 3]  # full rank
    dense = [m for m in plain.modules() if isinstance(m, nn.Linear)]
    for d, low in zip(dense, layers, strict=True):
        torch.testing.assert_close(low.weight_matrix().detach(), d.weight.detach(), atol=1e-12, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(warm(x), plain(x), atol=1e-12, rtol=0)
    assert loop.optimizer is made[0] and cb.switched_at == 12
    assert made[0].param_groups[0]["lr"] == 1e-2  # the dense phase's rate carried over


def test_after_the_switch_the_budget_reaches_its_target():
    x, y = _data()
    model = _mlp()
    cb = DenseWarmStart(18, lambda m: rankwise.DLRT(m, 1e-2, target=0.6, ramp_steps=12, optimizer="adam"))
    loop = fit(model, torch.optim.Adam(model.parameters(), 1e-2), x, y, epochs=None, max_steps=48,
               batch_size=16, shuffle=torch.Generator().manual_seed(0), callbacks=[cb])
    assert isinstance(loop.optimizer, rankwise.DLRT)
    assert rankwise.compression(model)["ratio"] >= 0.6 - 1e-9
    assert torch.isfinite(torch.tensor(loop.loss))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="steps"):
        DenseWarmStart(0, lambda m: None)
    with pytest.raises(TypeError, match="function"):
        DenseWarmStart(3, "dlrt")
    with pytest.raises(ValueError, match="rank"):
        DenseWarmStart(3, lambda m: None, rank=0)
    model = _mlp()
    x, y = _data()
    with pytest.raises(TypeError, match="not a torch optimizer"):
        fit(model, torch.optim.SGD(model.parameters(), 0.1), x, y, epochs=None, max_steps=2, batch_size=16,
            callbacks=[DenseWarmStart(1, lambda m: None)])


def test_per_layer_ranks_factor_exactly_the_named_layers_each_at_its_rank():
    """`rank={name: r}` (the LM study's start ranks; the study's own switch callback is now this
    one): each named layer is its rank-r truncated SVD (checked against numpy's SVD), the others
    stay dense."""
    import numpy as np

    x, y = _data()
    plain, warm = _mlp(), _mlp()
    run = dict(epochs=None, max_steps=4, batch_size=16)
    fit(plain, torch.optim.SGD(plain.parameters(), 1e-2), x, y, shuffle=torch.Generator().manual_seed(0),
        **run)
    cb = DenseWarmStart(4, lambda m: rankwise.DLRT(m, 1e-2, tau=0.0), rank={"0": 3, "4": 2})
    fit(warm, torch.optim.SGD(warm.parameters(), 1e-2), x, y, shuffle=torch.Generator().manual_seed(0),
        callbacks=[cb], **run)
    assert cb.switched_at == 4 and isinstance(warm[2], nn.Linear) and (warm[0].rank, warm[4].rank) == (3, 2)
    torch.testing.assert_close(warm[2].weight, plain[2].weight, atol=0, rtol=0)
    for name, r in (("0", 3), ("4", 2)):
        u, s, vt = np.linalg.svd(plain.get_submodule(name).weight.detach().numpy())
        np.testing.assert_allclose(warm.get_submodule(name).weight_matrix().detach().numpy(),
                                   (u[:, :r] * s[:r]) @ vt[:r], atol=1e-10)
    with pytest.raises(ValueError, match="not modules of the model"):
        rankwise.to_low_rank(_mlp(), rank={"9": 2})
    with pytest.raises(ValueError, match="without `tau`"):
        rankwise.to_low_rank(_mlp(), rank={"0": 2}, tau=0.1)
    with pytest.raises(ValueError, match=r"rank\['0'\]"):
        rankwise.to_low_rank(_mlp(), rank={"0": 0})
    with pytest.raises(ValueError, match="without `include`"):
        DenseWarmStart(3, lambda m: None, rank={"0": 2}, include=["0"])
