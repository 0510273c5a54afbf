"""Issue 46: torch.compile, torch.jit.script, dir(rankwise) and the docs' clipping line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import rankwise


def _mlp(rank: int) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return rankwise.to_low_rank(m, rank=rank)


def _train_compiled(model, opt, steps: int) -> set[tuple[int, ...]]:
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(model, backend="eager")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    seen = set()
    for _ in range(steps):
        opt.zero_grad()
        ((compiled(x) - y) ** 2).mean().backward()
        opt.step()
        seen.add(tuple(opt.ranks().values()))
    return seen


def test_a_low_rank_model_compiles_without_graph_breaks():
    """Case 21: no graph break per low-rank layer; at fixed ranks training compiles once (the
    gradient store passed to the autograd.Function was an object: 6 graphs before)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    dynamo.reset()
    model = _mlp(4)
    assert dynamo.explain(model)(torch.randn(8, 16)).graph_break_count == 0
    dynamo.reset()
    opt = rankwise.DLRT(model, 0.01, tau=0.01, adaptive=False)
    _train_compiled(model, opt, 4)
    assert counters["stats"]["unique_graphs"] <= 2


def test_rank_changes_recompile_a_bounded_number_of_times():
    """Case 21: with torch's parameter shapes left dynamic (one documented switch), rank changes
    do not recompile at every change (the recompile limit is 8)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    dynamo.reset()
    model = _mlp(12)
    opt = rankwise.DLRT(model, 0.05, tau=0.4)
    with dynamo.config.patch(force_parameter_static_shapes=False):
        seen = _train_compiled(model, opt, 30)
    assert len(seen) >= 4  # the ranks did change, several times
    assert counters["stats"]["unique_graphs"] <= 3
    dynamo.reset()


def test_jit_script_is_refused_by_name_and_the_export_scripts():
    """Case 22: torch.jit.script of a low-rank model names the layer and the ways that work."""
    model = _mlp(3)
    with pytest.raises(TypeError, match=r"torch\.jit\.script cannot compile LowRankLinear.*rankwise\.export"):
        torch.jit.script(model)
    scripted = torch.jit.script(rankwise.export(model))
    x = torch.randn(5, 16)
    torch.testing.assert_close(scripted(x), model(x), atol=1e-5, rtol=1e-5)


def test_dir_lists_the_public_api_and_the_subpackages():
    """Case 25: dir(rankwise) lists the public names and the submodules, not its imports."""
    names = dir(rankwise)
    for private in ("Any", "TYPE_CHECKING", "annotations", "importlib", "_LAZY"):
        assert private not in names
    for public in ("DLRT", "to_low_rank", "clip_grad_norm_", "lowrank", "ode", "ckpt", "peft", "__version__"):
        assert public in names
    assert all(hasattr(rankwise, n) for n in names if n != "cli")


def test_the_docs_no_longer_say_clipping_is_unsupported():
    """Case 24: docs/lowrank.md said "Gradient clipping is not supported yet" (the README and the
    code support it)."""
    text = (Path(__file__).parents[2] / "docs" / "lowrank.md").read_text(encoding="utf-8")
    assert "clipping is not supported" not in text.lower()
    assert "clip_grad_norm_" in text


def test_every_test_named_in_the_integration_page_exists():
    """docs/integration.md's table: each row's test (file, and function where named) exists."""
    import re

    root = Path(__file__).parents[2]
    text = (root / "docs" / "integration.md").read_text(encoding="utf-8")
    cells = re.findall(r"`((?:\w+/)*test_\w+\.py)(?:::(\w+))?`", text)
    assert len(cells) > 20
    last = None
    for file, func in cells:
        path = root / "tests" / file
        assert path.is_file(), file
        last = path.read_text(encoding="utf-8")
        if func:
            assert re.search(rf"def {func}\b", last), f"{file}::{func}"
    for func in re.findall(r"`::(\w+)`", text):  # '::name' continues the file named before it
        assert any(re.search(rf"def {func}\b", (root / "tests" / f).read_text(encoding="utf-8"))
                   for f, _ in cells), func


def test_the_step_between_augmentations_compiles_without_graph_breaks():
    """Issue 47's target: the core step (`update_every` > 1, between augmentations: the rule on
    every core S and the dense parameters, no host read) traces into one graph."""
    import torch._dynamo as dynamo

    from rankwise.optim import _batched

    dynamo.reset()
    model = _mlp(4)
    opt = rankwise.DLRT(model, 0.01, tau=0.1, optimizer="adam", update_every=5)
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    opt.step(closure)  # the augmentation
    closure()

    def core_step():
        with torch.no_grad():
            return _batched.core_step(opt, None)

    assert dynamo.explain(core_step)().graph_break_count == 0
    dynamo.reset()


def test_a_compiled_function_reads_a_low_rank_weight():
    """The write-protected `weight` view is a tensor subclass dynamo does not trace: under
    torch.compile the property gives the plain tensor (the review of the view found
    `torch.compile(lambda x: F.linear(x, layer.weight))` failing with a RecursionError)."""
    layer = rankwise.to_low_rank(nn.Sequential(nn.Linear(6, 5)), rank=2)[0]
    x = torch.randn(3, 6)
    got = torch.compile(lambda x: nn.functional.linear(x, layer.weight, layer.bias), backend="eager")(x)
    torch.testing.assert_close(got, layer(x))
