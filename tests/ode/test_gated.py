"""The gated matrix-memory field and the sequence classifier built on it."""

import pytest
import torch
from torch import nn

from helpers import DenseField
from rankwise.experiments.ode_seq import FromInitialMemory
from rankwise.ode import (
    FixedController,
    GatedMemoryField,
    LowRankState,
    SequenceClassifier,
    audit_gradients,
    ksl_reverse,
    ksl_step,
)

F64 = torch.float64


def _field(position_weights, m=11, n=9, p=4, steps=5, seed=0, recurrence="kron"):
    f = GatedMemoryField(m, n, p, steps=steps, h=0.25, window=3, position_weights=position_weights,
                         recurrence=recurrence, generator=torch.Generator().manual_seed(seed), dtype=F64)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # away from the initial values, so that every term matters
        for prm in f.parameters():
            prm.add_(0.3 * torch.randn(prm.shape, generator=g, dtype=F64))
    f.set_input(torch.randn(3, steps, generator=torch.Generator().manual_seed(seed + 2), dtype=F64))
    return f


@pytest.mark.parametrize("position_weights, recurrence", [(False, "kron"), (True, "kron"), (False, "full")])
def test_projections_equal_the_dense_field_for_any_factors(position_weights, recurrence):
    f = _field(position_weights, recurrence=recurrence)
    g = torch.Generator().manual_seed(1)
    X, K = torch.randn(3, 11, 5, generator=g, dtype=F64), torch.randn(3, 11, 5, generator=g, dtype=F64)
    V, L = torch.randn(3, 9, 5, generator=g, dtype=F64), torch.randn(3, 9, 5, generator=g, dtype=F64)
    S = torch.randn(3, 5, 5, generator=g, dtype=F64)
    for t in (0.0, 0.3, 1.2):
        torch.testing.assert_close(f.apply_right(t, K, V), f(t, K @ V.mT) @ V, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(f.apply_left(t, X, L), f(t, X @ L.mT).mT @ X, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(f.project(t, X, S, V), X.mT @ f(t, X @ S @ V.mT) @ V,
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("position_weights, recurrence", [(False, "kron"), (True, "kron"), (False, "full")])
def test_bound_projections_equal_the_dense_field_at_every_argument(position_weights, recurrence):
    """A reverse's implicit solve binds a substep once (t and the fixed factors) and evaluates it
    at many K, S or L: each evaluation equals the dense field's projection, and the block's
    counting wrapper counts one field evaluation per call."""
    from rankwise.ode._block import _Counted

    f = _field(position_weights, recurrence=recurrence)
    g = torch.Generator().manual_seed(3)
    X, V = torch.randn(3, 11, 5, generator=g, dtype=F64), torch.randn(3, 9, 5, generator=g, dtype=F64)
    counted = _Counted(f)
    for t in (0.0, 0.6):
        right, left, proj = f.bind_right(t, V), f.bind_left(t, X), counted.bind_project(t, X, V)
        for _ in range(3):  # new arguments for the same binding
            K, L = torch.randn(3, 11, 5, generator=g, dtype=F64), torch.randn(3, 9, 5, generator=g, dtype=F64)
            S = torch.randn(3, 5, 5, generator=g, dtype=F64)
            torch.testing.assert_close(right(K), f(t, K @ V.mT) @ V, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(left(L), f(t, X @ L.mT).mT @ X, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(proj(S), X.mT @ f(t, X @ S @ V.mT) @ V, rtol=1e-12, atol=1e-12)
    assert counted.calls == 6


@pytest.mark.parametrize("recurrence", ["kron", "full"])
def test_the_core_follows_the_gru_ode_and_the_rest_decays(recurrence):
    """For F = P c Tᵀ + E with E outside the frames: Pᵀ f T = z ⊙ (n − c), with the gates written
    out here from the documented formula (A c Bᵀ, or U vec(c) as a matrix-vector product per
    sample), and the part outside the frames is −λ E."""
    f = _field(True, steps=4, recurrence=recurrence)
    P, T = f.frames()
    g = torch.Generator().manual_seed(5)
    c = torch.randn(3, 4, 4, generator=g, dtype=F64)
    E = torch.randn(3, 11, 9, generator=g, dtype=F64)
    E = E - P @ (P.mT @ E)  # columns outside span(P)
    F = P @ c @ T.mT + E
    i, t = 2, 2 * 0.25 + 0.1
    u = f._u[:, i:i + 3]  # (B, w): u_{i-2..i}

    def reads(k):  # the gate's reading of the core
        if recurrence == "kron":
            return f.A[k] @ c @ f.B[k].mT
        return torch.stack([(f.U[k] @ c[b].reshape(-1)).reshape(4, 4) for b in range(3)])

    pre = [reads(k) + torch.einsum("bw,wpq->bpq", u, f.W[k, i]) + f.b[k] + f.Z[k, i] for k in range(2)]
    z, n = torch.sigmoid(pre[0]), torch.tanh(pre[1])
    dF = f(t, F)
    torch.testing.assert_close(P.mT @ dF @ T, z * (n - c), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dF - P @ (P.mT @ dF @ T) @ T.mT, -f.decay * (F - P @ c @ T.mT),
                               rtol=1e-12, atol=1e-12)


def test_window_reads_only_the_past():
    """At time t the field reads u_{i−w+1..i}, i = ⌊t/h⌋: changing u_j, j > i, leaves it alone."""
    f = _field(False, steps=6)
    F = torch.randn(3, 11, 9, dtype=F64)
    before, later = f(2 * 0.25, F), f(4 * 0.25, F)
    u = f._u[:, 2:].clone()  # (the padded input; 2 zeros in front)
    u[:, 3] += 1.0  # step 3 changes: seen by steps 3, 4, 5
    f.set_input(u)
    torch.testing.assert_close(f(2 * 0.25, F), before, rtol=0, atol=0)
    assert (f(4 * 0.25, F) - later).abs().max() > 1e-3


def test_a_ksl_step_reads_one_element_ahead():
    """KSL's S-substep runs at t + h, so step i depends on u_{i+1} (documented), not on u_{i+2}."""
    f = _field(False, steps=6)
    state = LowRankState.from_dense(torch.randn(3, 11, 9, generator=torch.Generator().manual_seed(4),
                                                dtype=F64), 4)
    base = ksl_step(state, f, 2 * 0.25, 0.25).dense()
    u = f._u[:, 2:].clone()
    u[:, 4] += 1.0
    f.set_input(u)
    assert torch.equal(ksl_step(state, f, 2 * 0.25, 0.25).dense(), base)
    u[:, 3] += 1.0
    f.set_input(u)
    assert (ksl_step(state, f, 2 * 0.25, 0.25).dense() - base).abs().max() > 1e-4


def test_a_causal_ksl_step_reads_only_its_own_element():
    """With s_time="start" the S-substep runs at t, so step i reads u_i (and the window before
    it) but not u_{i+1}."""
    f = _field(False, steps=6)
    state = LowRankState.from_dense(torch.randn(3, 11, 9, generator=torch.Generator().manual_seed(4),
                                                dtype=F64), 4)
    base = ksl_step(state, f, 2 * 0.25, 0.25, s_time="start").dense()
    u = f._u[:, 2:].clone()
    u[:, 3] += 1.0
    f.set_input(u)
    assert torch.equal(ksl_step(state, f, 2 * 0.25, 0.25, s_time="start").dense(), base)
    u[:, 2] += 1.0
    f.set_input(u)
    assert (ksl_step(state, f, 2 * 0.25, 0.25, s_time="start").dense() - base).abs().max() > 1e-4
    with pytest.raises(ValueError, match="s_time"):
        ksl_step(state, f, 0.0, 0.25, s_time="middle")


@pytest.mark.parametrize("causal", [True, False])
def test_perturbing_element_i_plus_1_leaves_a_causal_model_unchanged_up_to_step_i(causal):
    """The memory after steps 0..i (what a per-step output would read) is bit-for-bit unchanged
    when u_{i+1} changes, for the causal classifier; the textbook step sees it one step early."""
    model = _classifier(causal=causal)
    g = torch.Generator().manual_seed(7)
    u = torch.randn(2, 7, generator=g, dtype=F64)

    def memories(u):
        model.set_input(u)
        state = LowRankState.from_dense(model.initial_state(2), model.block.rank)
        out = []
        with torch.no_grad():
            for i in range(7):
                state = model.block.step(state, i)
                out.append(model.field.core(state))
        return out

    base = memories(u)
    for i in (0, 3, 5):
        v = u.clone()
        v[:, i + 1] += 1.0
        new = memories(v)
        assert all(torch.equal(a, b) for a, b in zip(base[:i], new[:i], strict=True))
        assert torch.equal(base[i], new[i]) == causal
        assert (base[i + 1] - new[i + 1]).abs().max() > 1e-6


@pytest.mark.parametrize("s_time", ["end", "start"])
def test_steps_and_reverses_equal_the_dense_path(s_time):
    f = _field(True)
    g = torch.Generator().manual_seed(3)
    state = LowRankState.from_dense(torch.randn(3, 11, 9, generator=g, dtype=F64), 4)
    for t in (0.0, 0.5):
        a, b = (ksl_step(state, fld, t, 0.25, s_time=s_time) for fld in (f, DenseField(f)))
        torch.testing.assert_close(a.dense(), b.dense(), rtol=1e-12, atol=1e-12)
        back = ksl_reverse(a, f, t, 0.25, s_time=s_time)
        torch.testing.assert_close(back.dense(), state.dense(), rtol=1e-9, atol=1e-11)
        if s_time == "start":  # really another step (the input changes between t and t + h)
            assert (a.dense() - ksl_step(state, f, t, 0.25).dense()).abs().max() > 1e-6


def _classifier(**kw):
    kw = dict(controller=FixedController(3, 3), m=8, rank=3, p=4, h=0.25, window=2, hidden=16) | kw
    model = SequenceClassifier(7, 4, **kw).double()
    return model


@pytest.mark.parametrize("causal, recurrence", [(True, "kron"), (False, "kron"), (True, "full")])
def test_reversal_gradients_equal_dense_autograd(causal, recurrence):
    torch.manual_seed(0)
    model = _classifier(position_weights=True, causal=causal, recurrence=recurrence)
    g = torch.Generator().manual_seed(0)
    u = torch.randn(5, 7, generator=g, dtype=F64)
    y = torch.randint(0, 4, (5,), generator=g)
    cos = audit_gradients(FromInitialMemory(model, u), model.initial_state(5),
                          lambda logits: nn.functional.cross_entropy(logits, y))
    assert cos > 1 - 1e-9

    def grads(reversible):
        model.block.reversible = reversible
        model.zero_grad()
        nn.functional.cross_entropy(model(u), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_tiny_classifier_learns():
    """Two classes told apart by where a bump sits in the sequence: the loss falls."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (64,), generator=g)
    u = 0.1 * torch.randn(64, 7, generator=g)
    u[torch.arange(64), 1 + 4 * y] += 2.0
    model = SequenceClassifier(7, 2, controller=FixedController(4, 3), m=8, rank=3, p=4, window=1, hidden=16)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    losses = []
    for _ in range(40):
        loss = nn.functional.cross_entropy(model(u), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    assert (model(u).argmax(1) == y).float().mean() > 0.95


def test_bad_input_is_named():
    f = GatedMemoryField(8, 8, 4, steps=5, h=0.25)
    with pytest.raises(RuntimeError, match="set_input"):
        f(0.0, torch.zeros(1, 8, 8))
    with pytest.raises(ValueError, match=r"`u` must be \(batch, 5\)"):
        f.set_input(torch.zeros(2, 6))
    with pytest.raises(ValueError, match="p <= min"):
        GatedMemoryField(8, 3, 4, steps=5, h=0.25)
    with pytest.raises(ValueError, match="`rank` must be in"):
        SequenceClassifier(5, 2, controller=FixedController(2, 9), m=8, rank=9)


def test_cached_frames_follow_parameter_updates():
    """The no-grad frame cache is refreshed by an in-place update (an optimizer step) and by a
    dtype change; with autograd on, the frames carry gradient to P and T."""
    f = GatedMemoryField(8, 6, 3, steps=4, h=0.25)
    with torch.no_grad():
        first = f.frames()[0].clone()
        f.P.add_(0.5)
        Q, R = torch.linalg.qr(f.P)
        torch.testing.assert_close(f.frames()[0], Q * R.diagonal().sign())
        assert not torch.allclose(f.frames()[0], first)
    f.double()
    with torch.no_grad():
        assert f.frames()[1].dtype == torch.float64
    assert f.frames()[0].requires_grad


def test_cached_drive_follows_the_step_the_input_and_the_parameters():
    """Without autograd the last step's drive is kept; it must equal the drive computed afresh
    after a new step, a new input, an optimizer step (in place) and a dtype change, and with
    autograd on it carries gradient to W, b and Z."""
    f = _field(True)

    def fresh(t):
        with torch.enable_grad():
            return f._drive(t).detach()

    with torch.no_grad():
        for t in (0.0, 0.1, 0.25, 0.5, 0.25):
            torch.testing.assert_close(f._drive(t), fresh(t), rtol=0, atol=0)
        before = f._drive(0.5).clone()
        f.set_input(torch.randn(3, 5, dtype=F64))
        torch.testing.assert_close(f._drive(0.5), fresh(0.5), rtol=0, atol=0)
        assert not torch.equal(f._drive(0.5), before)
        for prm in (f.W, f.b, f.Z):
            before = f._drive(0.5).clone()
            prm.add_(0.1)
            torch.testing.assert_close(f._drive(0.5), fresh(0.5), rtol=0, atol=0)
            assert not torch.equal(f._drive(0.5), before)
    f.float()
    f.set_input(torch.randn(3, 5))
    with torch.no_grad():
        assert f._drive(0.5).dtype == torch.float32
    assert f._drive(0.5).requires_grad
