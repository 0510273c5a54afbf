"""Importing or using rankwise changes nothing process-wide: not the user's random stream, not
torch's thread count, not other optimizers (no global step hooks), and no module-level cache
keeps tensors of one model for the next."""

from __future__ import annotations

import json
import subprocess
import sys
import weakref

import torch
from torch import nn

import rankwise

_SCRIPT = r"""
import hashlib, json, sys
import torch
import torch.optim.optimizer as o
from torch import nn

def train(model, opt, steps):
    for _ in range(steps):
        x = torch.randn(16, 8)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

torch.set_num_threads(2)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 3)
if sys.argv[1] == "rankwise":
    with torch.random.fork_rng():  # (the other model's own initialisation draws from the stream)
        other = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))
    import rankwise
    rankwise.to_low_rank(other, rank=4)
    opt = rankwise.DLRT(other, 0.1, tau=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 12, generator=g)
        other(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    other.eval()
    with torch.no_grad():
        other[0].weight
train(model, torch.optim.Adam(model.parameters(), lr=1e-3), 3)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
hooks = [len(d) for d in (o._global_optimizer_pre_hooks, o._global_optimizer_post_hooks)]
print(json.dumps({"params": digest, "rand": torch.rand(4).tolist(), "threads": torch.get_num_threads(),
                  "hooks": hooks}))
"""


def _run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_plain_training_script_is_the_same_with_rankwise_used_in_between():
    """The same parameters bitwise, random stream, thread count and global optimizer hooks whether
    or not rankwise converted and trained another model in the middle of the script."""
    plain, mixed = _run("plain"), _run("rankwise")
    assert mixed == plain
    assert plain["hooks"] == [0, 0] and plain["threads"] == 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return rankwise.to_low_rank(nn.Sequential(nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 4)), rank=3)


def _train(model: nn.Module, opt, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(8, 10, generator=g)
        opt.zero_grad()
        (model(x) - x[:, :4]).square().mean().backward()
        opt.step()


def test_a_step_never_sets_torchs_thread_count(monkeypatch):
    """torch.set_num_threads is process-wide (another Python thread's torch work would run on one
    thread too) and breaks torch.compile of a training step: the step never calls it."""
    calls = []
    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    monkeypatch.setattr(torch, "get_num_threads", lambda: max(before, 2))
    model = _model()
    _train(model, rankwise.SDLRT(model, 0.1, tau=0.1, momentum=0.9))
    assert calls == []


def _tensors_in(value, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth > 3:
        return False
    if isinstance(value, dict | weakref.WeakKeyDictionary | weakref.WeakValueDictionary):
        return any(_tensors_in(v, depth + 1) for v in list(value.values()))
    if isinstance(value, list | tuple | set | frozenset):
        return any(_tensors_in(v, depth + 1) for v in list(value))
    return False


def test_no_module_level_cache_holds_tensors_after_training():
    """The step's fill directions and a layer's kept weight view belong to their optimizer and
    layer: after a training run (and a weight read in eval mode) no container at module level in
    the library holds a tensor (the studies in rankwise.experiments may cache their data sets:
    they are applications, run by the command line)."""
    model = _model()
    opt = rankwise.DLRT(model, 0.1, tau=0.1)
    _train(model, opt)
    model.eval()
    with torch.no_grad():
        assert model[0].weight.shape == (12, 10)
    library = [(name, mod) for name, mod in list(sys.modules.items()) if name.startswith("rankwise")
               and not name.startswith(("rankwise.experiments", "rankwise.cli"))]
    held = [f"{name}.{key}" for name, mod in library for key, value in list(vars(mod).items())
            if _tensors_in(value)]
    assert held == []
