"""DLRT / SDLRT on a DistributedDataParallel-wrapped model with fixed-capacity factors: two gloo
ranks on half batches follow one process on the whole batch (float64), the parameters keep their
shapes and storage while the ranks move, and the wrappings that cannot work are refused by name."""

from __future__ import annotations

import pytest
import torch
from tests.distributed import run_world
from torch import nn

import rankwise

STEPS = 12
CASES = {  # name: (preset, keyword arguments, DDP needs find_unused_parameters)
    "dlrt-sgd": ("DLRT", dict(tau=0.02, momentum=0.9), False),
    "sdlrt-adam": ("SDLRT", dict(tau=0.1, optimizer="adam"), False),
    "sdlrt-muon": ("SDLRT", dict(tau=0.05, rule="muon"), False),
    "dlrt-two-pass": ("DLRT", dict(tau=0.02, single_pass=False), True),
    "dlrt-every-2": ("DLRT", dict(tau=0.02, update_every=2, optimizer="adam"), True),
    "dlrt-budget": ("DLRT", dict(target=0.5, ramp_steps=6), False),
}


def _share(rank: int | None, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch (`rank` None), or rank `rank`'s contiguous share of it among `world`."""
    X, Y = _data()
    if rank is None:
        return X, Y
    per = len(X) // world
    return X[rank * per:(rank + 1) * per], Y[rank * per:(rank + 1) * per]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 12, generator=g, dtype=torch.float64)
    return X, torch.tanh(X @ torch.randn(12, 6, generator=g, dtype=torch.float64)) * 3


def _model() -> nn.Module:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 6)).double()
    return rankwise.to_low_rank(net, rank=2, capacity=6)


def _preset(name: str, kw: dict):
    kw = dict(kw)
    if kw.get("rule") == "muon":
        kw["rule"] = rankwise.Muon()
    return getattr(rankwise, name), kw


def _train(case: str, rank: int | None, world: int) -> dict:
    """`case` for STEPS steps: in one process (`rank` None) on the whole batch, or as DDP rank
    `rank` of `world` on its contiguous share. Losses (the whole batch's), ranks, final weights, and
    whether any parameter's shape or storage changed."""
    name, kw, unused = CASES[case]
    X, Y = _share(rank, world)
    model = _model()
    layers = [m for m in model.modules() if isinstance(m, rankwise.LowRankLinear)]
    if rank is not None:
        net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
    else:
        net = model
    cls, kw = _preset(name, kw)
    opt = cls(net, 0.5, **kw)
    where = [(tuple(p.shape), p.data_ptr()) for p in model.parameters()]
    losses, ranks, moved = [], [], False

    def closure():
        opt.zero_grad()
        loss = ((net(X) - Y) ** 2).mean()
        loss.backward()
        return loss

    for _ in range(STEPS):
        loss = opt.step(closure)
        if rank is not None:
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss)
            loss /= world
        losses.append(float(loss.detach()))
        ranks.append([m.rank for m in layers])
        moved |= where != [(tuple(p.shape), p.data_ptr()) for p in model.parameters()]
    return {"losses": losses, "ranks": ranks, "moved": moved,
            "weights": [m.weight.detach().tolist() for m in layers],  # (plain data across processes)
            "zero_tail": all(not (m.U[:, m.rank:].any() or m.S[m.rank:].any() or m.S[:, m.rank:].any()
                                  or m.V[:, m.rank:].any()) for m in layers)}


def _ddp_cases(rank: int) -> dict:
    return {case: _train(case, rank, 2) for case in CASES}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> list[dict]:
    return run_world(_ddp_cases, 2, tmp_path_factory.mktemp("ddp"), timeout=300.0)


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_follows_one_process(ddp_runs, case):
    one = _train(case, None, 1)
    seen = {r for step in one["ranks"] for r in step}
    assert len(seen) > 1, f"{case}: the ranks never moved ({seen}); the case tests nothing"
    for got in ddp_runs:
        run = got[case]
        assert run["ranks"] == one["ranks"]
        # (Muon's Newton–Schulz iteration amplifies the order in which the half-batch sums are added:
        # 3.8e-12 measured on losses near 3)
        tol = 1e-11 if "muon" in case else 1e-12
        assert max(abs(a - b) for a, b in zip(run["losses"], one["losses"], strict=True)) < tol
        for w, v in zip(run["weights"], one["weights"], strict=True):
            torch.testing.assert_close(torch.tensor(w), torch.tensor(v), rtol=0, atol=tol)
        assert not run["moved"] and run["zero_tail"]
    assert ddp_runs[0][case]["weights"] == ddp_runs[1][case]["weights"]  # the replicas agree exactly


def _refusals(rank: int) -> list[str]:
    out = []
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    exact = nn.parallel.DistributedDataParallel(rankwise.to_low_rank(net, rank=2))
    fixed = nn.parallel.DistributedDataParallel(rankwise.to_low_rank(
        nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double(), rank=2, capacity=4))
    for make in (lambda: rankwise.DLRT(exact, 0.1, tau=0.1),
                 lambda: rankwise.DLRT(fixed, 0.1, tau=0.1, update_every=2),
                 lambda: rankwise.DLRT(fixed, 0.1, tau=0.1, single_pass=False),
                 lambda: rankwise.DLRT(fixed, 0.1, tau=0.1, process_group=torch.distributed.group.WORLD)):
        try:
            make()
            out.append("accepted")
        except ValueError as e:
            out.append(str(e))
    return out


def test_wrappings_that_cannot_work_are_refused_by_name(tmp_path):
    got = run_world(_refusals, 2, tmp_path, timeout=120.0)[0]
    assert "fixed-capacity factors" in got[0] and "'0'" in got[0] and "capacity=" in got[0]
    assert "update_every > 1" in got[1] and "find_unused_parameters=True" in got[1]
    assert "two-pass" in got[2] and "find_unused_parameters=True" in got[2]
    assert "not a DistributedDataParallel wrapper" in got[3]


def _dcp_train(rank: int | None, world: int, folder: str, resume: bool) -> list:
    """SDLRT-Adam under DDP at `world` ranks (`rank` None: one process, no DDP): 2 steps, a DCP
    checkpoint of model and optimizer (``get_state_dict``), 8 more; or, `resume`, load the
    checkpoint into a fresh model and optimizer (``set_state_dict``) and run the last 8. Returns
    the losses and ranks of the steps run after the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    X, Y = _share(rank, world)
    model = _model()
    net = model if rank is None else nn.parallel.DistributedDataParallel(model)
    opt = rankwise.SDLRT(net, 0.5, tau=0.1, optimizer="adam")

    def closure():
        opt.zero_grad()
        loss = ((net(X) - Y) ** 2).mean()
        loss.backward()
        return loss

    def steps(n: int) -> list:
        out = []
        for _ in range(n):
            loss = opt.step(closure).detach().clone()
            if rank is not None:
                torch.distributed.all_reduce(loss)
                loss /= world
            out.append((float(loss), list(opt.ranks().values())))
        return out

    if resume:
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return steps(8)
    steps(2)
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=folder)
    return steps(8)


def test_a_dcp_checkpoint_of_a_ddp_run_resumes_bitwise_and_at_another_world_size(tmp_path):
    folder = str(tmp_path / "ckpt")
    straight = run_world(_dcp_train, 2, tmp_path, 2, folder, False)
    resumed = run_world(_dcp_train, 2, tmp_path, 2, folder, True)
    assert resumed == straight  # two ranks, from the checkpoint: bit for bit
    alone = _dcp_train(None, 1, folder, True)  # saved at two ranks, resumed in one process
    assert [r for _, r in alone] == [r for _, r in straight[0]]
    assert max(abs(a - b) for (a, _), (b, _) in zip(alone, straight[0], strict=True)) < 1e-12
    assert len({r for _, rs in straight[0] for r in rs}) > 1  # the ranks moved after the checkpoint
