"""Small reference models for 8×8 digits, and a registry of them by name.

The models are plain ``nn.Module`` s built from ``nn.Linear`` / ``nn.Conv2d``; make them
low-rank with :func:`rankwise.to_low_rank`.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable

from torch import nn

ModelFactory = Callable[..., nn.Module]


def lenet(num_classes: int = 10, size: int = 8) -> nn.Module:
    """LeNet-5 as in the DLRT paper (Schotthöfer et al., 2022), sized for 8×8 inputs.

    ``conv(1→20, k5, pad2) → ReLU → maxpool2 → conv(20→50, k5, pad2) → ReLU → maxpool2 →
    flatten → linear(50·(size/4)²→500) → ReLU → linear(500→num_classes)``.

    **Arguments:**
    - `num_classes`: output width; default 10.
    - `size`: input height = width, a multiple of 4; default 8 (28 for MNIST).

    **Returns:** a module mapping images float (N, 1, size, size) to logits (N, num_classes).
    Module names: ``conv1``, ``conv2``, ``fc1``, ``fc2``.
    """
    _check_positive("num_classes", num_classes)
    _check_positive("size", size)
    if size % 4:
        raise ValueError(f"`size` must be a multiple of 4; got {size}")
    return nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(1, 20, kernel_size=5, padding=2), relu1=nn.ReLU(), pool1=nn.MaxPool2d(2),
        conv2=nn.Conv2d(20, 50, kernel_size=5, padding=2), relu2=nn.ReLU(), pool2=nn.MaxPool2d(2),
        flatten=nn.Flatten(), fc1=nn.Linear(50 * (size // 4) ** 2, 500), relu3=nn.ReLU(),
        fc2=nn.Linear(500, num_classes),
    ))


def mlp(in_features: int = 64, hidden: int = 500, depth: int = 3, num_classes: int = 10) -> nn.Module:
    """A ReLU multilayer perceptron that flattens its input.

    ``flatten → [linear(·→hidden) → ReLU] × (depth − 1) → linear(hidden→num_classes)``.

    **Arguments:**
    - `in_features`: flattened input size; default 64 (8×8 digits).
    - `hidden`: width of the hidden layers; default 500.
    - `depth`: number of linear layers, ≥ 1; default 3.
    - `num_classes`: output width; default 10.

    **Returns:** a module mapping inputs (N, ...) with ``in_features`` elements per sample to
    logits (N, num_classes). Linear layers are named ``fc1`` … ``fc{depth}``.
    """
    for name, value in (("in_features", in_features), ("hidden", hidden), ("depth", depth),
                        ("num_classes", num_classes)):
        _check_positive(name, value)
    layers: dict[str, nn.Module] = {"flatten": nn.Flatten()}
    width = in_features
    for i in range(1, depth):
        layers[f"fc{i}"] = nn.Linear(width, hidden)
        layers[f"relu{i}"] = nn.ReLU()
        width = hidden
    layers[f"fc{depth}"] = nn.Linear(width, num_classes)
    return nn.Sequential(OrderedDict(layers))


def vgg(in_channels: int = 1, size: int = 8, width: int = 16, num_classes: int = 10) -> nn.Module:
    """A small VGG-style CNN: two blocks of two 3×3 convolutions (``width`` and ``2·width``
    channels) each followed by a 2×2 max-pool, then ``linear(2·width·(size/4)²→128) → ReLU →
    linear(128→num_classes)``. For 16×16 inputs (digits upsampled) or 32×32 (CIFAR).

    **Returns:** a module mapping images (N, in_channels, size, size) to logits. Module names:
    ``conv1`` … ``conv4``, ``fc1``, ``fc2``.
    """
    for name, value in (("in_channels", in_channels), ("size", size), ("width", width),
                        ("num_classes", num_classes)):
        _check_positive(name, value)
    if size % 4:
        raise ValueError(f"`size` must be a multiple of 4; got {size}")
    w = width
    return nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(in_channels, w, 3, padding=1), relu1=nn.ReLU(),
        conv2=nn.Conv2d(w, w, 3, padding=1), relu2=nn.ReLU(), pool1=nn.MaxPool2d(2),
        conv3=nn.Conv2d(w, 2 * w, 3, padding=1), relu3=nn.ReLU(),
        conv4=nn.Conv2d(2 * w, 2 * w, 3, padding=1), relu4=nn.ReLU(), pool2=nn.MaxPool2d(2),
        flatten=nn.Flatten(), fc1=nn.Linear(2 * w * (size // 4) ** 2, 128), relu5=nn.ReLU(),
        fc2=nn.Linear(128, num_classes),
    ))


MODELS: dict[str, ModelFactory] = {}


def register_model(name: str, factory: ModelFactory) -> None:
    """Add `factory` to :data:`MODELS` under `name` (a lowercase identifier such as ``"lenet"``).

    Raises ``ValueError`` for a malformed or already registered name and ``TypeError`` for a
    factory that is not callable.
    """
    if not isinstance(name, str) or re.fullmatch(r"[a-z][a-z0-9_]*", name) is None:
        raise ValueError(f"`name` must be a lowercase identifier such as 'lenet'; got {name!r}")
    if name in MODELS:
        raise ValueError(f"model {name!r} is already registered; registered: {sorted(MODELS)}")
    if not callable(factory):
        raise TypeError(f"`factory` must be callable; got {type(factory).__name__}")
    MODELS[name] = factory


register_model("lenet", lenet)
register_model("mlp", mlp)
register_model("vgg", vgg)


def get_model(name: str, **kwargs) -> nn.Module:
    """Build the registered model `name` (``"lenet"``, ``"mlp"``, ``"vgg"``) with `kwargs` passed to
    its factory. An unknown name raises a ``ValueError`` listing the valid names."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"`model` must be one of {sorted(MODELS)}; got {name!r}") from None
    return factory(**kwargs)


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int; got {value!r}")
