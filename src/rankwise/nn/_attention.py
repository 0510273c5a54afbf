"""LowRankMultiheadAttention: ``nn.MultiheadAttention`` with four low-rank projections.

torch's attention keeps the query, key and value projections in one packed parameter
``in_proj_weight`` (3E, E) (or three when kdim / vdim differ) that ``F.multi_head_attention_forward``
multiplies itself. Here each projection is an ordinary :class:`LowRankLinear` sub-module
(``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``), so DLRT / SDLRT find and integrate it like
any other low-rank layer; the attention between the projections is torch's, step for step
(masks, ``is_causal``, dropout, ``need_weights``, ``average_attn_weights``, batch_first, unbatched
input), so a converted model draws the same dropout masks as the dense one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..linalg import truncated_svd, work_dtype
from ._base import GuardedViews, from_dense_weight
from ._linear import LowRankLinear
from ._view import as_view

PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj")


def unsupported(mha: nn.MultiheadAttention) -> str | None:
    """Why `mha` has no LowRankMultiheadAttention equivalent, or ``None`` if it has one."""
    if mha.bias_k is not None or mha.bias_v is not None:
        return "LowRankMultiheadAttention does not support add_bias_kv=True"
    if mha.add_zero_attn:
        return "LowRankMultiheadAttention does not support add_zero_attn=True"
    return None


def dense_projections(mha: nn.MultiheadAttention) -> dict[str, tuple[Tensor, Tensor | None]]:
    """``{projection: (weight (out, in), bias (out,) or None)}`` of a torch ``nn.MultiheadAttention``:
    q (E, E), k (E, kdim), v (E, vdim) from ``in_proj_weight`` (or the separate weights) and
    ``in_proj_bias``; out (E, E) from ``out_proj``."""
    if mha._qkv_same_embed_dim:
        weights = mha.in_proj_weight.chunk(3)
    else:
        weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
    biases = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.chunk(3)
    out = {p: (w, b) for p, w, b in zip(PROJECTIONS[:3], weights, biases, strict=True)}
    out["out_proj"] = (mha.out_proj.weight, mha.out_proj.bias)
    return out


def _per_projection(rank) -> dict[str, int | None]:
    """An int (or None) for all four projections, or a mapping naming each of them."""
    if not isinstance(rank, Mapping):
        return dict.fromkeys(PROJECTIONS, rank)
    if set(rank) != set(PROJECTIONS):
        raise ValueError(f"a `rank` mapping must name the projections {PROJECTIONS}; got {sorted(rank)}")
    return dict(rank)


class LowRankMultiheadAttention(GuardedViews, nn.MultiheadAttention):
    """Drop-in replacement for ``nn.MultiheadAttention`` with low-rank projections.

    **Arguments:** as ``nn.MultiheadAttention`` (`embed_dim` E, `num_heads`, `dropout`, `bias`,
    `kdim`, `vdim`, `batch_first`) plus `rank` -- an int for all four projections (each clamped
    to its min(out, in)) or a mapping ``{"q_proj": r, "k_proj": r, "v_proj": r, "out_proj": r}``
    -- and `max_rank` (cap for later growth). ``add_bias_kv`` and ``add_zero_attn`` are not
    supported. A fresh module starts from the truncated SVD of torch's initialisation
    (Xavier-uniform in-projection, zero biases).

    Sub-modules: ``q_proj`` (E ← E), ``k_proj`` (E ← kdim), ``v_proj`` (E ← vdim), ``out_proj``
    (E ← E), all :class:`LowRankLinear`. ``forward`` takes and returns what
    ``nn.MultiheadAttention.forward`` does. The attributes torch's transformer code reads are
    there: ``in_proj_weight`` (3E, E) and ``in_proj_bias`` (3E,) (or ``q_proj_weight`` ...
    when kdim / vdim differ) are read-only dense views computed on access, so the eval fast path
    of ``nn.TransformerEncoderLayer`` computes the same function with the dense weights.
    """

    # torch's dense views of the projections (read-only, computed): not parameter names
    VIEWS = frozenset({"in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight"})

    def __init__(self, embed_dim: int, num_heads: int, rank: int | Mapping[str, int], *,
                 dropout: float = 0.0, bias: bool = True, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, max_rank: int | None = None,
                 device=None, dtype=None) -> None:
        nn.Module.__init__(self)  # not nn.MultiheadAttention's: it would register dense parameters
        self._configure(embed_dim, num_heads, dropout, kdim, vdim, batch_first)
        ranks = _per_projection(rank)
        for p, (n_in, n_out) in self.projection_shapes().items():
            r = min(ranks[p], n_in, n_out)
            setattr(self, p, LowRankLinear(n_in, n_out, r, max_rank=max(r, max_rank) if max_rank else None,
                                           bias=bias, device=device, dtype=dtype))
        self._reset_parameters()

    def _configure(self, embed_dim: int, num_heads: int, dropout: float, kdim: int | None,
                   vdim: int | None, batch_first: bool) -> None:
        """The plain attributes nn.MultiheadAttention has (and torch's transformer code reads)."""
        self._guard_parameters()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} "
                             f"and num_heads={num_heads} instead")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.dropout, self.batch_first = dropout, batch_first
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """``{projection: (in_features, out_features)}``."""
        E = self.embed_dim
        return {"q_proj": (E, E), "k_proj": (self.kdim, E), "v_proj": (self.vdim, E), "out_proj": (E, E)}

    @torch.no_grad()
    def _reset_parameters(self) -> None:
        """nn.MultiheadAttention's initialisation, truncated: Xavier-uniform q, k, v weights (over
        the packed (3E, E) matrix when kdim = vdim = E), zero in- and out-projection biases."""
        if self.q_proj.U.is_meta:
            return
        E = self.embed_dim
        for p in PROJECTIONS[:3]:
            layer: LowRankLinear = getattr(self, p)
            fan_out = 3 * E if self._qkv_same_embed_dim else E
            bound = math.sqrt(6.0 / (layer.in_features + fan_out))
            W = torch.empty(E, layer.in_features, dtype=work_dtype(layer.U.dtype)).uniform_(-bound, bound)
            U, s, V = truncated_svd(W, rank=layer.rank)
            layer.set_factors(U, torch.diag(s), V)
        for layer in self.projections().values():
            if layer.bias is not None:
                layer.bias.zero_()

    @classmethod
    @torch.no_grad()
    def from_dense(cls, mha: nn.MultiheadAttention, *, rank: int | Mapping[str, int] | None = None,
                   tau: float | None = None, max_rank: int | None = None) -> LowRankMultiheadAttention:
        """Each projection's truncated SVD (see :meth:`LowRankLinear.from_dense`): `rank` an int or a
        mapping per projection, `tau` the tolerance; biases, dropout, batch_first and the train
        mode are copied. Raises ``ValueError`` for ``add_bias_kv`` / ``add_zero_attn``."""
        reason = unsupported(mha)
        if reason is not None:
            raise ValueError(reason)
        ranks = _per_projection(rank)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._configure(mha.embed_dim, mha.num_heads, mha.dropout, mha.kdim, mha.vdim, mha.batch_first)
        for p, (W, b) in dense_projections(mha).items():
            setattr(new, p, from_dense_weight(
                lambda r, hi, W=W, b=b: LowRankLinear(W.shape[1], W.shape[0], r, bias=b is not None,
                                                      max_rank=hi, device=W.device, dtype=W.dtype),
                W, b, rank=ranks[p], tau=tau, max_rank=max_rank))
        return new.train(mha.training)

    def projections(self) -> dict[str, LowRankLinear]:
        """``{"q_proj": ..., "k_proj": ..., "v_proj": ..., "out_proj": ...}``."""
        return {p: getattr(self, p) for p in PROJECTIONS}

    @property
    def ranks(self) -> dict[str, int]:
        """Each projection's current rank."""
        return {p: m.rank for p, m in self.projections().items()}

    # ----------------------------------------------------------------- torch's dense views
    @property
    def in_proj_weight(self) -> Tensor | None:
        """(3E, E): the q, k, v weights stacked (None unless kdim = vdim = E); read-only, computed."""
        if not self._qkv_same_embed_dim:
            return None
        return as_view(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
                       "LowRankMultiheadAttention.in_proj_weight (q, k, v projections stacked)",
                       "change the projections' factors (`q_proj.set_factors`, …), or make the attention "
                       "dense (`rankwise.export`)")

    @property
    def in_proj_bias(self) -> Tensor | None:
        """(3E,): the q, k, v biases stacked (None without bias); read-only, computed."""
        if self.q_proj.bias is None:
            return None
        return as_view(torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]),
                       "LowRankMultiheadAttention.in_proj_bias (q, k, v biases stacked)",
                       "edit `q_proj.bias`, `k_proj.bias` and `v_proj.bias`")

    @property
    def q_proj_weight(self) -> Tensor | None:
        """(E, E) when kdim / vdim differ from E (else None, as torch)."""
        return None if self._qkv_same_embed_dim else self.q_proj.weight

    @property
    def k_proj_weight(self) -> Tensor | None:
        """(E, kdim) when kdim / vdim differ from E (else None, as torch)."""
        return None if self._qkv_same_embed_dim else self.k_proj.weight

    @property
    def v_proj_weight(self) -> Tensor | None:
        """(E, vdim) when kdim / vdim differ from E (else None, as torch)."""
        return None if self._qkv_same_embed_dim else self.v_proj.weight

    # ----------------------------------------------------------------- forward
    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """As ``nn.MultiheadAttention.forward`` (its slow path): query (L, N, E) or (N, L, E) with
        batch_first or (L, E) unbatched, key (S, N, kdim), value (S, N, vdim) alike →
        (output like query, weights (N, L, S) averaged / (N, H, L, S) or None)."""
        if query.is_nested or key.is_nested or value.is_nested:
            raise ValueError("LowRankMultiheadAttention does not take nested tensors (torch's attention "
                             "takes them only on its fused fast path, which needs dense weights)")
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask, mask_name="key_padding_mask", other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask", target_type=query.dtype)
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                      other_name="", target_type=query.dtype, check_other=False)
        transpose = self.batch_first and query.dim() == 3
        if transpose:
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        out, weights = self._attend(query, key, value, key_padding_mask, need_weights, attn_mask,
                                    average_attn_weights, is_causal)
        return (out.transpose(1, 0) if transpose else out), weights

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None,
                need_weights: bool, attn_mask: Tensor | None, average_attn_weights: bool,
                is_causal: bool) -> tuple[Tensor, Tensor | None]:
        """``F.multi_head_attention_forward`` with the projections replaced by the low-rank layers;
        sequence-first inputs (L, N, E) / (S, N, kdim) or unbatched."""
        H, hd = self.num_heads, self.head_dim
        batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, H)
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        L, N, E = query.shape
        S = key.shape[0]
        if self.embed_dim != E:
            raise ValueError(f"was expecting embedding dimension of {self.embed_dim}, but got {E}")
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(f"key's sequence and batch dims {tuple(key.shape[:2])} do not match "
                             f"value's {tuple(value.shape[:2])}")
        attn_mask, is_causal = self._mask(attn_mask, key_padding_mask, need_weights, is_causal, L, S, N)
        q = self.q_proj(query).reshape(L, N * H, hd).transpose(0, 1)
        k = self.k_proj(key).reshape(S, N * H, hd).transpose(0, 1)
        v = self.v_proj(value).reshape(S, N * H, hd).transpose(0, 1)
        p = self.dropout if self.training else 0.0
        if need_weights:
            scores = q * math.sqrt(1.0 / float(hd))
            scores = (torch.baddbmm(attn_mask, scores, k.transpose(-2, -1)) if attn_mask is not None
                      else torch.bmm(scores, k.transpose(-2, -1)))
            weights = F.softmax(scores, dim=-1)
            if p > 0.0:
                weights = F.dropout(weights, p=p)
            out = torch.bmm(weights, v).transpose(0, 1).reshape(L * N, E)
            weights = weights.view(N, H, L, S)
            weights = weights.mean(dim=1) if average_attn_weights else weights
        else:
            if attn_mask is not None:
                attn_mask = (attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 and attn_mask.dim() == 3
                             else attn_mask.view(N, H, -1, S))
            out = F.scaled_dot_product_attention(q.view(N, H, L, hd), k.view(N, H, S, hd),
                                                 v.view(N, H, S, hd), attn_mask, p, is_causal)
            out, weights = out.permute(2, 0, 1, 3).reshape(L * N, E), None
        out = self.out_proj(out).view(L, N, E)
        if not batched:
            out = out.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights

    def _mask(self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, need_weights: bool,
              is_causal: bool, L: int, S: int, N: int) -> tuple[Tensor | None, bool]:
        """torch's mask handling: the additive mask (1 or N·H, L, S) or None, and is_causal."""
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                               "module method `generate_square_subsequent_mask` to create this mask.")
        if is_causal and key_padding_mask is None and not need_weights:
            return None, True  # scaled_dot_product_attention's own causal mask
        if key_padding_mask is not None:
            is_causal = False
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if attn_mask.shape != (L, S):
                    raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                                       f"{(L, S)}.")
                attn_mask = attn_mask.unsqueeze(0)
            elif attn_mask.shape != (N * self.num_heads, L, S):
                raise RuntimeError(f"The shape of the attn_mask is {attn_mask.shape}, but should be "
                                   f"{(N * self.num_heads, L, S)}.")
        if key_padding_mask is not None:
            if key_padding_mask.shape != (N, S):
                raise ValueError(f"expecting key_padding_mask shape of {(N, S)}, but got "
                                 f"{tuple(key_padding_mask.shape)}")
            kpm = (key_padding_mask.view(N, 1, 1, S).expand(-1, self.num_heads, -1, -1)
                   .reshape(N * self.num_heads, 1, S))
            attn_mask = kpm if attn_mask is None else attn_mask + kpm
        return attn_mask, is_causal

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
                f"kdim={self.kdim}, vdim={self.vdim}, batch_first={self.batch_first}")
