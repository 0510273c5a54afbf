"""rankwise.train's after-backward hook (Callback.on_after_backward): called inside the step, with
the step's gradients and the weights not yet moved; lm's memory count reads it."""

import torch
from torch import nn

import rankwise
from rankwise.train import Callback, fit


def _data(n: int = 24):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


class _Seen(Callback):
    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, bool]] = []  # (global step, gradients there, weights unmoved)
        self.before: torch.Tensor | None = None

    def on_after_backward(self, loop) -> None:
        w = loop.model[0].weight
        self.calls.append((loop.global_step, w.grad is not None and bool(w.grad.abs().sum() > 0),
                           self.before is None or torch.equal(w, self.before)))

    def on_step_end(self, loop) -> None:
        self.before = loop.model[0].weight.detach().clone()


def test_after_backward_sees_the_gradients_before_the_step():
    x, y = _data()
    model = _model()
    seen = _Seen()
    fit(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, batch_size=8, callbacks=[seen])
    assert seen.calls == [(0, True, True), (1, True, True), (2, True, True)]


def test_a_two_pass_integrator_calls_it_twice_a_step():
    x, y = _data()

    class Count(Callback):
        calls = 0

        def on_after_backward(self, loop) -> None:
            Count.calls += 1

    for single_pass, per_step in ((True, 1), (False, 2)):
        model = rankwise.to_low_rank(_model(), rank=4)
        Count.calls = 0
        fit(model, rankwise.DLRT(model, 0.05, tau=0.1, single_pass=single_pass), x, y, batch_size=8,
            callbacks=[Count()])
        assert Count.calls == 3 * per_step


def test_lm_counts_the_same_memory_as_inside_the_step():
    """The hook's count equals the count made in a closure wrapped around the optimizer's own
    (where the factor gradients exist), at every step."""
    from rankwise.experiments.lm.lm_compare import _Curve

    x, y = _data()
    model = rankwise.to_low_rank(_model(), rank=4)
    opt = rankwise.SDLRT(model, 0.05, tau=0.1)
    inside: list = []
    step = opt.step

    def counted_step(closure):
        def counted():
            loss = closure()
            inside.append(rankwise.training_memory(model, opt))
            return loss
        return step(counted)

    opt.step = counted_step

    class Hooked(_Curve):
        def __init__(self) -> None:
            super().__init__(x[:1], y[:1], every=100)
            self.counts: list = []

        def count(self, model, opt) -> None:
            self.counts.append(rankwise.training_memory(model, opt))

        def on_step_end(self, loop) -> None:  # (only what happens after the backward)
            pass

    hooked = Hooked()
    fit(model, opt, x, y, batch_size=8, callbacks=[hooked])
    assert hooked.counts == inside and len(inside) == 3
    assert all(c.grads > 0 for c in inside)
