"""export(): low-rank models to plain PyTorch, checked against an independent dense reference
(each low-rank layer's dense_weight() through F.linear / F.conv2d), a torch-only process,
torch.export, the merge rule and the benchmark's smoke run."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rankwise.models import lenet, mlp
from rankwise.nn import AbstractLowRankLayer, LowRankConv2d, LowRankLinear, export, to_low_rank

ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64


# ----------------------------------------------------------------------------- fixtures
def low_rank_layers(model: nn.Module) -> list[AbstractLowRankLayer]:
    return [m for m in model.modules() if isinstance(m, AbstractLowRankLayer)]


@torch.no_grad()
def roughen(model: nn.Module, seed: int = 0, buffer: int = 2) -> nn.Module:
    """Give every low-rank layer a full (non-diagonal) core S and a non-empty SDLRT buffer,
    as training would; returns `model`."""
    g = torch.Generator().manual_seed(seed)
    for layer in low_rank_layers(model):
        U, S, V = layer.U, layer.S, layer.V
        r = layer.rank
        noise = torch.randn(r, r, generator=g, dtype=F64).to(S) * S.diagonal().abs().mean()
        layer.set_factors(U, S + 0.3 * noise, V,
                          torch.randn(layer.out_features, buffer, generator=g, dtype=F64),
                          torch.randn(layer.in_features, buffer, generator=g, dtype=F64))
        assert (layer.S - torch.diag(layer.S.diagonal())).abs().max() > 0
    return model


def low_rank_lenet(dtype: torch.dtype = torch.float32, rank: int = 6) -> nn.Module:
    return roughen(to_low_rank(lenet(size=8).to(dtype), rank=rank))


def low_rank_mlp(dtype: torch.dtype = torch.float32, rank: int = 7) -> nn.Module:
    return roughen(to_low_rank(mlp(64, 48, depth=3).to(dtype), rank=rank))


MODELS = {"lenet": (low_rank_lenet, (1, 8, 8)), "mlp": (low_rank_mlp, (64,))}


@torch.no_grad()
def dense_reference(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The model's function with every low-rank layer replaced by its dense_weight() through
    F.linear / F.conv2d (no rankwise forward involved)."""
    for m in model:
        if isinstance(m, LowRankLinear):
            x = F.linear(x, m.dense_weight(), m.bias)
        elif isinstance(m, LowRankConv2d):
            x = F.conv2d(x, m.dense_weight(), m.bias, m.stride, m.padding, m.dilation)
        else:
            x = m(x)
    return x


def sample(shape: tuple[int, ...], batch: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(1), dtype=dtype)


def assert_plain_torch(model: nn.Module) -> None:
    for name, m in model.named_modules():
        assert type(m).__module__.startswith("torch."), (name, type(m))
    names = [n for n, _ in model.named_buffers()]
    assert not any(n.endswith(("U_buf", "V_buf")) for n in names), names
    assert not any(hasattr(m, "grad_mode") for m in model.modules())


# ----------------------------------------------------------------------------- (a) outputs
TOL = {F64: {"rtol": 1e-12, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-5}}


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("merge", ["auto", "never", "always"])
def test_outputs_match_low_rank_and_dense_reference(name, dtype, merge, one_thread):
    build, shape = MODELS[name]
    model = build(dtype).eval()
    x = sample(shape, dtype=dtype)
    out = export(model, merge=merge)
    with torch.no_grad():
        y = out(x)
        assert y.dtype == dtype
        torch.testing.assert_close(y, model(x), **TOL[dtype])
        torch.testing.assert_close(y, dense_reference(model, x), **TOL[dtype])
    assert not out.training and all(not m.training for m in out.modules())


def test_factorised_weights_are_v_transposed_and_u_s(one_thread):
    model = low_rank_lenet(F64)
    out = export(model, merge="never")
    for name in ("conv1", "conv2", "fc1", "fc2"):
        src, (first, second) = getattr(model, name), getattr(out, name)
        r = src.rank
        assert first.bias is None and first.weight.shape[0] == r
        torch.testing.assert_close(first.weight.reshape(r, -1), src.V.detach().mT)
        torch.testing.assert_close(second.weight.reshape(-1, r), (src.U @ src.S).detach())
        torch.testing.assert_close(second.bias, src.bias.detach())
    assert (out.conv1[0].stride, out.conv1[0].padding, out.conv1[1].kernel_size) == ((1, 1), (2, 2), (1, 1))


def test_conv_geometry_stride_dilation_and_no_bias(one_thread):
    conv = nn.Conv2d(3, 8, (3, 5), stride=(2, 1), padding=(1, 3), dilation=(1, 2), bias=False).double()
    layer = roughen(nn.Sequential(LowRankConv2d.from_dense(conv, rank=4)))[0]
    x = sample((3, 11, 13), dtype=F64)
    ref = F.conv2d(x, layer.dense_weight(), None, layer.stride, layer.padding, layer.dilation)
    for merge in ("never", "always"):
        out = export(layer, merge=merge)  # a low-rank root is replaced directly
        assert all(getattr(m, "bias", None) is None for m in out.modules())
        torch.testing.assert_close(out(x), ref, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- (b) plain torch
@pytest.mark.parametrize("merge", ["auto", "never", "always"])
def test_only_torch_modules_no_buffers_and_same_dtype_mode(merge):
    model = low_rank_lenet(F64).train()
    model.fc1.eval()  # a mixed-mode model keeps each module's own mode
    assert all(m.U_buf.shape[1] == 2 for m in low_rank_layers(model))
    low_rank_layers(model)[0].set_grad_mode("core")  # U, V requires_grad=False while training
    out = export(model, merge=merge)
    assert_plain_torch(out)
    assert out.training and not out.fc1.training and all(not m.training for m in out.fc1.modules())
    assert all(m.training for n, m in out.named_modules() if not n.startswith("fc1"))
    for p in out.parameters():
        assert p.dtype == F64 and p.device.type == "cpu" and p.requires_grad and p.grad is None


def test_half_precision_model_keeps_its_dtype():
    model = low_rank_mlp().to(torch.bfloat16).eval()
    out = export(model)
    assert {p.dtype for p in out.parameters()} == {torch.bfloat16}
    x = sample((64,), dtype=torch.bfloat16)
    ref = dense_reference(copy.deepcopy(model).double(), x.double())
    with torch.no_grad():
        y = out(x).double()
    assert float((y - ref).abs().max()) < 0.05 * float(ref.abs().max())


def test_shared_layer_stays_shared_and_root_layer_is_replaced():
    layer = LowRankLinear(16, 16, 3)
    model = nn.Sequential(OrderedDict(a=layer, relu=nn.ReLU(), b=layer))
    out = export(model, merge="never")
    assert out.a is out.b and isinstance(out.a, nn.Sequential)
    root = export(layer, merge="never")
    assert isinstance(root, nn.Sequential) and [type(m) for m in root] == [nn.Linear, nn.Linear]
    assert isinstance(export(layer, merge="always"), nn.Linear)


def test_unsupported_modules_raise():
    from rankwise.ode import FixedController, LowRankODEBlock

    block = LowRankODEBlock(nn.Identity(), rank=1, steps=1, h=0.1, controller=FixedController(c=1, rank=1))
    with pytest.raises(TypeError, match=r"block \(LowRankODEBlock\)"):
        export(nn.Sequential(OrderedDict(block=block)))

    class OtherLowRank(AbstractLowRankLayer):  # neither LowRankLinear nor LowRankConv2d
        def dense_weight(self):
            return self.weight_matrix()

    with pytest.raises(TypeError, match="OtherLowRank"):
        export(nn.Sequential(OtherLowRank(4, 4, 2, max_rank=None, bias=False)))


# ----------------------------------------------------------------------------- (c), (d) leave rankwise
CHILD = textwrap.dedent("""
    import sys
    sys.modules["rankwise"] = None  # any attempt to import rankwise now raises ImportError
    import torch
    torch.set_num_threads(1)
    d = sys.argv[1]
    x = torch.load(d + "/x.pt")
    model = torch.load(d + "/model.pt", weights_only=False)
    assert all(type(m).__module__.startswith("torch.") for m in model.modules())
    with torch.no_grad():
        torch.save(model(x), d + "/y_pickled.pt")
    program = torch.export.load(d + "/program.pt2")
    torch.save(program.module()(x).detach(), d + "/y_program.pt")
    try:
        import rankwise  # noqa: F401
    except ImportError:
        print("rankwise not importable")
    try:  # the control: the model before export cannot be loaded here
        torch.load(d + "/low_rank.pt", weights_only=False)
    except ImportError:
        print("the low-rank pickle needs rankwise")
""")


def test_torch_save_and_torch_export_round_trip_without_rankwise(tmp_path, one_thread):
    model = low_rank_lenet(torch.float32).eval()
    x = sample((1, 8, 8))
    out = export(model)
    with torch.no_grad():
        y = out(x)
        torch.testing.assert_close(y, dense_reference(model, x), **TOL[torch.float32])
    program = torch.export.export(out, (x,))
    torch.testing.assert_close(program.module()(x), y, rtol=1e-6, atol=1e-6)
    torch.save(x, tmp_path / "x.pt")
    torch.save(out, tmp_path / "model.pt")
    torch.save(model, tmp_path / "low_rank.pt")
    torch.export.save(program, tmp_path / "program.pt2")
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "rankwise not importable" in res.stdout
    assert "the low-rank pickle needs rankwise" in res.stdout
    torch.testing.assert_close(torch.load(tmp_path / "y_pickled.pt"), y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.load(tmp_path / "y_program.pt"), y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_onnx_export_runs_in_onnxruntime(tmp_path, name, one_thread):
    """torch.onnx.export of the exported model; onnxruntime (an independent runtime) gives the
    low-rank model's outputs, for a batch size other than the one exported with."""
    import warnings

    import numpy as np
    import onnxruntime as ort

    build, shape = MODELS[name]
    model = build(torch.float32).eval()
    out = export(model)
    x = sample(shape, batch=3)
    batch = torch.export.Dim("batch", min=1, max=64)
    with warnings.catch_warnings():  # the exporter's own deprecation chatter
        warnings.simplefilter("ignore")
        program = torch.onnx.export(out, (x,), dynamo=True, verbose=False,
                                    dynamic_shapes=({0: batch},))
    program.save(str(tmp_path / "m.onnx"))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    x7 = sample(shape, batch=7)
    (y,) = session.run(None, {session.get_inputs()[0].name: x7.numpy()})
    with torch.no_grad():
        expected = dense_reference(model, x7).numpy()
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- (e) merge
def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_auto_merges_only_layers_that_would_not_shrink():
    # 20×20 at rank 10: 10·(20+20) = 400 = 20·20, the boundary: merged.
    # 20×20 at rank 9: 360 < 400: factorised. 100×20 at rank 4: 480 < 2000: factorised.
    # conv 4→6, 3×3 (6×36) at rank 6: 6·42 = 252 ≥ 216: merged.
    model = nn.Sequential(LowRankLinear(20, 20, 10), LowRankLinear(20, 20, 9), LowRankLinear(20, 100, 4),
                          nn.Unflatten(1, (4, 5, 5)), LowRankConv2d(4, 6, 3, 6, bias=False))
    out = export(model)
    assert [type(m) for m in out] == [nn.Linear, nn.Sequential, nn.Sequential, nn.Unflatten, nn.Conv2d]
    assert [n_params(m) for m in out] == [400 + 20, 360 + 20, 480 + 100, 0, 216]
    never = export(model, merge="never")
    assert [n_params(m) for m in never] == [400 + 20, 360 + 20, 480 + 100, 0, 252]
    always = export(model, merge="always")
    assert [n_params(m) for m in always] == [420, 420, 2100, 0, 216]
    x = sample((20,), dtype=torch.float32)
    with torch.no_grad():
        for variant in (out, never, always):
            torch.testing.assert_close(variant(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", ["sometimes", "Auto", "", None, True, 1])
def test_bad_merge_value_raises(bad):
    with pytest.raises(ValueError, match=r"`merge` must be one of .*; got " + re.escape(repr(bad))):
        export(low_rank_mlp(), merge=bad)


# ----------------------------------------------------------------------------- (f) source untouched
def test_source_model_is_unchanged():
    model = low_rank_lenet(F64).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: (p, p.requires_grad) for n, p in model.named_parameters()}
    types = [type(m) for m in model.modules()]
    out = export(model, merge="never")
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
    assert {n: (p, p.requires_grad) for n, p in model.named_parameters()} == params
    assert [type(m) for m in model.modules()] == types and model.training
    # no storage is shared: editing the export leaves the source alone
    src_ptrs = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert not src_ptrs & {p.untyped_storage().data_ptr() for p in out.parameters()}
    with torch.no_grad():
        for p in out.parameters():
            p.zero_()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


# ----------------------------------------------------------------------------- benchmark smoke
def test_inference_benchmark_quick_runs():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "inference.py"), "--quick"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "| model | batch | params dense |" in res.stdout and "outputs agree" in res.stdout
    rows = [line for line in res.stdout.splitlines() if line.startswith(("| mlp", "| lenet"))]
    assert len(rows) == 4
    for line in rows:
        params_ratio = float(line.split("|")[5])
        assert 0.08 < params_ratio < 0.12  # ≈ 90 % compression
