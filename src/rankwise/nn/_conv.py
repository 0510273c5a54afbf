"""LowRankConv2d: a conv with r filters (from V) followed by a 1×1 conv (from U S)."""

from __future__ import annotations

import torch
import torch.fx
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from ._autograd import LowRankConv2dFn
from ._base import AbstractLowRankLayer, from_dense_weight, layer_of


def low_rank_conv2d(x: Tensor, U: Tensor, S: Tensor, V: Tensor, bias: Tensor | None, kernel_size: tuple,
                    stride: tuple, padding: tuple, dilation: tuple) -> Tensor:
    """:class:`LowRankConv2d`'s forward as one call, its gradient mode read when it runs (what
    ``torch.fx.symbolic_trace`` records, as :func:`._linear.low_rank_linear`)."""
    layer = layer_of(U)
    return LowRankConv2dFn.apply(x, U, S, V, bias, layer is not None and layer.grad_mode == "factors",
                                 kernel_size, stride, padding, dilation)


torch.fx.wrap("low_rank_conv2d")


def _explicit_padding(padding, kernel_size, dilation) -> tuple[int, int]:
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        if any(d * (k - 1) % 2 for k, d in zip(kernel_size, dilation, strict=True)):
            raise ValueError("padding='same' needs an odd effective kernel size for LowRankConv2d")
        return tuple(d * (k - 1) // 2 for k, d in zip(kernel_size, dilation, strict=True))
    if isinstance(padding, str):
        raise ValueError(f"`padding` must be an int, a pair, 'valid' or 'same'; got {padding!r}")
    return _pair(padding)


class LowRankConv2d(AbstractLowRankLayer):
    """Drop-in replacement for ``nn.Conv2d`` (groups=1, zero padding) with a rank-r weight.

    The weight matrix (out_channels, in_channels·kh·kw) is ``U S Vᵀ``. The forward never
    unfolds the input: it runs a conv with the r filters ``Vᵀ`` reshaped to
    (r, in_channels, kh, kw), then a 1×1 conv with ``U S`` (out_channels, r, 1, 1).

    **Arguments:** as ``nn.Conv2d`` plus `rank` (initial r) and `max_rank`.
    Input (N, C_in, H, W) → output (N, C_out, H', W').
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, rank: int, *,
                 stride=1, padding=0, dilation=1, bias: bool = True,
                 max_rank: int | None = None, device=None, dtype=None) -> None:
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = _pair(kernel_size)
        self.stride, self.dilation = _pair(stride), _pair(dilation)
        if padding == "same" and self.stride != (1, 1):
            raise ValueError(f"padding='same' needs stride 1 (as nn.Conv2d); got stride={stride}")
        self.padding = _explicit_padding(padding, self.kernel_size, self.dilation)
        kh, kw = self.kernel_size
        super().__init__(out_channels, in_channels * kh * kw, rank, max_rank=max_rank, bias=bias,
                         device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        if torch.fx._symbolic_trace.is_fx_symbolic_tracing():
            self._check_traceable()
            return low_rank_conv2d(x, self.U, self.S, self.V, self.bias, self.kernel_size, self.stride,
                                   self.padding, self.dilation)
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"expected input (N, {self.in_channels}, H, W); got {tuple(x.shape)}")
        return LowRankConv2dFn.apply(x, *self.factors(), self.bias, self._factor_mode(),
                                     self.kernel_size, self.stride, self.padding, self.dilation)

    _weight_is = "U S Vᵀ of its factors, reshaped to the kernel"

    def dense_weight(self) -> Tensor:
        """(out_channels, in_channels, kh, kw), as ``nn.Conv2d.weight``."""
        return self.weight_matrix().reshape(self.out_channels, self.in_channels, *self.kernel_size)

    @staticmethod
    def unsupported(conv: nn.Conv2d) -> str | None:
        """Why `conv` has no LowRankConv2d equivalent (groups, padding modes, 'same' padding
        with an even kernel), or ``None`` if it has one."""
        if conv.groups != 1 or conv.padding_mode != "zeros":
            return ("LowRankConv2d supports groups=1 and padding_mode='zeros'; got "
                    f"groups={conv.groups}, padding_mode={conv.padding_mode!r}")
        try:
            _explicit_padding(conv.padding, _pair(conv.kernel_size), _pair(conv.dilation))
        except ValueError as e:
            return str(e)
        return None

    @classmethod
    @torch.no_grad()
    def from_dense(cls, conv: nn.Conv2d, *, rank: int | None = None, tau: float | None = None,
                   max_rank: int | None = None) -> LowRankConv2d:
        """Truncated SVD of ``conv.weight`` viewed as (out, in·kh·kw); see
        :meth:`LowRankLinear.from_dense`. Needs ``groups=1`` and ``padding_mode='zeros'``."""
        reason = cls.unsupported(conv)
        if reason is not None:
            raise ValueError(reason)
        W = conv.weight
        return from_dense_weight(
            lambda r, hi: cls(conv.in_channels, conv.out_channels, conv.kernel_size, r,
                              stride=conv.stride, padding=conv.padding, dilation=conv.dilation,
                              bias=conv.bias is not None, max_rank=hi, device=W.device, dtype=W.dtype),
            W, conv.bias, rank=rank, tau=tau, max_rank=max_rank)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
                + super().extra_repr())
