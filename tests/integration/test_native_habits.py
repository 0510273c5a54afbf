"""Issue 56, native round 2: what a user attached to a layer survives the conversion, the
optimizer follows ``requires_grad`` as torch's do, and nothing global moves."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.utils.prune
import torch.optim.optimizer as optimizer_module
from torch import nn

import rankwise
from rankwise import DLRT


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


def _step(model: nn.Module, opt, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_a_frozen_layer_stays_frozen_through_conversion_and_training():
    """A layer frozen before to_low_rank (a frozen backbone; BitFit: weights frozen, biases
    trained) comes back frozen, and DLRT leaves it as it is."""
    m = _mlp()
    m[0].requires_grad_(False)                # frozen backbone layer
    m[2].weight.requires_grad_(False)         # BitFit: only the bias trains
    attn = nn.MultiheadAttention(12, 2)
    attn.in_proj_weight.requires_grad_(False)
    rankwise.to_low_rank(m, rank=3)
    rankwise.to_low_rank(nn.Sequential(attn), rank=3)  # (attention converts in place in its parent)
    assert not any(t.requires_grad for t in (m[0].U, m[0].S, m[0].V, m[0].bias))
    assert not any(t.requires_grad for t in (m[2].U, m[2].S, m[2].V)) and m[2].bias.requires_grad
    before = {n: t.detach().clone() for n, t in m.named_parameters()}
    opt = DLRT(m, 0.1, tau=0.1)
    for s in range(3):
        _step(m, opt, s)
    after = dict(m.named_parameters())
    for name in ("0.U", "0.S", "0.V", "0.bias", "2.U", "2.S", "2.V"):
        assert torch.equal(after[name], before[name]), name
    assert not torch.equal(after["2.bias"], before["2.bias"]) and not torch.equal(after["4.S"], before["4.S"])


def test_a_frozen_attention_projection_stays_frozen():
    holder = nn.Sequential(nn.MultiheadAttention(12, 2))
    holder[0].in_proj_weight.requires_grad_(False)
    rankwise.to_low_rank(holder, rank=3)
    mha = holder[0]
    for p in ("q_proj", "k_proj", "v_proj"):
        assert not getattr(mha, p).S.requires_grad and getattr(mha, p).bias.requires_grad
    assert mha.out_proj.S.requires_grad


def test_layers_unfrozen_after_the_optimizer_was_built_train_as_if_built_after():
    """Gradual unfreezing: a low-rank and a dense layer frozen when DLRT is built train once
    unfrozen, exactly as under a DLRT built after the unfreezing (torch.optim.Adam does this)."""
    def model():
        m = _mlp()
        rankwise.to_low_rank(m, rank=3, include=["0", "2"])
        return m

    late, ref = model(), model()
    late[0].requires_grad_(False)
    late[4].requires_grad_(False)
    opt = DLRT(late, 0.1, tau=0.05)
    _step(late, opt, 0)  # the frozen layers do not move
    assert torch.equal(late[0].S, ref[0].S) and torch.equal(late[4].weight, ref[4].weight)
    ref.load_state_dict(late.state_dict())
    late[0].requires_grad_(True)
    late[4].requires_grad_(True)
    opt_ref = DLRT(ref, 0.1, tau=0.05)
    for s in range(1, 4):
        _step(late, opt, s)
        _step(ref, opt_ref, s)
    for (n, a), b in zip(late.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=n)
    assert not torch.equal(late[0].S, model()[0].S)


def test_a_dense_parameter_given_to_two_optimizers_moves_as_under_two_torch_optimizers():
    """DLRT holds every parameter of its model, as torch.optim.Adam(model.parameters()) does: a
    second optimizer on the head steps it too, as a second torch optimizer would (refusing it
    took a hook inside every torch optimizer's step, process-wide); the head keeps its own
    hyperparameters through `param_groups` instead, with the same step as a lone AdamW."""
    m = _mlp()
    rankwise.to_low_rank(m, rank=3, include=["0", "2"])
    opt = DLRT(m, 0.1, tau=0.1)
    head = torch.optim.AdamW(m[4].parameters(), 1e-3)
    _step(m, opt)
    before = m[4].weight.detach().clone()
    head.step()
    assert not torch.equal(m[4].weight, before)
    assert not optimizer_module._global_optimizer_pre_hooks


def test_hooks_registered_before_conversion_keep_firing_and_their_handles_work():
    m = _mlp()
    seen = []
    pre = m[2].register_forward_pre_hook(lambda mod, args: seen.append(("pre", type(mod).__name__)))
    m[2].register_forward_hook(lambda mod, args, out: seen.append(("fwd", out.shape[-1])))
    m[2].register_full_backward_hook(lambda mod, gi, go: seen.append(("bwd", go[0].shape[-1])))
    rankwise.to_low_rank(m, rank=3)
    m(torch.randn(2, 8)).sum().backward()
    assert seen == [("pre", "LowRankLinear"), ("fwd", 12), ("bwd", 12)]
    pre.remove()
    seen.clear()
    m(torch.randn(2, 8))
    assert seen == [("fwd", 12)]


def test_a_hook_on_a_weight_tensor_is_refused_by_name():
    m = _mlp()
    m[2].weight.register_hook(lambda g: g)
    with pytest.raises(ValueError, match=r"'2'.weight has a tensor hook"):
        rankwise.to_low_rank(m, rank=3)
    assert isinstance(m[0], nn.Linear)  # nothing changed


def test_naming_a_module_it_cannot_convert_is_refused():
    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"`rank` names '1', a LayerNorm"):
        rankwise.to_low_rank(m, rank={"0": 2, "1": 2})
    with pytest.raises(ValueError, match=r"`include` names '1', which to_low_rank cannot convert"):
        rankwise.to_low_rank(m, rank=2, include=["0", "1"])
    assert isinstance(m[0], nn.Linear)


def test_a_parametrised_linear_is_named_not_skipped_silently():
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    nn.utils.parametrizations.weight_norm(m[1])
    nn.utils.parametrizations.spectral_norm(m[2])
    with pytest.warns(UserWarning) as record:
        rankwise.to_low_rank(m, rank=2)
    text = " ".join(str(w.message) for w in record)
    assert "leaving '1' dense: parametrised" in text and "leaving '2' dense: parametrised" in text
    assert "remove_parametrizations" in text and isinstance(m[0], rankwise.LowRankLinear)
    with pytest.raises(ValueError, match=r"`rank` names '1', which to_low_rank cannot convert: parametrised"):
        rankwise.to_low_rank(m, rank={"1": 2})
    old = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (the hook-based form is deprecated)
        nn.utils.weight_norm(old[1])
    with pytest.warns(UserWarning, match=r"leaving .1. dense: its weight is recomputed by torch.nn.utils"):
        rankwise.to_low_rank(old, rank=2)


def test_conversion_leaves_the_global_rng_where_it_was():
    torch.manual_seed(0)
    plain = torch.rand(3)
    m = _mlp()
    holder = nn.Sequential(nn.MultiheadAttention(12, 2))
    torch.manual_seed(0)
    rankwise.to_low_rank(m, rank=3)
    rankwise.to_low_rank(holder, rank=3)
    assert torch.equal(torch.rand(3), plain)


def test_dense_ema_and_export_leave_the_global_rng_where_it_was():
    m = rankwise.to_low_rank(_mlp(), rank=3)
    torch.manual_seed(0)
    plain = torch.rand(3)
    torch.manual_seed(0)
    rankwise.DenseEMA(m, 0.9)
    rankwise.export(m, merge="never")
    assert torch.equal(torch.rand(3), plain)


def test_a_pickled_model_and_optimizer_resume_as_if_never_saved():
    """torch.save({"model": m, "opt": opt}) then torch.load: was AttributeError '_released'."""
    import io

    m = rankwise.to_low_rank(_mlp(), rank=4)
    opt = DLRT(m, 0.05, tau=0.2, optimizer="adam")
    for s in range(2):
        _step(m, opt, s)
    buf = io.BytesIO()
    torch.save({"model": m, "opt": opt}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    m2, opt2 = saved["model"], saved["opt"]
    assert m2[0].grad_mode == "factors" and opt2.layers["0"] is m2[0]
    for s in range(2, 5):
        _step(m, opt, s)
        _step(m2, opt2, s)
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt2.ranks() == opt.ranks()


def test_a_model_state_loaded_at_other_ranks_trains_on_with_its_moments_restarted():
    """model.load_state_dict(best) after the ranks changed, then more steps: was a size mismatch
    deep in the step (Adam's moments at the later ranks); now the moments of the layers whose
    rank differs restart, with one warning."""
    import copy

    m = rankwise.to_low_rank(_mlp(), rank=6)
    opt = DLRT(m, 0.05, tau=0.3, optimizer="adam")
    _step(m, opt, 0)
    best, ranks = copy.deepcopy(m.state_dict()), opt.ranks()
    s = 1
    while opt.ranks() == ranks:
        _step(m, opt, s)
        s += 1
    m.load_state_dict(best)
    with pytest.warns(UserWarning, match=r"changed outside the optimizer .*moments restart"):
        _step(m, opt, s)
    _step(m, opt, s + 1)
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("helper", [
    lambda layer: torch.nn.utils.prune.l1_unstructured(layer, "weight", 0.3),
    lambda layer: nn.utils.parametrizations.weight_norm(layer),
    lambda layer: nn.utils.parametrizations.spectral_norm(layer),
    lambda layer: nn.utils.spectral_norm(layer),
    lambda layer: torch.nn.utils.fusion.fuse_linear_bn_eval(layer.eval(), nn.BatchNorm1d(12).eval()),
    lambda layer: torch.func.functional_call(layer, {"weight": torch.zeros(12, 8)}, (torch.zeros(1, 8),)),
    lambda layer: setattr(layer, "weight", nn.Parameter(torch.zeros(12, 8))),
    lambda layer: delattr(layer, "weight"),
], ids=["prune", "weight_norm", "spectral_norm", "old_spectral_norm", "fuse_linear_bn", "functional_call",
        "assign", "delete"])
def test_torch_helpers_that_take_the_weight_for_a_parameter_are_refused_in_one_line(helper):
    layer = rankwise.to_low_rank(_mlp(), rank=3)[0]
    before = {n: t.detach().clone() for n, t in layer.state_dict().items()}
    with pytest.raises(TypeError, match=r"^LowRankLinear: its `weight` is not a parameter .*rankwise.export"):
        helper(layer)
    assert type(layer) is rankwise.LowRankLinear and set(layer.state_dict()) == set(before)
    assert all(torch.equal(layer.state_dict()[n], t) for n, t in before.items())
    out = torch.func.functional_call(layer, {"U": torch.zeros_like(layer.U)}, (torch.ones(1, 8),))
    torch.testing.assert_close(out, layer.bias.detach()[None])  # a factor by name works


@pytest.mark.parametrize("helper", [
    lambda mha: torch.nn.utils.prune.l1_unstructured(mha, "in_proj_weight", 0.3),
    lambda mha: nn.utils.parametrizations.weight_norm(mha, "in_proj_weight"),
    lambda mha: setattr(mha, "in_proj_weight", nn.Parameter(torch.zeros(24, 8))),
], ids=["prune", "weight_norm", "assign"])
def test_an_attentions_dense_views_are_refused_as_parameters_too(helper):
    mha = rankwise.to_low_rank(nn.Sequential(nn.MultiheadAttention(8, 2)), rank=2)[0]
    with pytest.raises(TypeError, match=r"^LowRankMultiheadAttention: its `in_proj_weight` is not a param"):
        helper(mha)
    assert mha.in_proj_weight.shape == (24, 8)


def test_a_state_declaring_a_rank_the_layer_cannot_hold_is_refused_before_allocating():
    """Zero-byte factors declaring rank 2³¹ made load_state_dict allocate 412 GB."""
    layer = rankwise.LowRankLinear(8, 12, 3)
    huge = 2**20  # (S alone: 4 TiB of float32)
    state = {"U": torch.empty(12, huge, device="meta"), "S": torch.empty(huge, huge, device="meta"),
             "V": torch.empty(8, huge, device="meta"), "bias": torch.zeros(12)}
    with pytest.raises(ValueError, match=r"do not fit this 12×8 layer: .*1 <= r <= 8"):
        layer.load_state_dict(state)
    assert layer.rank == 3


def test_sharding_after_the_optimizer_or_before_the_conversion_is_named():
    """fully_shard after DLRT was built ended in "found no gradient … call loss.backward()";
    to_low_rank on a sharded model in "mixed torch.Tensor and DTensor"."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m = rankwise.to_low_rank(_mlp(), rank=3, include=["0"])
        opt = DLRT(m, 0.1, tau=0.1)
        fully_shard(m)
        with pytest.raises(ValueError, match=r"sharded by fully_shard .*after the optimizer was built"):
            _step(m, opt)
        sharded = fully_shard(_mlp())
        with pytest.raises(ValueError, match=r"already sharded .*convert it first, then shard"):
            rankwise.to_low_rank(sharded, rank=3)
    finally:
        dist.destroy_process_group()


def test_fx_symbolic_trace_records_low_rank_layers_as_calls_that_keep_the_gradient_contract():
    """torch.fx.symbolic_trace ended in "symbolically traced variables cannot be used as inputs to
    control flow"; the traced graph now computes the model and, under DLRT, the factor gradients."""
    import torch.fx

    torch.manual_seed(0)
    m = rankwise.to_low_rank(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                           nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3)), rank=2)
    x = torch.randn(2, 3, 4, 4)
    gm = torch.fx.symbolic_trace(m)
    torch.testing.assert_close(gm(x), m(x))
    DLRT(m, 0.1, tau=0.1)
    gm(x).square().sum().backward()
    traced = [p.grad.clone() for p in (m[0].U, m[3].V, m[5].S)]
    m.zero_grad()
    m(x).square().sum().backward()
    for a, b in zip(traced, (m[0].U.grad, m[3].V.grad, m[5].S.grad), strict=True):
        torch.testing.assert_close(a, b)


def test_a_weight_read_without_autograd_is_formed_once_until_the_factors_change():
    """Foreign code reading `layer.weight` on every call (T5: `wo.weight.dtype` in each block)
    formed U S Vᵀ each time; in eval mode without autograd it is now kept until the factors
    change (each read a new tensor object over it), and never kept as an inference tensor."""
    m = rankwise.to_low_rank(_mlp(), rank=3).eval()
    layer = m[0]
    with torch.no_grad():
        w = layer.weight
        assert layer.weight.data_ptr() == w.data_ptr() and layer.weight is not w
        layer.U.mul_(2)  # an in-place change of a factor
        w2 = layer.weight
    assert w2.data_ptr() != w.data_ptr()
    torch.testing.assert_close(w2, 2 * w)
    with torch.inference_mode():
        layer.U.mul_(0.5)
        layer.weight.sum()
    x = torch.randn(2, 8, requires_grad=True)
    nn.functional.linear(x, layer.weight.detach()).sum().backward()  # (an inference tensor would raise)
    m.train()
    opt = DLRT(m, 0.1, tau=0.1)
    _step(m, opt)
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(layer.weight, layer.U @ layer.S @ layer.V.T)
    m.train()
    with torch.no_grad():
        assert layer.weight.data_ptr() != layer.weight.data_ptr()  # training: formed on each read
    m.eval()
    with pytest.raises(RuntimeError, match=r"LowRankLinear\.weight"), torch.no_grad():
        layer.weight.mul_(0)  # the kept matrix is write-protected like any view


def test_an_optimizer_state_of_the_development_layout_without_frozen_parameters_is_refused():
    """A development version held only the trainable parameters: a state it saved (frozen layers
    present, as every PEFT run has) has shorter param groups. No release had that layout: it is
    refused in one line (torch's own group check), nothing loaded; today's state loads."""
    def model():
        m = rankwise.to_low_rank(_mlp(), rank=3, include=["0", "2"])
        m[0].requires_grad_(False)
        m[4].bias.requires_grad_(False)
        return m

    m = model()
    opt = DLRT(m, 0.05, tau=0.1, optimizer="adam")
    for s in range(2):
        _step(m, opt, s)
    new = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    factors = {id(t) for t in (m[2].U, m[2].S, m[2].V)}
    kept = [i for i, p in enumerate(params) if p.requires_grad or id(p) in factors]
    old = {"state": {kept.index(k): v for k, v in new["state"].items() if k in kept},
           "param_groups": [{**new["param_groups"][0], "params": list(range(len(kept)))}]}
    fresh = model()
    fresh.load_state_dict(m.state_dict())
    again = DLRT(fresh, 0.05, tau=0.1, optimizer="adam")
    before = copy.deepcopy(again.state_dict())
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        again.load_state_dict(old)
    assert again.state_dict() == before
    again.load_state_dict(new)
    got = again.state_dict()["state"]
    for k, st in new["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(got[k][key]), torch.as_tensor(v)), (k, key)


def test_a_frozen_low_rank_layer_counts_as_fixed_in_a_budget():
    """A frozen layer keeps its rank: a target only its trainable layers could reach by
    shrinking the frozen one is refused at construction (it crushed the trainable layer)."""
    m = nn.Sequential(rankwise.LowRankLinear(32, 32, 16), rankwise.LowRankLinear(32, 32, 16))
    m[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"cannot be reached: .*frozen low-rank layers\) alone are 1,344"):
        DLRT(m, 0.05, target=0.5, ramp_steps=3)
