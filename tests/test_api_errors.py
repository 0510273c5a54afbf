"""Issue 41's newcomer round, the Python API part: each mistake ends in one clear error that
names the problem."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rankwise
from rankwise import DLRT, SDLRT


def _mlp():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("cls", [DLRT, SDLRT])
def test_ramp_and_allocation_without_a_target_are_refused(cls):
    model = rankwise.to_low_rank(_mlp(), rank=2)
    with pytest.raises(ValueError, match="ramp_steps apply to a compression target"):
        cls(model, 0.1, tau=0.1, ramp_steps=100)
    with pytest.raises(ValueError, match="allocation apply"):
        cls(model, 0.1, tau=0.1, allocation="uniform")
    cls(model, 0.1, target=0.5, ramp_steps=100, allocation="uniform")  # with a target: fine
    assert cls(model, 0.1, target=0.5).truncation.ramp_steps == 200  # the documented default


def test_negative_momentum_is_explained_as_negative():
    model = rankwise.to_low_rank(_mlp(), rank=2)
    with pytest.raises(ValueError, match="negative μ"):
        DLRT(model, 0.1, tau=0.1, momentum=-0.5)
    with pytest.raises(ValueError, match="μ >= 1"):
        DLRT(model, 0.1, tau=0.1, momentum=1.0)


def test_to_low_rank_refuses_list_entries_that_name_no_module():
    with pytest.raises(ValueError, match=r"`exclude` names no module of the model: \['no-such-module'\]"):
        rankwise.to_low_rank(_mlp(), rank=2, exclude=["no-such-module"])
    with pytest.raises(ValueError, match="`include` names no module"):
        rankwise.to_low_rank(_mlp(), rank=2, include=["0", "fc9"])
    low = rankwise.to_low_rank(_mlp(), rank=2, exclude=["2"])  # a real name: fine
    assert isinstance(low[0], rankwise.LowRankLinear) and type(low[2]) is nn.Linear


def test_adapter_config_checks_alpha_and_module_names():
    from rankwise.peft import AdapterConfig

    for alpha in (float("inf"), 0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            AdapterConfig(["query"], alpha=alpha)
    with pytest.raises(TypeError, match=r"entries must be non-empty module names .*\[3\]"):
        AdapterConfig(["q", 3])
    with pytest.raises(ValueError, match="at least one module"):
        AdapterConfig([])


def test_sequence_classifier_checks_its_sizes_controller_and_batch():
    from rankwise.ode import FixedController, SequenceClassifier

    with pytest.raises(ValueError, match="`classes` must be an int >= 1"):
        SequenceClassifier(5, 0, controller=FixedController(2, 3), m=8, rank=3)
    with pytest.raises(TypeError, match="controller"):
        SequenceClassifier(5, 2, controller=None, m=8, rank=3)
    model = SequenceClassifier(5, 2, controller=FixedController(2, 3), m=8, rank=3, p=4, hidden=8)
    with pytest.raises(ValueError, match="empty batch"):
        model(torch.zeros(0, 5))


def test_fit_refuses_numpy_arrays_naming_the_argument():
    import numpy as np

    model = _mlp()
    with pytest.raises(TypeError, match=r"`x` must be a torch.Tensor; got numpy.ndarray"):
        rankwise.fit(model, torch.optim.SGD(model.parameters(), 0.1), np.zeros((4, 8), np.float32),
                     torch.zeros(4, dtype=torch.long))
