"""Counting a model's trainable parameters as HF PEFT does, rankwise adapters included."""

from __future__ import annotations

from torch import nn

from ..nn._base import AbstractLowRankLayer


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of `model`, in HF PEFT's convention
    (``PeftModel.get_nb_trainable_parameters``): every parameter is counted once in the total,
    and in the trainable count if it is trained.

    What is trained: every parameter with ``requires_grad`` (the classifier, the
    `modules_to_save`, LoRA's A and B in a PEFT model), and U, S and V of every low-rank layer
    (every rankwise adapter) whatever their ``requires_grad``: the DLRT/SDLRT integrator
    updates U and V itself, from the gradients of K = U S and L = V Sᵀ it collects during the
    backward pass, so between steps U and V do not require grad and never get a ``.grad``
    (docs/peft.md). SDLRT's compensation buffer (``U_buf``, ``V_buf``: the directions it
    discarded last, b = 0 … r columns, registered as buffers, not parameters) is counted as
    trained too, in both numbers, at its current size: it is state of the same size as the
    factors that training needs. A parameter shared by several modules counts once.

    Works on any ``nn.Module``: for a PEFT model without rankwise adapters it gives what
    ``get_nb_trainable_parameters`` gives (quantised 4-bit weights aside).

    **Returns:** (trainable, total), ints.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be an nn.Module; got {type(model).__name__}")
    factors: set[int] = set()
    buffers = 0
    for m in model.modules():
        if isinstance(m, AbstractLowRankLayer):
            factors.update(id(p) for p in (m.U, m.S, m.V))
            buffers += m.U_buf.numel() + m.V_buf.numel()
    trainable = total = 0
    for p in model.parameters():  # (each parameter once, shared ones too)
        total += p.numel()
        if p.requires_grad or id(p) in factors:
            trainable += p.numel()
    return trainable + buffers, total + buffers


def trainable_line(model: nn.Module) -> str:
    """PEFT's line: ``trainable params: X || all params: Y || trainable%: Z``."""
    trainable, total = trainable_parameters(model)
    share = 100 * trainable / total if total else 0.0
    return f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {share:.4f}"


def print_trainable_parameters(model: nn.Module) -> None:
    """Print :func:`trainable_parameters` as ``PeftModel.print_trainable_parameters`` does:
    ``trainable params: 141,965 || all params: 22,855,301 || trainable%: 0.6211``."""
    print(trainable_line(model))  # the one print of the library: PEFT's function, PEFT's output
