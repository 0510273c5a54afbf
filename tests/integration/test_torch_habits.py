"""Issue 46: PyTorch habits keep their meaning with DLRT/SDLRT (gradients, zero_grad, AMP,
clipping, release, add_param_group, wrappers). Each test names the case it covers."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import rankwise
from rankwise import DLRT, SDLRT, LowRankLinear

F64 = torch.float64


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(10, 16, dtype=dtype), nn.Tanh(), nn.Linear(16, 4, dtype=dtype))
    return rankwise.to_low_rank(m, rank=3)


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 10, generator=g, dtype=dtype), torch.randn(32, 4, generator=g, dtype=dtype)


def _loss(m, X, Y):
    return ((m(X) - Y) ** 2).mean()


def _train(m, opt, X, Y, steps=3, extra=None):
    for _ in range(steps):
        opt.zero_grad()
        if extra is not None:
            extra(m, X)
        _loss(m, X, Y).backward()
        opt.step()
    return [t.detach().clone() for t in m.parameters()]


# ---------------------------------------------------------------- case 1: autograd.grad
def test_autograd_grad_adds_nothing_to_the_step():
    """Case 1: torch.autograd.grad(loss, x) (adversarial examples, penalties) must not reach the
    next step; only .backward() accumulates into the layer."""
    X, Y = _data()
    m1 = _model()
    ref = _train(m1, DLRT(m1, 0.1, tau=0.2), X, Y)

    def adversarial(m, X):
        x = X.clone().requires_grad_(True)
        torch.autograd.grad(_loss(m, x, Y) * 1e3, x)

    m2 = _model()
    got = _train(m2, DLRT(m2, 0.1, tau=0.2), X, Y, extra=adversarial)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- case 10: zero_grad
@pytest.mark.parametrize("set_to_none", [True, False])
def test_model_zero_grad_clears_the_factor_gradients(set_to_none):
    """Case 10: a stray backward cleared by model.zero_grad() does not leak into the step."""
    X, Y = _data()
    m1 = _model()
    opt1 = DLRT(m1, 0.1, tau=0.2)
    for _ in range(3):
        m1.zero_grad(set_to_none=set_to_none)
        _loss(m1, X, Y).backward()
        opt1.step()
    m2 = _model()
    opt2 = DLRT(m2, 0.1, tau=0.2)
    for _ in range(3):
        (_loss(m2, X, Y) * 100).backward()  # stray
        m2.zero_grad(set_to_none=set_to_none)
        _loss(m2, X, Y).backward()
        opt2.step()
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if set_to_none:
        m2.zero_grad()
        assert all(t is None for layer in (m2[0], m2[2]) for t in layer.factor_grads())


# ---------------------------------------------------------------- case 11: torch's clip
def test_torch_clip_grad_norm_scales_every_gradient_the_step_reads():
    """Case 11: torch.nn.utils.clip_grad_norm_ clips the factor steps too (G_K, G_L are .grad);
    rankwise's gives the projected norm; both scale every gradient by one factor."""
    X, Y = _data(F64)
    m = _model(F64)
    opt = DLRT(m, 0.1, tau=0.2)  # (held: a dropped optimizer hands its layers back to plain autograd)
    _loss(m, X, Y).backward()
    layer = m[0]
    assert layer.grad_mode == "factors" and opt.layers
    before = [t.clone() for t in (layer.U.grad, layer.S.grad, layer.V.grad, layer.bias.grad)]
    total = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    coef = 1e-3 / (float(total) + 1e-6)
    after = (layer.U.grad, layer.S.grad, layer.V.grad, layer.bias.grad)
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(a, b * coef, rtol=1e-12, atol=0)
    # rankwise's norm: ‖G_K‖² + ‖G_L‖² − ‖G_S‖² per layer, below torch's
    assert float(rankwise.grad_norm(m)) < float(torch.nn.utils.get_total_norm(
        [p.grad for p in m.parameters()]))


# ---------------------------------------------------------------- case 12: AMP recipe
def test_grad_scaler_unscale_then_clip_then_step_equals_unscaled_training():
    """Case 12: scaler.unscale_(opt); clip; scaler.step(opt) — torch's AMP recipe."""
    X, Y = _data()

    def run(enabled):
        m = _model()
        opt = SDLRT(m, 0.05, tau=0.2, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=enabled)
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(_loss(m, X, Y)).backward()
            scaler.unscale_(opt)
            rankwise.clip_grad_norm_(m, 0.5)
            scaler.step(opt)
            scaler.update()
        return [p.detach().clone() for p in m.parameters()], opt.ranks()

    (a, ra), (b, rb) = run(True), run(False)
    assert ra == rb
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- case 13: clip signature
def test_clip_grad_norm_takes_what_torch_takes():
    """Case 13 (and 17 for clipping): a model, model.parameters() (a generator), one tensor;
    norm_type, error_if_nonfinite, foreach; plain parameters give torch's results."""
    X, Y = _data(F64)
    plain = nn.Sequential(nn.Linear(10, 16, dtype=F64), nn.Tanh(), nn.Linear(16, 4, dtype=F64))
    plain.zero_grad()
    _loss(plain, X, Y).backward()
    grads = [p.grad.clone() for p in plain.parameters()]
    for norm_type in (2.0, 1.0, "inf"):
        for foreach in (None, False):
            ref = [nn.Parameter(torch.zeros_like(g)) for g in grads]
            for p, g in zip(ref, grads, strict=True):
                p.grad = g.clone()
            want = torch.nn.utils.clip_grad_norm_(ref, 0.01, norm_type=norm_type)
            for p, g in zip(plain.parameters(), grads, strict=True):
                p.grad = g.clone()
            got = rankwise.clip_grad_norm_(plain.parameters(), 0.01, norm_type=norm_type, foreach=foreach)
            assert float(got) == pytest.approx(float(want), rel=1e-12)
            for p, q in zip(plain.parameters(), ref, strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    m = _model(F64)
    opt = DLRT(m, 0.1, tau=0.2)
    _loss(m, X, Y).backward()
    assert opt.layers and float(rankwise.grad_norm(m)) < float(torch.nn.utils.get_total_norm(
        [p.grad for p in m.parameters()]))  # the projected norm
    by_model = float(rankwise.grad_norm(m))
    assert float(rankwise.grad_norm(m.parameters())) == pytest.approx(by_model, rel=1e-12)
    assert float(rankwise.clip_grad_norm_(m.parameters(), 1e9)) == pytest.approx(by_model, rel=1e-12)
    m[2].bias.grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        rankwise.clip_grad_norm_(m, 1.0, error_if_nonfinite=True)
    with pytest.raises(TypeError, match="iterable of tensors"):
        rankwise.clip_grad_norm_(3, 1.0)


# ---------------------------------------------------------------- case 14: release
def test_release_hands_the_layers_back_to_plain_torch():
    """Case 14: after DLRT, a torch optimizer trains U, S and V with their true gradients once
    the DLRT is released (release() or dropped). A torch optimizer that steps a layer the DLRT
    still trains (U.grad holding G_K) is refused at the DLRT's next step, before it changes
    anything (the library installs no hook into other optimizers' steps)."""
    X, Y = _data()
    m = _model()
    opt = DLRT(m, 0.1, tau=0.2)
    _train(m, opt, X, Y, steps=2)
    adamw = torch.optim.AdamW(m.parameters(), lr=1e-2)
    adamw.zero_grad()
    _loss(m, X, Y).backward()
    adamw.step()
    after = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match=r"layer '0' .*changed since this DLRT's last step.*release\(\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(after, m.parameters(), strict=True))
    opt.release()
    with pytest.raises(RuntimeError, match="released"):
        opt.step()
    layer = m[0]
    assert layer.grad_mode == "full" and layer.U.requires_grad and layer.V.requires_grad
    adamw.zero_grad()
    _loss(m, X, Y).backward()
    # the true gradient: dU = ∇W V Sᵀ (checked against dense autograd)
    W = layer.weight_matrix().detach().requires_grad_(True)
    h = torch.tanh(X @ W.T + layer.bias)
    (gW,) = torch.autograd.grad(((m[2](h) - Y) ** 2).mean(), W)
    torch.testing.assert_close(layer.U.grad, gW @ layer.V.detach() @ layer.S.detach().T)
    U0 = layer.U.detach().clone()
    adamw.step()
    assert not torch.equal(U0, layer.U.detach())


def test_a_torch_optimizer_beside_a_kept_dlrt_is_refused_at_the_next_forward():
    """The DLRT is kept but never stepped again (a notebook that switched to AdamW): the forward
    after AdamW's first step refuses, so that no second wrong step follows (before, every step
    trained with G_K as if it were dL/dU, silently). Without gradients, through
    ``functional_call`` and after ``load_state_dict`` the forward goes on."""
    X, Y = _data()
    m = _model()
    opt = DLRT(m, 0.1, tau=0.2)
    _train(m, opt, X, Y, steps=2)
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    _loss(m, X, Y).backward()  # (gradients from the DLRT's mode: U.grad = G_K)
    torch.optim.SGD(m.parameters(), lr=1e-2).step()
    with torch.no_grad():
        _loss(m, X, Y)  # an evaluation feeds no optimizer: not checked
    params = {k: v.detach().clone().requires_grad_(True) for k, v in m.named_parameters()}
    torch.func.functional_call(m, params, (X,)).sum().backward()  # other tensors than U, V
    with pytest.raises(RuntimeError, match=r"LowRankLinear: U or V changed since the DLRT .*release\(\)"):
        _loss(m, X, Y)
    m.load_state_dict(saved)  # replaced factors: the DLRT's next step restarts from them
    _loss(m, X, Y).backward()
    opt.step()
    _loss(m, X, Y).backward()  # and the step marks them again
    opt.release()
    _loss(m, X, Y).backward()  # released: plain torch


def test_torch_can_swap_the_factors_of_a_layer_a_dlrt_trains():
    """``load_state_dict`` (and ``.to()``) under ``set_swap_module_params_on_conversion`` (FSDP2 too)
    swap tensors with ``torch.utils.swap_tensors``, which refuses a tensor with a weak reference:
    the foreign-write check records U and V by id (with weak references both raised)."""
    X, Y = _data()
    m = _model()
    opt = DLRT(m, 0.1, tau=0.2)
    _train(m, opt, X, Y, steps=1)
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.load_state_dict(m.state_dict())
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    _train(m, opt, X, Y, steps=1)


def test_a_dropped_optimizer_releases_its_layers():
    m = _model()
    opt = DLRT(m, 0.1, tau=0.2)
    assert m[0].grad_mode == "factors"
    other = DLRT(m, 0.1, tau=0.2)  # takes the layers over: dropping the first changes nothing
    del opt
    gc.collect()
    assert m[0].grad_mode == "factors"
    del other
    gc.collect()
    assert m[0].grad_mode == "full" and m[0].U.requires_grad


def test_a_dropped_optimizer_releases_its_layers_without_a_garbage_collection():
    """No reference cycle keeps a dropped DLRT (with a budget too: its planner holds the rank cap)
    alive: its layers go back to plain autograd when the last reference goes, with no collection
    (nothing in the library runs one inside another optimizer's step any more)."""
    for kw in ({"tau": 0.2}, {"target": 0.5}):
        m = _model()
        gc.disable()
        try:
            opt = DLRT(m, 0.1, **kw)
            assert m[0].grad_mode == "factors"
            del opt
            assert m[0].grad_mode == "full", kw
        finally:
            gc.enable()


# ---------------------------------------------------------------- case 16: add_param_group
def test_add_param_group_integrates_a_new_low_rank_layer():
    """Case 16: a LowRankLinear added with add_param_group is integrated (its rank adapts), not
    trained as plain parameters."""
    X, Y = _data()
    torch.manual_seed(0)
    body = rankwise.to_low_rank(nn.Sequential(nn.Linear(10, 16), nn.Tanh()), rank=3)
    head = LowRankLinear(16, 4, rank=4)
    head.set_factors(head.U, torch.diag(torch.tensor([1.0, 1.0, 1.0, 1e-3])), head.V)  # one tiny direction
    opt = DLRT(body, 0.1, tau=0.3)
    opt.add_param_group({"params": [head.S], "lr": 0.05})  # one of U, S, V places the three
    assert {id(p) for p in opt.param_groups[-1]["params"]} == {id(head.U), id(head.S), id(head.V)}
    assert head.grad_mode == "factors" and head in opt.layers.values()
    model = nn.Sequential(body, head)
    _train(model, opt, X, Y, steps=3)
    assert head.rank < 4  # truncated at τ = 0.3: integrated, not a plain Adam/SGD step
    with pytest.raises(ValueError, match="add_param_group with a new low-rank layer"):
        DLRT(body, 0.1, target=0.5).add_param_group({"params": head.parameters()})


# ---------------------------------------------------------------- case 2: wrappers
def test_a_ddp_wrapped_model_without_capacity_is_refused_at_construction(tmp_path):
    """Case 2: DLRT(DDP(model)) over exact-shape factors is refused in one line naming `capacity`
    (world size 1); over fixed-capacity factors it trains (tests/optim/parallel/test_ddp.py)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(_model())
        with pytest.raises(ValueError, match=r"needs fixed-capacity factors.*capacity='auto'"):
            DLRT(ddp, 0.1, tau=0.1)
    finally:
        dist.destroy_process_group()


def test_several_processes_without_a_process_group_warn_once(monkeypatch):
    """Case 2: DLRT(model) then DDP(model) at world size 2 trained with no warning while the
    replicas drifted; now the first step warns once (the world size is faked here)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    X, Y = _data()
    m = _model()
    opt = DLRT(m, 0.1, tau=0.2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _train(m, opt, X, Y, steps=2)
    said = [x for x in w if "without `process_group`" in str(x.message)]
    assert len(said) == 1 and "process_group=torch.distributed.group.WORLD" in str(said[0].message)


def test_fsdp_over_exact_shapes_is_refused_by_name(monkeypatch):
    """Case 2 / FSDP: a model holding a module sharded by fully_shard (an FSDPModule) over exact-shape
    factors is refused in one line naming `capacity` (the sharded class is stood in for: fully_shard
    needs a process group); over fixed-capacity factors it trains (tests/optim/parallel/test_fsdp.py)."""
    from torch.distributed import fsdp

    from rankwise.optim import _optim

    assert fsdp.FSDPModule in _optim.fsdp_classes()

    class Sharded(nn.Linear):
        pass

    monkeypatch.setattr(_optim, "fsdp_classes", lambda: (Sharded,))
    m = nn.Sequential(LowRankLinear(4, 4, 2), Sharded(4, 4))
    with pytest.raises(ValueError, match=r"\(FSDP2\) needs fixed-capacity factors: layer '0'"):
        DLRT(m, 0.1, tau=0.1)


def test_parameters_instead_of_the_model_are_refused_in_one_line():
    """Case 17 for the optimizer: DLRT(model.parameters())."""
    with pytest.raises(TypeError, match=r"not model.parameters\(\)"):
        DLRT(_model().parameters(), 0.1, tau=0.1)


# ---------------------------------------------------------------- what worked, kept working
def test_gradient_accumulation_equals_the_full_batch_and_jit_trace_works():
    """Two half-batch backward calls (each half the mean) step as one full batch (autograd sums
    G_K, G_L like any .grad); torch.jit.trace of a trained low-rank model computes the same."""
    X, Y = _data(F64)
    m1 = _model(F64)
    ref = _train(m1, DLRT(m1, 0.1, tau=0.2), X, Y)
    m2 = _model(F64)
    opt = DLRT(m2, 0.1, tau=0.2)
    for _ in range(3):
        opt.zero_grad()
        for half in (slice(0, 16), slice(16, 32)):
            (_loss(m2, X[half], Y[half]) / 2).backward()
        opt.step()
    for a, b in zip(ref, m2.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-9, atol=1e-12)
    traced = torch.jit.trace(m2, X[:4])
    torch.testing.assert_close(traced(X), m2(X))


# ---------------------------------------------------------------- review findings
def test_a_loss_term_on_the_dense_weight_adds_the_integrators_gradients():
    """`layer.weight` (the dense view) in the loss: in factor mode its backward adds G_K = ∇W·V,
    G_L = ∇Wᵀ·U and G_S, as the layer's own backward does (not dU = ∇W·V·Sᵀ)."""
    X, Y = _data(F64)
    m = _model(F64)
    opt = DLRT(m, 0.1, tau=0.2)
    layer = m[0]
    (_loss(m, X, Y) + 0.5 * layer.weight.square().sum()).backward()
    W = layer.weight_matrix().detach().requires_grad_(True)
    h = torch.tanh(X @ W.T + layer.bias)
    (gW,) = torch.autograd.grad(((m[2](h) - Y) ** 2).mean() + 0.5 * W.square().sum(), W)
    U, V = layer.U.detach(), layer.V.detach()
    torch.testing.assert_close(layer.U.grad, gW @ V)
    torch.testing.assert_close(layer.V.grad, gW.T @ U)
    torch.testing.assert_close(layer.S.grad, U.T @ gW @ V)
    assert opt.layers


def test_copies_start_in_plain_mode_and_ownership_is_kept():
    """A deepcopy of a model DLRT trains is plain torch (true gradients, AdamW works); two
    optimizers on one model, each released: the layers end in plain mode; a frozen low-rank
    layer is left alone; layer_of still finds the factors after load_state_dict(assign=True)."""
    import copy

    from rankwise.nn._base import layer_of

    X, Y = _data()
    m = _model()
    first = DLRT(m, 0.1, tau=0.2)
    twin = copy.deepcopy(m)
    assert twin[0].grad_mode == "full" and m[0].grad_mode == "factors"
    adamw = torch.optim.AdamW(twin.parameters())
    _loss(twin, X, Y).backward()
    adamw.step()  # not refused: the copy is nobody's
    second = SDLRT(m, 0.1, tau=0.2)
    second.release()
    _train(m, first, X, Y, steps=1)
    first.release()
    assert m[0].grad_mode == "full" and m[2].grad_mode == "full"
    frozen = _model()
    for p in frozen[0].parameters():
        p.requires_grad_(False)
    opt = DLRT(frozen, 0.1, tau=0.2)  # held (it trains once unfrozen), left frozen
    assert not any(p.requires_grad for p in frozen[0].parameters()) and frozen[2].U.requires_grad
    opt.release()
    assert not any(p.requires_grad for p in frozen[0].parameters())
    fresh = _model()
    fresh.load_state_dict(m.state_dict(), assign=True)
    assert layer_of(fresh[0].U) is fresh[0] and layer_of(fresh[0].S) is fresh[0]


def test_a_gradient_first_made_by_the_second_pass_is_not_applied(monkeypatch):
    """Two-pass BUG: a dense parameter that only the second closure call reaches gets its
    first-pass gradient (none) back, with either implementation."""

    def run(implementation: str):
        with monkeypatch.context():
            m = _model(F64)
            extra = nn.Parameter(torch.ones(3, dtype=F64))
            holder = nn.Module()
            holder.m, holder.extra = m, extra
            opt = DLRT(holder, 0.1, tau=0.2, single_pass=False, implementation=implementation)
            X, Y = _data(F64)
            calls = []

            def closure():
                opt.zero_grad()
                calls.append(1)
                loss = _loss(m, X, Y) + (extra.sum() if len(calls) % 2 == 0 else 0.0)
                loss.backward()
                return loss

            opt.step(closure)
            return extra.detach().clone()

    torch.testing.assert_close(run("batched"), run("exact"))
    torch.testing.assert_close(run("batched"), torch.ones(3, dtype=F64))


def _writes(w):
    return {"nn.init.zeros_": lambda: nn.init.zeros_(w), ".data.mul_": lambda: w.data.mul_(2),
            "detach().zero_": lambda: w.detach().zero_(), "a view's fill_": lambda: w.view(-1).fill_(0),
            "[0] = 1": lambda: w.__setitem__(0, 1), "+= 1": lambda: w.__iadd__(1),
            "out=": lambda: torch.mul(w.detach(), 2, out=w.detach()),
            "_foreach_mul_": lambda: torch._foreach_mul_([w], 2),
            "a row of unbind()": lambda: w.detach().unbind()[0].zero_(),
            ".data =": lambda: setattr(w, "data", w * 0)}


@pytest.mark.parametrize("kind", ["linear", "conv", "attention"])
def test_writing_into_a_dense_weight_view_is_refused_and_reading_it_works(kind):
    """A low-rank layer's `weight` is computed from its factors on every read: before, a write
    into it (user init code, pruning masks) changed a temporary and the model silently stayed
    as it was. Every write now raises naming the layer; reads act as on a plain tensor."""
    torch.manual_seed(0)
    dense = {"linear": nn.Linear(6, 5), "conv": nn.Conv2d(3, 4, 3),
             "attention": nn.MultiheadAttention(8, 2)}[kind]
    layer = rankwise.to_low_rank(nn.Sequential(dense), rank=2)[0]
    lin = layer.q_proj if kind == "attention" else layer
    before = [t.detach().clone() for t in (lin.U, lin.S, lin.V)]
    views = [layer.weight] if kind != "attention" else [layer.in_proj_weight, layer.in_proj_bias,
                                                          layer.q_proj.weight]
    for w in views:
        for what, write in _writes(w).items():
            with pytest.raises(RuntimeError, match=r"computed on every read, so writing into it .* lost"), \
                    torch.no_grad():
                write()
            assert all(torch.equal(a, b) for a, b in zip(before, (lin.U, lin.S, lin.V), strict=True)), what
    w = lin.weight
    if kind == "conv":
        x = torch.randn(2, 3, 6, 6)
        y = torch.nn.functional.conv2d(x, w, lin.bias)
    else:
        x = torch.randn(3, lin.in_features)
        y = torch.nn.functional.linear(x, w, lin.bias)
    assert type(y) is torch.Tensor and type(w.norm()) is torch.Tensor
    torch.testing.assert_close(y, lin(x))
    (w ** 2).sum().backward()  # autograd reaches the factors through the view
    assert lin.U.grad is not None and lin.U.grad.abs().sum() > 0
    buf = torch.zeros_like(w)
    with torch.no_grad():  # in-place ops that only read the view (an EMA, a copy) are not writes
        buf.copy_(w)
        buf.lerp_(w.detach(), 0.5)
        torch._foreach_add_([buf], [w])
    torch.testing.assert_close(buf, 2 * w.detach())
    import copy
    import io

    saved = io.BytesIO()
    torch.save(w.detach(), saved)
    saved.seek(0)
    assert type(torch.load(saved)) is torch.Tensor and type(copy.deepcopy(w.detach())) is torch.Tensor
