"""LowRankConv1D: the low-rank form of Hugging Face's ``Conv1D`` (GPT-2's c_attn, c_proj, c_fc).

``transformers.pytorch_utils.Conv1D(nf, nx)`` is a linear layer that stores its weight
transposed: weight (nx, nf) = (in, out), forward ``x @ weight + bias``. This module never
imports transformers: :func:`is_hf_conv1d` recognises the class by its name and module, and
only :func:`hf_conv1d` (used by ``export``) imports it, when a model already holds one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._base import from_dense_weight
from ._linear import LowRankLinear

_CONV1D = ("transformers.pytorch_utils", "Conv1D")


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether `module` is exactly ``transformers.pytorch_utils.Conv1D`` (not a subclass)."""
    return (type(module).__module__, type(module).__name__) == _CONV1D


def hf_conv1d(nf: int, nx: int, *, device=None, dtype=None) -> nn.Module:
    """A fresh ``transformers.pytorch_utils.Conv1D(nf, nx)`` (weight (nx, nf)) on `device` / `dtype`."""
    from transformers.pytorch_utils import Conv1D

    return Conv1D(nf, nx).to(device=device, dtype=dtype)


class LowRankConv1D(LowRankLinear):
    """Drop-in replacement for Hugging Face's ``Conv1D(nf, nx)`` with weight ``U S Vᵀ`` transposed.

    It computes ``y = x (U S Vᵀ)ᵀ + b`` for x (..., nx), as :class:`LowRankLinear` with
    in_features = nx, out_features = nf; only the dense view differs: :attr:`weight` (and
    :meth:`dense_weight`) is (nx, nf) = (in, out), the layout HF code expects of a Conv1D.
    Factors: ``U`` (nf, r), ``S`` (r, r), ``V`` (nx, r). ``nf`` and ``nx`` are Conv1D's names.
    """

    def __init__(self, nf: int, nx: int, rank: int, *, max_rank: int | None = None, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__(nx, nf, rank, max_rank=max_rank, bias=bias, device=device, dtype=dtype)

    @property
    def nf(self) -> int:
        """Output features, as ``Conv1D.nf``."""
        return self.out_features

    @property
    def nx(self) -> int:
        """Input features, as ``Conv1D.nx``."""
        return self.in_features

    _weight_is = "(U S Vᵀ)ᵀ of its factors"

    def dense_weight(self) -> Tensor:
        """(nx, nf) = (in_features, out_features), as ``Conv1D.weight``."""
        return self.weight_matrix().mT

    @classmethod
    @torch.no_grad()
    def from_dense(cls, conv1d: nn.Module, *, rank: int | None = None, tau: float | None = None,
                   max_rank: int | None = None) -> LowRankConv1D:
        """Truncated SVD of ``conv1d.weight``ᵀ (nf, nx); see :meth:`LowRankLinear.from_dense`."""
        W = conv1d.weight
        return from_dense_weight(
            lambda r, hi: cls(conv1d.nf, conv1d.nx, r, bias=conv1d.bias is not None, max_rank=hi,
                              device=W.device, dtype=W.dtype),
            W.mT, conv1d.bias, rank=rank, tau=tau, max_rank=max_rank)
