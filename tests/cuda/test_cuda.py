"""CUDA checks, skipped without a CUDA device (run: ``PYTHONPATH=src python -m pytest -q
tests/cuda`` on a machine with a GPU). The same small problems on CPU float64 and CUDA float64
must agree (cuSOLVER's SVD against LAPACK's; float32 cores on CUDA take the float64-Gram
``eigh``); PEFT adapters train under ``RankwiseTrainer`` on the GPU; ``CodedCheckpointer``
saves CUDA state and it loads back onto the GPU bit for bit.

``RANKWISE_TEST_DEVICE=cpu`` runs the same tests on the CPU (a check of the tests themselves
on a machine without a GPU; the CPU/GPU comparisons then compare the CPU with itself)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import rankwise
from distributed import run_world
from helpers import mse_closure
from rankwise import DLRT, SDLRT

DEVICE = os.environ.get("RANKWISE_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")
F64 = torch.float64


def _model(device):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 48),
                      nn.Tanh(), nn.Linear(48, 4)).to(F64)
    rankwise.to_low_rank(m, rank=6)
    return m.to(device)


def _train(model, opt, device, steps=12):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(128, 32, generator=g, dtype=F64).to(device)
    Y = torch.randn(128, 4, generator=g, dtype=F64).to(device)
    closure = mse_closure(opt, model, X, Y)
    for _ in range(steps):
        loss = opt.step(closure)
    return float(loss)


CASES = {
    "dlrt-tau-sgd": (DLRT, dict(tau=0.05, momentum=0.9)),
    "dlrt-tau-adam": (DLRT, dict(tau=0.05, optimizer="adam")),
    "dlrt-budget": (DLRT, dict(target=0.6, ramp_steps=6, momentum=0.9)),
    "sdlrt-tau": (SDLRT, dict(tau=0.05, momentum=0.9)),
    "sdlrt-budget": (SDLRT, dict(target=0.6, ramp_steps=6, optimizer="adam")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_and_cuda_float64_agree(case):
    cls, kw = CASES[case]
    results = {}
    for dev in ("cpu", DEVICE):
        model = _model(dev)
        loss = _train(model, cls(model, 0.05, **kw), dev)
        layers = [m for m in model.modules() if isinstance(m, rankwise.LowRankLinear)]
        results[dev] = (loss, [m.rank for m in layers], [m.weight_matrix().detach().cpu() for m in layers])
    (lc, rc, Wc), (lg, rg, Wg) = results["cpu"], results[DEVICE]
    assert rc == rg
    assert abs(lc - lg) <= 1e-10
    for a, b in zip(Wc, Wg, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_to_low_rank_and_export_of_a_cuda_model():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(DEVICE)
    x = torch.randn(8, 64, device=DEVICE)
    low = rankwise.to_low_rank(dense, rank=64)
    assert all(p.device.type == DEVICE for p in low.parameters())
    plain = rankwise.export(low)
    assert all(p.device.type == DEVICE for p in plain.parameters())
    torch.testing.assert_close(plain(x), low(x), atol=1e-4, rtol=1e-4)


def test_one_host_transfer_per_augmenting_step_on_cuda():
    """Counted by torch's CUDA sync debug mode: the step's own reads are the one transfer;
    cuSOLVER's error checks inside torch.linalg (one per batched factorisation) may add more,
    and are reported, not asserted."""
    import warnings

    if DEVICE != "cuda":
        pytest.skip("CUDA's sync debug mode")
    model = _model("cuda").float()
    opt = DLRT(model, 0.05, tau=0.05, optimizer="adam")
    X = torch.randn(64, 32, device="cuda")
    opt.zero_grad()
    (model(X) ** 2).mean().backward()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(x.message) for x in w)
    print(f"device→host synchronisations in one augmenting step: {syncs}")
    assert syncs >= 1


def _tiny_bert(transformers, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(cfg).eval()


def test_peft_adapters_train_under_rankwise_trainer_and_reload_on_the_device(tmp_path):
    """HF's Trainer puts the model on the GPU; the integrator (SDLRT) runs inside its optimizer
    step there, the ranks move, and a saved adapter loads into a fresh model on the GPU with
    the same logits."""
    transformers = pytest.importorskip("transformers")
    from rankwise.peft import (
        AdapterConfig,
        RankwiseTrainer,
        adapters,
        get_adapter_model,
        load_adapter,
        save_adapter,
    )

    config = AdapterConfig(["query", "key", "value"], r=4, tau=0.05, modules_to_save=["classifier"])
    model = get_adapter_model(_tiny_bert(transformers), config)
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 50, (16, 12), generator=g), torch.randint(0, 3, (16,), generator=g)
    data = [{"input_ids": ids[i], "labels": y[i]} for i in range(len(y))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=6, learning_rate=0.02,
                                          per_device_train_batch_size=8, report_to=[], save_strategy="no",
                                          use_cpu=DEVICE == "cpu", disable_tqdm=True, max_grad_norm=0.0)
    trainer = RankwiseTrainer(model=model, args=args, train_dataset=data)
    before = {n: m.rank for n, m in adapters(model)}
    trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(opt, rankwise.SDLRT)
    assert {n: m.rank for n, m in adapters(model)} != before
    assert all(p.device.type == DEVICE for p in model.parameters())
    for _, layer in adapters(model):  # the bases stay orthonormal on the device
        eye = torch.eye(layer.rank, device=layer.U.device)
        torch.testing.assert_close(layer.U.T @ layer.U, eye, atol=1e-4, rtol=0)
        torch.testing.assert_close(layer.V.T @ layer.V, eye, atol=1e-4, rtol=0)
    save_adapter(model, tmp_path / "adapter")
    fresh = load_adapter(get_adapter_model(_tiny_bert(transformers), config).to(DEVICE), tmp_path / "adapter")
    assert all(p.device.type == DEVICE for p in fresh.parameters())
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids.to(DEVICE)).logits
        got = fresh.eval()(input_ids=ids.to(DEVICE)).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def _device_state(device: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 5)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 20, device=device)).sum().backward()
        opt.step()
    return model, opt


def _save_wipe_restore(rank: int, store: str, device: str):
    """Each rank saves a GPU model and its Adam state, rank 2 loses its store, every rank
    restores and loads the state into a fresh model and optimizer on the GPU."""
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer

    model, opt = _device_state(device)
    ck = CodedCheckpointer(t=1, store_dir=store)
    ck.save({"model": model.state_dict(), "optim": opt.state_dict()}, 1)
    dist.barrier()
    if rank == 2:
        shutil.rmtree(Path(store) / "step_0000000001" / "rank2")
    dist.barrier()
    state, step = ck.restore()
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 5)).to(device)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    moments = [(opt.state[p], fresh_opt.state[q]) for p, q in zip(model.parameters(), fresh.parameters(),
                                                                   strict=True)]
    same_moments = all(torch.equal(a[k], b[k]) for a, b in moments for k in ("exp_avg", "exp_avg_sq"))
    where = {t.device.type for t in fresh.parameters()} | {b[k].device.type for _, b in moments
                                                           for k in ("exp_avg", "exp_avg_sq")}
    return dict(step=step, same=same, same_moments=same_moments, where=sorted(where),
                repaired=ck.stats()["repaired"])


def test_coded_checkpointer_saves_device_state_and_restores_it_bit_for_bit(tmp_path):
    out = run_world(_save_wipe_restore, 4, tmp_path, str(tmp_path / "store"), DEVICE, timeout=240)
    for r in out:
        assert r["step"] == 1 and r["same"] and r["same_moments"]
        assert r["where"] == [DEVICE] and r["repaired"] == [2]


def test_the_lm_gpu_protocol_trains_on_cuda(capsys):
    """benchmarks/lm_gpu.py, tiny, on CUDA (its full run is docs/lm.md's GPU protocol)."""
    from helpers import load_benchmark

    methods = "dense,dlrt-reset,dlrt-muon-reset"
    rows = load_benchmark("lm_gpu").main(["--device", DEVICE, "--small", "--methods", methods])
    assert all(r["failed"] is None and (DEVICE != "cuda" or r["peak_mib"] > 0) for r in rows)


def test_replica_fingerprints_of_device_and_host_tensors():
    """The data-parallel replica check hashes the factors on the device and a host τ after one
    copy: repeatable, and a flipped bit on either side changes only its entry."""
    from rankwise.optim.parallel._dp import device_fingerprints

    dev = torch.device(DEVICE)
    a, tau = torch.randn(4, 3, device=dev), torch.tensor(0.25, dtype=torch.float64)
    ref = device_fingerprints([[a, tau], [a.clone()]], dev)
    assert ref.device.type == dev.type and torch.equal(ref, device_fingerprints([[a, tau], [a]], dev))
    other = tau.clone()
    other.view(torch.int64).bitwise_xor_(1)
    got = device_fingerprints([[a, other], [a]], dev)
    assert got[0] != ref[0] and got[1] == ref[1]
