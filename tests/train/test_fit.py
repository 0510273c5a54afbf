"""rankwise.train.fit, the one training loop: against a hand-written loop, its hooks, stopping,
and resuming from a saved position bit for bit."""

import copy

import pytest
import torch
import torch.nn.functional as F

import rankwise
from rankwise.train import Callback, fit


def _data(n=70, d=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def test_fit_equals_a_hand_written_loop():
    x, y = _data()
    a, b = _model(), _model()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    losses = []

    class Log(Callback):
        def on_step_end(self, loop):
            losses.append(loop.loss)

    loop = fit(a, opt_a, x, y, epochs=3, batch_size=16, shuffle=torch.Generator().manual_seed(5),
               callbacks=[Log()])
    g, ref = torch.Generator().manual_seed(5), []
    for _ in range(3):  # the reference: shuffle, minibatches of 16 (the last one 6), SGD
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), 16):
            idx = order[i:i + 16]
            opt_b.zero_grad()
            loss = F.cross_entropy(b(x[idx]), y[idx])
            loss.backward()
            opt_b.step()
            ref.append(float(loss.detach()))
    assert losses == ref and loop.global_step == 15 and loop.steps == 5
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_hooks_order_max_steps_and_stop():
    x, y = _data()
    events = []

    class Spy(Callback):
        def on_fit_start(self, loop):
            events.append("fit")

        def on_epoch_start(self, loop):
            events.append(f"e{loop.epoch}")

        def on_step_end(self, loop):
            events.append(loop.global_step)

        def on_epoch_end(self, loop):
            events.append(f"/e{loop.epoch}")

        def on_fit_end(self, loop):
            events.append("end")

    m = _model()
    fit(m, torch.optim.SGD(m.parameters(), lr=0.1), x, y, epochs=5, batch_size=32, max_steps=4,
        callbacks=[Spy()])
    assert events == ["fit", "e1", 1, 2, 3, "/e1", "e2", 4, "end"]

    class StopAt2(Callback):
        def on_step_end(self, loop):
            loop.stop = loop.global_step == 2

    events.clear()
    loop = fit(m, torch.optim.SGD(m.parameters(), lr=0.1), x, y, epochs=5, batch_size=32,
               callbacks=[StopAt2(), Spy()])
    assert events == ["fit", "e1", 1, 2, "end"] and loop.global_step == 2


class _Memory(Callback):
    """Keeps the loop's, model's and optimizer's state at step `at`; restores it if given."""

    def __init__(self, at=None, restore=None):
        self.at, self.restore, self.saved = at, restore, None

    def on_fit_start(self, loop):
        if self.restore is not None:
            loop.model.load_state_dict(self.restore["model"])
            loop.optimizer.load_state_dict(self.restore["optim"])
            loop.load_state_dict(self.restore["loop"])

    def on_step_end(self, loop):
        if loop.global_step == self.at:
            self.saved = copy.deepcopy({"model": loop.model.state_dict(),
                                        "optim": loop.optimizer.state_dict(), "loop": loop.state_dict()})


@pytest.mark.parametrize("at", [3, 5, 7])  # mid-epoch, an epoch's last step, the next epoch
def test_resume_from_a_saved_position_is_bitwise(at):
    x, y = _data(n=80)
    m = _model()
    rankwise.to_low_rank(m, rank=4)
    opt = rankwise.SDLRT(m, 0.05, tau=0.2, momentum=0.9)
    mem = _Memory(at=at)
    fit(m, opt, x, y, epochs=3, batch_size=16, shuffle=torch.Generator().manual_seed(1), callbacks=[mem])
    m2 = _model(seed=9)  # other weights, overwritten by the restore
    rankwise.to_low_rank(m2, rank=4)
    opt2 = rankwise.SDLRT(m2, 0.05, tau=0.2, momentum=0.9)  # the restore resizes the factors
    loop = fit(m2, opt2, x, y, epochs=3, batch_size=16, shuffle=torch.Generator().manual_seed(123),
               callbacks=[_Memory(restore=mem.saved)])
    assert loop.global_step == 15 and opt.ranks() == opt2.ranks()
    for (n, p), q in zip(m.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(p, q), n


def test_bad_arguments_are_named():
    x, y = _data()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="differ in length"):
        fit(m, opt, x, y[:-1])
    with pytest.raises(ValueError, match="`epochs` must be an int >= 1"):
        fit(m, opt, x, y, epochs=0)
    with pytest.raises(ValueError, match="`max_steps`"):
        fit(m, opt, x, y, max_steps=0)


def test_drop_last_takes_whole_batches_only():
    x, y = _data(n=70)
    sizes = []

    class Sizes(Callback):
        def on_step_end(self, loop):
            sizes.append(len(loop.y))

    m = _model()
    loop = fit(m, torch.optim.SGD(m.parameters(), lr=0.1), x, y, epochs=2, batch_size=16, drop_last=True,
               callbacks=[Sizes()])
    assert sizes == [16] * 8 and loop.steps == 4
    with pytest.raises(ValueError, match="leaves no batch"):
        fit(m, torch.optim.SGD(m.parameters(), lr=0.1), x, y, batch_size=71, drop_last=True)


def _empty_shard(rank: int):
    """2 ranks, 5 samples, batches of 4: the last batch has 1 sample, so rank 0's shard is empty."""
    import torch.distributed as dist

    x, y = _data(n=5)
    m = _model()
    rankwise.to_low_rank(m, rank=4)
    opt = rankwise.DLRT(m, 0.05, tau=0.1, process_group=dist.group.WORLD)
    losses = []

    class Log(Callback):
        def on_step_end(self, loop):
            losses.append(loop.loss)

    fit(m, opt, x, y, epochs=1, batch_size=4, process_group=dist.group.WORLD, callbacks=[Log()])
    return losses


def test_a_rank_with_an_empty_shard_contributes_zero(tmp_path):
    import math

    from distributed import run_world

    out = run_world(_empty_shard, 2, tmp_path)
    assert out[0] == out[1] and len(out[0]) == 2 and all(math.isfinite(v) for v in out[0])
