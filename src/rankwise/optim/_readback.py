"""The one record an augmentation reads from the device: packed in one tensor, read once, unpacked
by the same layout, so that a new field is one line here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class GroupRead:
    """One group's part of the read-back, per layer: the augmented core is finite, the fixed-width
    augmentation failed, the core's size k and the new directions it kept; the ranks chosen on the
    device (a tolerance; None otherwise); under a budget the core's singular values (first k of
    each row) and, data-aware, their sensitivity scores."""

    finite: list[bool]
    failed: list[bool]
    k: list[int]
    new: list[int]
    ranks: list[int] | None = None
    spectra: list[Tensor] | None = None
    scores: list[list[float]] | None = None


@dataclass
class ReadBack:
    """The step's inputs were finite (``ok``), how many core steps since the last augmentation
    skipped a non-finite loss (``skipped``), and each group's :class:`GroupRead`."""

    ok: bool
    skipped: int
    groups: list[GroupRead]
    live: list[tuple[int, int]]  # the fixed-capacity layers' saved [rank, buffer] (``layer.live``)

    @staticmethod
    def _layout(g, spectra: bool, scores: bool) -> list[tuple[str, Tensor | None]]:
        """(field, device tensor) in packing order for a group `g` (a ``_batched._Group``)."""
        p = g.plan
        out = [("finite", p.finite), ("failed", p.failed), ("k", p.k), ("new", p.new), ("ranks", g.ranks)]
        if spectra:
            out.append(("spectra", p.s))
        if scores:
            out.append(("scores", g.scores))
        return [(name, t) for name, t in out if t is not None]

    @classmethod
    def read(cls, ok: Tensor, skipped: Tensor, groups: list, *, spectra: bool, scores: bool,
             device: torch.device, live: list[Tensor] = ()) -> ReadBack:
        """Pack every field as float64 on `device`, read them to the host in one transfer, unpack.
        `live`: the ``live`` buffers ([rank, buffer], int64) of fixed-capacity layers."""
        layouts = [cls._layout(g, spectra, scores) for g in groups]
        parts = [ok.double().reshape(1).to(device), skipped.double().reshape(1).to(device)]
        parts += [t.double().reshape(2).to(device) for t in live]
        parts += [t.double().flatten().to(device) for lay in layouts for _, t in lay]
        host = torch.cat(parts).cpu().tolist()  # (the one device→host transfer of the step)
        lives = [(int(host[2 + 2 * i]), int(host[3 + 2 * i])) for i in range(len(live))]
        pos, out = 2 + 2 * len(live), []
        for lay in layouts:
            fields: dict = {}
            for name, t in lay:
                values = host[pos:pos + t.numel()]
                pos += t.numel()
                if name in ("spectra", "scores"):  # (N, width): row i's first k_i entries
                    width = t.shape[-1]
                    rows = [values[i * width:i * width + fields["k"][i]] for i in range(t.shape[0])]
                    fields[name] = ([torch.tensor(r, dtype=torch.float64) for r in rows] if name == "spectra"
                                    else rows)
                elif name in ("finite", "failed"):
                    fields[name] = [v > 0 for v in values]
                else:
                    fields[name] = [int(v) for v in values]
            out.append(GroupRead(**fields))
        return cls(host[0] > 0, int(host[1]), out, lives)
