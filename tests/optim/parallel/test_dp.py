"""Data-parallel DLRT/SDLRT (``process_group=``): 2 gloo ranks on half batches follow the
trajectory of 1 process on the full batch (float64), with rank changes; a diverged replica
is named."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import rankwise
from distributed import run_world

STEPS = 8
CASES = {  # name: (preset, lr, kwargs); each sees its ranks change within STEPS
    "dlrt": ("DLRT", 2.0, dict(tau=0.02)),
    "sdlrt": ("SDLRT", 2.0, dict(tau=0.02, omega=0.8)),
    "sdlrt-two-pass": ("SDLRT", 2.0, dict(tau=0.02, single_pass=False)),
    "sdlrt-every-2": ("SDLRT", 2.0, dict(tau=0.01, update_every=2, momentum=0.5)),
    "sdlrt-adam": ("SDLRT", 0.05, dict(tau=0.02, optimizer="adam")),
    "sdlrt-two-pass-adam": ("SDLRT", 0.02, dict(tau=0.05, single_pass=False, optimizer="adam")),
    "dlrt-budget-sensitivity": ("DLRT", 2.0, dict(target=0.3, ramp_steps=4, allocation="sensitivity")),
}
# Summing half-batch gradients rounds differently from the full batch (~1e-16). SGD's trajectory
# is smooth in it; Adam's less so: it divides each coordinate by its own running |g|, in bases
# the truncation may rotate within nearly equal singular values. The Adam cases' settings were
# chosen where one process on the full batch and on two half-batch losses (no distribution)
# agree to 1e-9 in loss and 3e-7 in weights (two-pass Adam at lr 0.05, ranks at their cap of
# 12, differs there by 0.09 in the weights), and are checked to about that precision.
TOL = {"sgd": dict(rel=1e-9, rtol=1e-8, atol=1e-10), "adam": dict(rel=1e-8, rtol=1e-5, atol=1e-6)}


def _model() -> nn.Module:
    """Low-rank and dense layers mixed (the last layer stays dense), float64."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    return rankwise.to_low_rank(m, rank=3, exclude=["4"], max_rank=12)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 32, 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (STEPS, 32),
                                                                                       generator=g)


def _train(case: str, rank: int = 0, world: int = 1, group=None, data_parallel: str | None = None) -> dict:
    """(`data_parallel` None: the optimizer's default)"""
    preset, lr, kw = CASES[case]
    if data_parallel is not None:
        kw = dict(kw, data_parallel=data_parallel)
    model = _model()
    if group is not None and rank == 1:  # a different initialisation: the broadcast must fix it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = getattr(rankwise, preset)(model, lr, process_group=group, **kw)
    X, Y = _data()
    half = 32 // world
    losses, ranks, sent, formula = [], [], [], []
    for t in range(STEPS):
        lr_layers = {n: m for n, m in model.named_children() if isinstance(m, rankwise.LowRankLinear)}
        owned = [n for n, r in (opt.owners() or {}).items() if r == rank]  # sharded: reduced to their owner
        grads = sum((m.out_features + m.in_features) * m.rank + m.rank**2 for n, m in lr_layers.items()
                    if n not in owned)
        grads += sum(m.out_features for m in lr_layers.values())  # biases: every rank's
        grads += model[4].weight.numel() + model[4].bias.numel()
        slots = 4 * len(lr_layers) + 2  # S, bias, G_K, G_L per low-rank layer; dense W, b
        formula.append(8 * (grads + slots + 2))  # float64, + the presence vector and its two flags
        x, y = X[t, rank * half:(rank + 1) * half], Y[t, rank * half:(rank + 1) * half]

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        losses.append(float(opt.step(closure).detach()))
        ranks.append(tuple(opt.ranks().values()))
        sent.append(opt.allreduce_bytes)
        states = [opt.state[p] for m in model if isinstance(m, rankwise.LowRankLinear)
                  for p in (m.U, m.V, m.S)]
    weights = [m.dense_weight().detach() for m in model if isinstance(m, rankwise.LowRankLinear)]
    buffers = [t.detach().numpy().copy() for m in model if isinstance(m, rankwise.LowRankLinear)
               for t in (m.U_buf, m.V_buf)]
    moments = [st[k].numpy().copy() for st in states for k in ("m", "v") if torch.is_tensor(st.get(k))]
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    digest = hashlib.blake2b(buf.getvalue()).hexdigest()
    return dict(losses=losses, ranks=ranks, weights=weights, last=model[4].weight.detach(), digest=digest,
                taus=list(opt.taus().values()), sent=sent, formula=formula, buffers=buffers, moments=moments,
                owners=opt.owners())


def _dp_worker(rank: int, case: str, data_parallel: str | None = None) -> dict:
    import torch.distributed as dist

    out = _train(case, rank, dist.get_world_size(), dist.group.WORLD, data_parallel)
    # plain arrays: tensors would travel as shared memory, which dies with this process
    out["weights"] = [w.numpy().copy() for w in out["weights"]]
    out["last"] = out["last"].numpy().copy()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_on_half_batches_follow_one_process_on_the_full_batch(case, tmp_path):
    ref = _train(case)
    assert len(set(ref["ranks"])) > 1, "the test must see rank changes"
    out = run_world(_dp_worker, 2, tmp_path, case)
    for r in out:
        r["weights"], r["last"] = [torch.from_numpy(w) for w in r["weights"]], torch.from_numpy(r["last"])
    for r in out:  # identical replicas
        assert r["ranks"] == out[0]["ranks"] and r["taus"] == out[0]["taus"]
        for a, b in zip(r["weights"] + [r["last"]], out[0]["weights"] + [out[0]["last"]], strict=True):
            assert torch.equal(a, b)
    assert out[0]["ranks"] == ref["ranks"]
    if case in ("dlrt", "sdlrt"):  # one pass, factor mode at every step: (m + n)·r + r² per layer
        assert out[0]["sent"] == out[0]["formula"]
    tol = TOL[CASES[case][2].get("optimizer", "sgd")]
    mean_loss = [(a + b) / 2 for a, b in zip(out[0]["losses"], out[1]["losses"], strict=True)]
    assert mean_loss == pytest.approx(ref["losses"], rel=tol["rel"], abs=1e-12)
    for a, b in zip(out[0]["weights"] + [out[0]["last"]], ref["weights"] + [ref["last"]], strict=True):
        torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"])


SHARDED = ["dlrt", "sdlrt", "sdlrt-two-pass", "sdlrt-every-2", "sdlrt-two-pass-adam",
           "dlrt-budget-sensitivity"]


@pytest.mark.parametrize("case", SHARDED)
def test_the_sharded_integrator_equals_the_replicated_one(case, tmp_path):
    """Each layer integrated by its owner and sent to the other rank: the same trajectory,
    bit for bit, as every rank integrating every layer (the owners compute the same thing from
    the same averaged gradients), with rank changes; buffers and optimizer moments included."""
    rep = run_world(_dp_worker, 2, tmp_path, case, "replicated")
    sh = run_world(_dp_worker, 2, tmp_path, case, "sharded")
    assert len(set(rep[0]["ranks"])) > 1, "the test must see rank changes"
    # layer 2 (16 x 24) costs more than layer 0 (24 x 12) at their cap 12: it goes first, to rank 0
    assert rep[0]["owners"] is None and sh[0]["owners"] == sh[1]["owners"] == {"0": 1, "2": 0}
    assert sh[0]["digest"] == sh[1]["digest"]  # a checkpoint's bytes agree across ranks (coded checkpoints)
    for r in (0, 1):
        a, b = rep[r], sh[r]
        assert a["losses"] == b["losses"] and a["ranks"] == b["ranks"] and a["taus"] == b["taus"]
        assert a["sent"] == a["formula"] or case not in ("dlrt", "sdlrt")
        if case in ("dlrt", "sdlrt"):  # the owned layers' gradients are received, not sent
            assert b["sent"] == b["formula"] and all(x < y for x, y in zip(b["sent"], a["sent"], strict=True))
        for x, y in zip(a["weights"] + [a["last"]] + a["buffers"] + a["moments"],
                        b["weights"] + [b["last"]] + b["buffers"] + b["moments"], strict=True):
            assert np.array_equal(x, y)


def _resume_worker(rank: int, tmp: str) -> dict:
    """Sharded SDLRT, 8 steps straight; then as many steps as it took the ranks to change, a
    save, a fresh model and optimizer built from the saved state, the remaining steps."""
    import torch.distributed as dist

    X, Y = _data()
    group, half = dist.group.WORLD, 16

    def run(model, opt, steps):
        ranks = []
        for t in steps:
            x, y = X[t, rank * half:(rank + 1) * half], Y[t, rank * half:(rank + 1) * half]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            ranks.append(opt.ranks())
        return ranks

    def make():
        return rankwise.SDLRT(model, 2.0, tau=0.02, process_group=group, data_parallel="sharded")

    model = _model()
    opt = make()
    history = run(model, opt, range(8))
    straight = [p.detach().numpy().copy() for p in model.parameters()]
    cut = next(t for t, r in enumerate(history) if r != {"0": 3, "2": 3}) + 1
    model = _model()
    opt = make()
    owners = opt.owners()
    run(model, opt, range(cut))
    ranks = opt.ranks()
    saved = {"model": model.state_dict(), "opt": opt.state_dict()}
    torch.save(saved, f"{tmp}/rank{rank}.pt")
    saved = torch.load(f"{tmp}/rank{rank}.pt", weights_only=True)
    model = _model()  # at rank 3: loading the state sets the saved ranks
    model.load_state_dict(saved["model"])
    opt = make()
    opt.load_state_dict(saved["opt"])
    resumed_owners, resumed_ranks = opt.owners(), opt.ranks()
    run(model, opt, range(cut, 8))
    return dict(straight=straight, resumed=[p.detach().numpy().copy() for p in model.parameters()],
                owners=owners, resumed_owners=resumed_owners, ranks=ranks, resumed_ranks=resumed_ranks,
                cut=cut)


def test_a_sharded_run_resumes_bitwise_with_the_same_owners(tmp_path):
    out = run_world(_resume_worker, 2, tmp_path, str(tmp_path))
    for r in out:
        assert r["ranks"] == r["resumed_ranks"] != {"0": 3, "2": 3} and r["cut"] < 8  # restored at new ranks
        assert r["owners"] == r["resumed_owners"] == out[0]["owners"]
        assert len(r["straight"]) == len(r["resumed"])
        for a, b in zip(r["straight"], r["resumed"], strict=True):
            assert np.array_equal(a, b)


def _diverge_worker(rank: int, case: str) -> None:
    import torch.distributed as dist

    data_parallel = case.split(":")[0]
    model = _model()
    opt = rankwise.DLRT(model, 0.1, tau=0.05, process_group=dist.group.WORLD, data_parallel=data_parallel)
    if rank == 1:  # after the broadcast: this replica drifts (sharded: in what every rank computes)
        with torch.no_grad():
            (model[2].S if data_parallel == "replicated" else model[4].weight).mul_(1 + 1e-12)
    x, y = _data()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x[0]), y[0]).backward()
    opt.step()  # its check is gathered on the device, read with the next exchange or a state_dict
    if case == "replicated:saved-on-0" and rank == 0:  # rank 0 alone reads it, and the caller goes on
        with pytest.raises(RuntimeError, match="replicas diverged"):
            opt.state_dict()
    if data_parallel == "replicated":
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[1]), y[1]).backward()
        try:
            opt.step()
        finally:  # raised before the step changed anything
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    else:
        opt.state_dict()


@pytest.mark.parametrize("case, where", [("replicated", "'2'"), ("sharded", "'4.weight'"),
                                         ("replicated:saved-on-0", "'2'")])
def test_a_diverged_replica_is_named(tmp_path, case, where):
    """Found at the step after the drift (its check rides on that step's exchange) or by a
    state_dict; read by rank 0 alone, the next step still raises the same error on every rank."""
    with pytest.raises(AssertionError) as e:
        run_world(_diverge_worker, 2, tmp_path, case)
    msg = str(e.value)
    # two ranks: which one drifted cannot be told (see test_loaders_round2 for three)
    assert "replicas diverged" in msg and "ranks 0 / 1 hold different factors" in msg and where in msg
    assert "NoneType" not in msg and "another rank's" not in msg


def _shape_worker(rank: int) -> None:
    import torch.distributed as dist

    m = nn.Sequential(nn.Linear(8, 8)).double()
    rankwise.to_low_rank(m, rank=2 + rank)
    rankwise.DLRT(m, 0.1, tau=0.1, process_group=dist.group.WORLD)


def test_replicas_with_other_ranks_are_refused_at_construction(tmp_path):
    with pytest.raises(AssertionError) as e:
        run_world(_shape_worker, 2, tmp_path)
    assert "differ at construction: rank 1" in str(e.value)


def test_process_group_needs_torch_distributed():
    m = rankwise.to_low_rank(nn.Sequential(nn.Linear(8, 8)), rank=2)
    with pytest.raises(ValueError, match="init_process_group"):
        rankwise.DLRT(m, 0.1, tau=0.1, process_group=object())


def test_the_device_fingerprint_sees_every_single_bit_and_the_shape():
    """Every one of the 192 bits of a 2×3 float32 tensor, flipped alone, changes its entry's
    fingerprint and no other entry's; equal tensors, on any call, give equal fingerprints; the
    shape and the order of an entry's tensors count."""
    from rankwise.optim.parallel._dp import device_fingerprints

    a, other = torch.randn(2, 3, dtype=torch.float32), torch.randn(3, dtype=torch.float64)
    ref = device_fingerprints([[a], [other]], a.device)
    assert ref.dtype == torch.int64 and torch.equal(ref, device_fingerprints([[a.clone()], [other.clone()]],
                                                                            a.device))
    raw = a.view(-1).view(torch.int32)
    for i in range(raw.numel()):
        for bit in range(32):
            b = a.clone()
            b.view(-1).view(torch.int32)[i] ^= torch.tensor(1, dtype=torch.int32) << bit
            got = device_fingerprints([[b], [other]], a.device)
            assert got[0] != ref[0] and got[1] == ref[1], (i, bit)
    assert device_fingerprints([[a.reshape(3, 2)], [other]], a.device)[0] != ref[0]
    assert device_fingerprints([[a, other]], a.device)[0] != device_fingerprints([[other, a]], a.device)[0]
    # tensors on another device than the hash's travel in one copy (here: "cpu" vs "cpu:0")
    assert torch.equal(device_fingerprints([[a], [other]], torch.device("cpu", 0)), ref)


def _train_worker(rank: int, out: str, method: str) -> dict:
    from rankwise.experiments.train_run import train
    from rankwise.train import TrainConfig

    s = train(TrainConfig(method=method, model="mlp", rank=8, epochs=1, out=Path(out)))
    for h in s["history"]:
        h.pop("epoch_time")  # (differs by rank)
    return {k: s[k] for k in ("test_acc", "ranks", "history")}


def test_train_loop_data_parallel_matches_one_process(tmp_path, method="sdlrt"):
    """rankwise.train under 2 ranks: the whole batch's loss, the same ranks and accuracy as one
    process (float32: the sums round differently, so to 1e-4), records from rank 0 only."""
    from rankwise.experiments.train_run import train
    from rankwise.train import TrainConfig

    ref = train(TrainConfig(method=method, model="mlp", rank=8, epochs=1))
    out = run_world(_train_worker, 2, tmp_path, str(tmp_path / "run"), method)
    assert out[0] == out[1]  # rank 1 reports the same summary
    assert out[0]["ranks"] == ref["ranks"]
    assert abs(out[0]["test_acc"] - ref["test_acc"]) <= 1 / 360
    assert out[0]["history"][0]["train_loss"] == pytest.approx(ref["history"][0]["train_loss"], rel=1e-4)
    names = {p.name for p in (tmp_path / "run").iterdir()}
    events = {n for n in names if n.startswith("events.out.tfevents.")}
    assert len(events) == 1 and names - events == {"final.json", "metrics.csv"}, names  # one writer


def test_rankwise_train_nproc_runs_under_torchrun(tmp_path):
    from helpers import run_cli

    r = run_cli("train", "--nproc", "2", "--method", "dlrt", "--model", "mlp", "--rank", "4", "--epochs", "1",
                "--out", tmp_path / "run")
    assert r.exit_code == 0, r.stderr
    assert "2 processes, data-parallel" in r.stdout
    assert (tmp_path / "run" / "final.json").exists() and (tmp_path / "run" / "metrics.csv").exists()


def _skip_worker(rank: int, data_parallel: str) -> list[int]:
    """update_every=2, on_nonfinite='skip': rank 1's loss is NaN at step 1 (a core step)."""
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    m = rankwise.to_low_rank(m, rank=2, exclude=["2"], max_rank=8)
    opt = rankwise.DLRT(m, 0.1, tau=0.05, update_every=2, on_nonfinite="skip",
                        process_group=dist.group.WORLD, data_parallel=data_parallel)
    g = torch.Generator().manual_seed(rank)
    steps = []
    for t in range(4):
        x, y = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)

        def closure(t=t, x=x, y=y):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            if t == 1 and rank == 1:
                loss = loss * float("nan")
            loss.backward()
            return loss

        opt.step(closure)
        steps.append(opt.param_groups[0]["global_step"])
    return steps


@pytest.mark.parametrize("data_parallel", ["replicated", "sharded"])
def test_a_rank_with_a_non_finite_loss_skips_with_the_others(data_parallel, tmp_path):
    """Every rank takes the same decision: the rank whose loss is NaN skips the core step as the
    others do (it once took the device-side skip alone, advanced its step count and the next
    collective failed)."""
    out = run_world(_skip_worker, 2, tmp_path, data_parallel)
    assert out[0] == out[1] == [1, 1, 2, 3]
