"""DLRT / SDLRT under FSDP2 (``fully_shard``) over fixed-capacity factors: two gloo ranks follow one
process (float64), the local shards keep their shapes and storage, each rank holds half of the
factors, gradients and moments, a DCP checkpoint reshards from two ranks to one, mixed precision
keeps the padded columns at zero, and what cannot work is refused by name."""

from __future__ import annotations

import pytest
import torch
from tests.distributed import run_world
from tests.optim.parallel.test_ddp import _data, _model, _preset, _share
from torch import nn

import rankwise

CASES = {
    "sdlrt-adam": ("SDLRT", dict(tau=0.1, optimizer="adam")),
    "dlrt-sgd": ("DLRT", dict(tau=0.02, momentum=0.9)),
    "sdlrt-muon": ("SDLRT", dict(tau=0.05, rule="muon")),
    "dlrt-budget": ("DLRT", dict(target=0.5, ramp_steps=6)),
}
STEPS = 10


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(model: nn.Module, opt) -> int:
    """This rank's bytes of low-rank factors, their gradients and their optimizer state."""
    total = 0
    for m in model.modules():
        if isinstance(m, rankwise.LowRankLinear):
            for p in (m.U, m.S, m.V):
                ts = [p, p.grad, *(v for v in opt.state[p].values() if torch.is_tensor(v))]
                total += sum(_local(t).numel() * t.element_size() for t in ts if t is not None)
    return total


def _train(case: str, rank: int | None, world: int, folder: str | None = None, resume: bool = False,
           coded: bool = False) -> dict:
    """`case` for STEPS steps, in one process (`rank` None) on the whole batch or as rank `rank` of
    `world` under fully_shard (each low-rank layer, then the root) on its share; with `folder`, a
    DCP checkpoint after 3 steps (or, `resume`, the last STEPS − 3 steps from it), `coded`: through
    rankwise's coded storage (each rank its row and column in ``folder/rank{i}``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    name, kw = CASES[case]
    X, Y = _share(rank, world)
    model = _model()
    layers = [m for m in model.modules() if isinstance(m, rankwise.LowRankLinear)]
    if rank is not None:
        for m in layers:
            fully_shard(m)
        fully_shard(model)
    cls, kw = _preset(name, kw)
    opt = cls(model, 0.5, **kw)
    where = [(tuple(_local(p).shape), _local(p).data_ptr()) for p in model.parameters()]

    def closure():
        opt.zero_grad()
        loss = ((model(X) - Y) ** 2).mean()
        loss.backward()
        return loss

    def state():
        m, o = get_state_dict(model, opt)
        return {"model": m, "optim": o}

    out = {"losses": [], "ranks": []}
    todo = range(STEPS)
    if folder is not None and resume:
        sd = state()
        dcp.load(sd, checkpoint_id=folder, storage_reader=_coded_reader(folder) if coded else None)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        todo = range(3, STEPS)
    for step in todo:
        if folder is not None and not resume and step == 3:
            dcp.save(state(), checkpoint_id=folder, storage_writer=_coded_writer(folder) if coded else None)
        loss = opt.step(closure).detach().clone()
        if rank is not None:
            torch.distributed.all_reduce(loss)
            loss /= world
        out["losses"].append(float(loss))
        out["ranks"].append([m.rank for m in layers])
    out["moved"] = where != [(tuple(_local(p).shape), _local(p).data_ptr()) for p in model.parameters()]
    out["bytes"] = _bytes(model, opt)
    out["padding"] = sum(4 * m.capacity * p.element_size() for m in layers for p in (m.U, m.S, m.V))
    out["zero_tail"] = all(not _local(t).narrow(1, m.rank, m.capacity - m.rank).any()
                           for m in layers for t in (m.U, m.V))
    return out


def _coded_writer(folder: str):
    from rankwise.ckpt import CodedStorageWriter

    return CodedStorageWriter(folder, t=1)


def _coded_reader(folder: str):
    from rankwise.ckpt import CodedStorageReader

    return CodedStorageReader(folder)


def _lose_a_disk(rank: int, folder: str) -> dict:
    """Four ranks save a coded checkpoint of their shards after 3 steps and train on; rank 2's disk
    is wiped; the group resumes from the checkpoint (rank 2 rebuilt from its peers' symbols)."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    run = _train("sdlrt-adam", rank, 4, folder, coded=True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(Path(folder) / "rank2")
    dist.barrier()
    return {"run": run, "resumed": _train("sdlrt-adam", rank, 4, folder, resume=True, coded=True),
            "rebuilt": (Path(folder) / "rank2" / "fragment.rwck").exists()}


def test_fsdp2_state_resumes_bitwise_after_losing_a_ranks_disk(tmp_path):
    out = run_world(_lose_a_disk, 4, tmp_path, str(tmp_path / "ckpt"), timeout=300.0)
    for got in out:
        assert got["resumed"]["losses"] == got["run"]["losses"][3:]
        assert got["resumed"]["ranks"] == got["run"]["ranks"][3:]
        assert got["rebuilt"]


def _world(rank: int, folder: str) -> dict:
    got = {case: _train(case, rank, 2) for case in CASES}
    got["dcp"] = _train("sdlrt-adam", rank, 2, folder)
    got["resumed"] = _train("sdlrt-adam", rank, 2, folder, resume=True)
    got["refused"] = _refusals()
    got["mixed"] = _mixed_precision(rank)
    got["empty"] = _an_empty_shard(rank)
    return got


def _an_empty_shard(rank: int) -> list[float]:
    """A dense head with one output: its bias (1,) leaves rank 1 an empty shard (the finiteness check
    of the gradients once failed there: an infinity norm of nothing)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = rankwise.to_low_rank(nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 1)).double(),
                                 rank=2, capacity=6, include=["0"])
    fully_shard(model[0])
    fully_shard(model)
    opt = rankwise.SDLRT(model, 0.1, tau=0.1)
    X, Y = _data()
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = ((model(X[rank::2]) - Y[rank::2, :1]) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_a_rank_with_an_empty_shard_steps_with_the_others(fsdp_runs):
    for run in fsdp_runs[0]:
        assert len(run["empty"]) == 3 and all(torch.isfinite(torch.tensor(run["empty"])))


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> tuple[list[dict], str]:
    folder = str(tmp_path_factory.mktemp("fsdp") / "ckpt")
    return run_world(_world, 2, tmp_path_factory.mktemp("pg"), folder, timeout=300.0), folder


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_follows_one_process_and_shards_the_state(fsdp_runs, case):
    runs, _ = fsdp_runs
    one = _train(case, None, 1)
    assert len({r for rs in one["ranks"] for r in rs}) > 1  # the ranks moved
    for run in runs:
        got = run[case]
        assert got["ranks"] == one["ranks"]
        tol = 1e-11 if "muon" in case else 1e-12  # (Muon: Newton–Schulz amplifies the sums' order)
        assert max(abs(a - b) for a, b in zip(got["losses"], one["losses"], strict=True)) < tol
        assert not got["moved"] and got["zero_tail"]
        # each of 2 ranks holds half of the factors, gradients and moments (+ a padded row each)
        assert got["bytes"] <= one["bytes"] / 2 + got["padding"], (got["bytes"], one["bytes"])


def test_a_dcp_checkpoint_of_fsdp2_state_resumes_bitwise_and_in_one_process(fsdp_runs):
    runs, folder = fsdp_runs
    for run in runs:  # two ranks, from the checkpoint: bit for bit
        assert run["resumed"]["losses"] == run["dcp"]["losses"][3:]
        assert run["resumed"]["ranks"] == run["dcp"]["ranks"][3:]
    alone = _train("sdlrt-adam", None, 1, folder, resume=True)  # saved sharded at 2, loaded whole at 1
    assert alone["ranks"] == runs[0]["dcp"]["ranks"][3:]
    assert max(abs(a - b) for a, b in zip(alone["losses"], runs[0]["dcp"]["losses"][3:], strict=True)) < 1e-12


def _refusals() -> list[str]:
    from torch.distributed.fsdp import fully_shard

    out = []
    for capacity, kw in ((None, {}), (4, dict(update_every=2)), (4, dict(single_pass=False))):
        net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        model = fully_shard(rankwise.to_low_rank(net, rank=2, capacity=capacity))
        try:
            rankwise.DLRT(model, 0.1, tau=0.1, **kw)
            out.append("accepted")
        except ValueError as e:
            out.append(str(e))
    return out


def test_fsdp2_wrappings_that_cannot_work_are_refused_by_name(fsdp_runs):
    got = fsdp_runs[0][0]["refused"]
    assert "needs fixed-capacity factors" in got[0] and "capacity='auto'" in got[0]
    assert "update_every > 1" in got[1] and "two-pass" in got[2]


def _mixed_precision(rank: int) -> dict:
    """bf16 parameters in the forward, fp32 gradient reduction: trains, the padded columns stay zero."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 6))
    model = rankwise.to_low_rank(net, rank=2, capacity=10)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model:
        if isinstance(m, rankwise.LowRankLinear):
            fully_shard(m, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = rankwise.SDLRT(model, 0.5, tau=0.3, optimizer="adam")
    X, Y = (t.float() for t in _data())
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = ((model(X[rank::2]) - Y[rank::2]) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    layers = [m for m in model if isinstance(m, rankwise.LowRankLinear)]
    tail = all(not _local(t).narrow(1, m.rank, m.capacity - m.rank).any() for m in layers for t in (m.U, m.V))
    return {"losses": losses, "zero_tail": tail, "below": [m.rank < m.capacity for m in layers]}


def test_mixed_precision_keeps_the_padded_columns_at_zero(fsdp_runs):
    for run in fsdp_runs[0]:
        got = run["mixed"]
        assert got["zero_tail"] and any(got["below"])  # (a padded column to look at)
        assert all(torch.isfinite(torch.tensor(got["losses"])))
        assert got["losses"][-1] < got["losses"][0]


def test_the_pretraining_example_runs_and_resumes_at_another_world_size(tmp_path):
    """``examples/pretrain_fsdp.py`` as the docs run it (tiny): four torchrun workers with a coded
    DCP checkpoint every 2 steps; rank 2's folder of the newest is wiped; one process resumes from it
    (reading the three folders left)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).parents[3] / "examples" / "pretrain_fsdp.py")
    tiny = ["--width", "32", "--depth", "1", "--context", "16", "--batch", "2", "--every", "2",
            "--ckpt", str(tmp_path / "ckpt")]
    cmd, env = rankwise.dist.local_torchrun(4, "x", [])
    cmd = [*cmd[:len(cmd) - 1 - cmd[::-1].index("-m")], script, "--steps", "4", *tiny]
    four = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert four.returncode == 0, four.stderr[-2000:]
    assert "step 4: loss" in four.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_2", "step_4"]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step_4").iterdir()) == [f"rank{i}" for i in range(4)]
    shutil.rmtree(tmp_path / "ckpt" / "step_4" / "rank2")
    one = subprocess.run([sys.executable, script, "--steps", "5", *tiny], capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    assert f"resumed from {tmp_path / 'ckpt' / 'step_4'}" in one.stdout and "step 5: loss" in one.stdout
