"""rankwise.data (the bundled digits) and rankwise.models (reference models, registry)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import rankwise
from rankwise.data import load_digits
from rankwise.models import MODELS, get_model, lenet, mlp, register_model

N_DIGITS = 1797


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def split():
    return load_digits()


# --------------------------------------------------------------------------- digits
def test_digits_sizes_shapes_and_range(split):
    x_tr, y_tr = split.train.tensors
    x_te, y_te = split.test.tensors
    assert (len(split.train), len(split.test)) == (1437, 360)
    assert x_tr.shape == (1437, 1, 8, 8) and x_te.shape == (360, 1, 8, 8)
    assert x_tr.dtype == x_te.dtype == torch.float32
    assert y_tr.dtype == y_te.dtype == torch.int64
    both = torch.cat([x_tr, x_te])
    assert float(both.min()) == 0.0 and float(both.max()) == 1.0
    assert x_tr.flatten(1).shape == (1437, 64)
    image, label = split.train[0]
    assert image.shape == (1, 8, 8) and label.shape == ()


def test_digits_split_is_stratified_and_a_partition(split):
    from sklearn.datasets import load_digits as sk_load

    full = sk_load()
    y_tr, y_te = split.train.tensors[1], split.test.tensors[1]
    counts = np.bincount(full.target, minlength=10)
    assert np.array_equal(y_tr.bincount(minlength=10).numpy() + y_te.bincount(minlength=10).numpy(),
                          counts)
    # every class is held out in proportion (0.2 of each class, up to rounding)
    assert np.all(np.abs(y_te.bincount(minlength=10).numpy() - 0.2 * counts) <= 1)
    # the two parts together are exactly the dataset (compare as multisets of rows)
    rows = torch.cat([split.train.tensors[0], split.test.tensors[0]]).flatten(1).numpy() * 16
    ref = full.data.astype(np.float32)
    assert np.array_equal(np.unique(rows, axis=0, return_counts=True)[1],
                          np.unique(ref, axis=0, return_counts=True)[1])


def test_digits_split_is_deterministic_per_seed(split):
    again = load_digits(seed=0)
    for a, b in zip(split.train.tensors + split.test.tensors,
                    again.train.tensors + again.test.tensors, strict=True):
        assert torch.equal(a, b)
    other = load_digits(seed=1)
    assert not torch.equal(split.test.tensors[0], other.test.tensors[0])
    half = load_digits(test_fraction=0.5, seed=0)
    assert len(half.train) + len(half.test) == N_DIGITS and abs(len(half.test) - N_DIGITS / 2) <= 1


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_digits_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match=r"`test_fraction` must be in \(0, 1\)"):
        load_digits(test_fraction=fraction)


# --------------------------------------------------------------------------- models
def test_lenet_architecture_and_shapes():
    torch.manual_seed(0)
    model = lenet()
    assert model(torch.rand(5, 1, 8, 8)).shape == (5, 10)
    assert lenet(num_classes=3)(torch.rand(2, 1, 8, 8)).shape == (2, 3)
    mods = dict(model.named_modules())
    assert (mods["conv1"].in_channels, mods["conv1"].out_channels, mods["conv1"].kernel_size,
            mods["conv1"].padding) == (1, 20, (5, 5), (2, 2))
    assert (mods["conv2"].in_channels, mods["conv2"].out_channels) == (20, 50)
    assert (mods["fc1"].in_features, mods["fc1"].out_features) == (200, 500)
    assert (mods["fc2"].in_features, mods["fc2"].out_features) == (500, 10)
    # conv 20·25+20, conv 50·500+50, fc 500·200+500, fc 10·500+10
    assert sum(p.numel() for p in model.parameters()) == 131_080


def test_mlp_flattens_and_has_depth_linear_layers():
    torch.manual_seed(0)
    model = mlp()
    x = torch.rand(4, 1, 8, 8)
    assert model(x).shape == (4, 10)
    assert torch.equal(model(x), model(x.flatten(1)))
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears == ["fc1", "fc2", "fc3"]
    assert mlp(in_features=6, hidden=7, depth=1, num_classes=2)(torch.rand(3, 6)).shape == (3, 2)
    assert len([m for m in mlp(depth=5).modules() if isinstance(m, nn.Linear)]) == 5


@pytest.mark.parametrize("kwargs", [{"depth": 0}, {"hidden": -1}, {"num_classes": 2.5}])
def test_mlp_rejects_bad_sizes(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"`{name}` must be a positive int"):
        mlp(**kwargs)


def test_models_convert_to_low_rank_at_full_rank():
    torch.manual_seed(0)
    model = lenet()
    x = torch.rand(3, 1, 8, 8)
    with torch.no_grad():
        before = model(x)
        rankwise.to_low_rank(model, rank=10_000)
        after = model(x)
    low = {n: m.rank for n, m in model.named_modules() if isinstance(m, rankwise.AbstractLowRankLayer)}
    assert low == {"conv1": 20, "conv2": 50, "fc1": 200, "fc2": 10}
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


def test_registry_names_and_unknown_name_error():
    assert {"lenet", "mlp"} <= set(MODELS)
    assert isinstance(get_model("mlp", hidden=8), nn.Module)
    with pytest.raises(ValueError, match=r"`model` must be one of \[.*'lenet'.*'mlp'.*\]; got 'resnet'"):
        get_model("resnet")


def test_register_model_rejects_duplicates_and_bad_names():
    with pytest.raises(ValueError, match="already registered"):
        register_model("lenet", lenet)
    with pytest.raises(ValueError, match="lowercase identifier"):
        register_model("Bad Name", lenet)
    with pytest.raises(TypeError, match="callable"):
        register_model("not_callable", 3)
    assert "not_callable" not in MODELS
