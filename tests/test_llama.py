"""The LLaMA-style decoder (rankwise.models.llama): rotary positions against their defining
property, causality, which projections are converted, and a `rankwise lm --model llama` run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import rankwise
from rankwise._llama import rotary
from rankwise.models import llama

F64 = torch.float64


def test_rotary_scores_depend_on_the_relative_position_only():
    """⟨R(m)q, R(n)k⟩ = ⟨R(m − n)q, k⟩ for every pair (m, n), checked against a dense rotation
    built independently (2×2 blocks of angle t·10000^(−2i/d)); norms are kept."""
    g = torch.Generator().manual_seed(0)
    d, T = 8, 6
    q = torch.randn(d, generator=g, dtype=F64)
    k = torch.randn(d, generator=g, dtype=F64)
    Rq = rotary(q.expand(1, 1, T, d).clone())[0, 0]  # row t: q at position t
    Rk = rotary(k.expand(1, 1, T, d).clone())[0, 0]

    def R(t: float) -> torch.Tensor:
        M = torch.zeros(d, d, dtype=F64)
        for i in range(d // 2):
            a = t * 10000.0 ** (-2 * i / d)
            c, s = math.cos(a), math.sin(a)
            M[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[c, -s], [s, c]], dtype=F64)
        return M

    for m in range(T):
        torch.testing.assert_close(Rq[m], R(m) @ q, atol=1e-6, rtol=0)
        torch.testing.assert_close(Rq[m].norm(), q.norm(), atol=1e-6, rtol=0)
        for n in range(T):
            torch.testing.assert_close(Rq[m] @ Rk[n], (R(m - n) @ q) @ k, atol=1e-5, rtol=0)


def test_llama_is_causal_untied_and_its_projections_are_the_ones_converted():
    torch.manual_seed(0)
    m = llama(context=16, width=32, depth=2, heads=4).eval()
    x = torch.randint(0, 257, (2, 16))
    x2 = x.clone()
    x2[:, 9] = (x2[:, 9] + 1) % 257
    with torch.no_grad():
        a, b = m(x), m(x2)
    assert a.shape == (2, 16, 257)
    torch.testing.assert_close(a[:, :9], b[:, :9])  # outputs before the change are unchanged
    assert not torch.allclose(a[:, 9:], b[:, 9:])
    assert m.head.weight.data_ptr() != m.tok.weight.data_ptr()  # untied
    assert m.blocks[0].mlp.gate.out_features == 88  # 8/3 · 32 rounded up to a multiple of 8
    from rankwise.experiments.lm.lm_compare import projections

    names = set(projections(m))
    parts = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")
    assert names == {f"blocks.{i}.{p}" for i in range(2) for p in parts}  # the head stays dense
    with pytest.raises(ValueError, match="longer than the context"):
        m(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="even head size"):
        llama(width=36, heads=4)


def test_dlrt_trains_the_llama_and_the_lm_study_runs_it():
    """One DLRT run of the study on the LLaMA-style model (every projection factored at its start
    rank, the head dense): it learns, and its record is keyed apart from the GPT's."""
    from rankwise.experiments.lm.lm_compare import LmRunSpec, run_one

    tiny = dict(steps=3, batch=2, context=16, width=32, depth=1, heads=2, eval_every=2, eval_windows=4,
                final_windows=8)
    spec = LmRunSpec("dlrt", 0.5, model="llama", **tiny)
    r = run_one(spec)
    assert 3 < r["val_bits"] < 10 and r["key"].startswith("llama_dlrt")
    assert LmRunSpec("dlrt", 0.5, **tiny).key == "dlrt_c0.5_lr0.003_s0"
    dense = sum(p.numel() for p in llama(context=16, width=32, depth=1, heads=2).parameters())
    assert r["memory"]["weights"] < 4 * dense
    with pytest.raises(ValueError, match="must be even"):
        LmRunSpec("dense", model="llama", **{**tiny, "width": 36, "heads": 4})
    with pytest.raises(ValueError, match="`model` must be one of"):
        LmRunSpec("dense", model="mamba", **tiny)
    assert isinstance(llama(), nn.Module) and rankwise.models.Llama is type(llama())


def test_the_muon_baseline_steps_the_matrices_by_muon_and_the_rest_by_adamw():
    """`rankwise lm --methods muon`: torch.optim.Muon on exactly the projections' matrices (the
    same update as a Muon of its own), AdamW on the rest, and the schedule's rate reaches both."""
    from rankwise.experiments.lm.lm_compare import LmRunSpec, MuonAdamW, projections, run_one

    torch.manual_seed(0)
    model = llama(context=16, width=32, depth=1, heads=2)
    twin = llama(context=16, width=32, depth=1, heads=2)
    twin.load_state_dict(model.state_dict())
    opt = MuonAdamW(model, projections(model), 0.01)
    ref = torch.optim.Muon([m.weight for m in projections(twin).values()], lr=0.01, weight_decay=0.0,
                           adjust_lr_fn="match_rms_adamw")
    x = torch.randint(0, 257, (2, 16))
    for m in (model, twin):
        nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    ref.step()
    for (n, a), b in zip(projections(model).items(), projections(twin).values(), strict=True):
        torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0, msg=n)
    assert not torch.equal(model.head.weight, twin.head.weight)  # AdamW moved it, the twin's Muon did not
    for g in opt.param_groups:
        g["lr"] = 0.5
    assert opt.muon.param_groups[0]["lr"] == opt.adamw.param_groups[0]["lr"] == 0.5
    r = run_one(LmRunSpec("muon", model="llama", steps=3, batch=2, context=16, width=32, depth=1, heads=2,
                          eval_every=2, eval_windows=4, final_windows=8))
    assert 3 < r["val_bits"] < 10 and r["key"] == "llama_muon_lr0.003_s0" and r["memory"]["optimizer"] > 0


def test_the_cola_baseline_replaces_every_projection_by_b_silu_a_within_the_budget():
    """`rankwise lm --methods cola`: every projection (q, k, v, o, gate, up, down; not the head)
    becomes B·σ(A·x) at the rank whose A and B hold at most (1 − c) of its parameters; the
    model trains (AdamW) and its weights count less than the dense model's."""
    from rankwise.experiments.lm.lm_compare import CoLALinear, LmRunSpec, build, projections, run_one

    tiny = dict(steps=3, batch=2, context=16, width=32, depth=1, heads=2, eval_every=2, eval_windows=4,
                final_windows=8)
    spec = LmRunSpec("cola", 0.5, model="llama", **tiny)
    dense = llama(context=16, width=32, depth=1, heads=2)
    model, opt, info = build(spec)
    cola = {n: m for n, m in model.named_modules() if isinstance(m, CoLALinear)}
    assert set(cola) == set(projections(dense)) and isinstance(model.head, nn.Linear)
    for n, m in cola.items():
        d = projections(dense)[n]
        held = m.A.weight.numel() + m.B.weight.numel()
        assert held <= 0.5 * d.weight.numel() < held + d.in_features + d.out_features  # the largest rank
        x = torch.randn(3, d.in_features)
        torch.testing.assert_close(m(x), m.B(nn.functional.silu(m.A(x))))
    assert isinstance(opt, torch.optim.AdamW) and info["cola_ranks"]
    r = run_one(spec)
    assert 3 < r["val_bits"] < 10 and r["memory"]["weights"] < 4 * sum(p.numel() for p in dense.parameters())


def test_the_gpu_protocol_runs_its_code_on_the_cpu(capsys):
    """benchmarks/lm_gpu.py (issue 48's GPU protocol), tiny, on the CPU: every row trains and its
    state count is below dense AdamW's for the low-rank and Muon rows."""
    from helpers import load_benchmark

    methods = "dense,muon,dlrt-muon-reset"
    rows = load_benchmark("lm_gpu").main(["--device", "cpu", "--small", "--methods", methods])
    assert [r["method"] for r in rows] == ["dense", "muon", "dlrt-muon-reset"]
    assert all(r["failed"] is None and 0 < r["bits"] < 9 for r in rows)
    assert rows[1]["state_mib"] < rows[0]["state_mib"] and rows[2]["state_mib"] < rows[0]["state_mib"]
    assert "| dlrt-muon-reset |" in capsys.readouterr().out
