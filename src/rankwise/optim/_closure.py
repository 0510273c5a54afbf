"""What an optimizer step checks around the user's closure and gradients (torch's habits)."""

from __future__ import annotations

import torch


def check_loss(name: str, loss) -> None:
    """A closure must return the loss, as the closures of torch optimizers do."""
    if loss is None:
        raise TypeError(
            f"the closure passed to {name}.step returned None; it must return "
            "the loss tensor, as closures of torch optimizers do (zero the gradients, run the "
            "forward pass, call loss.backward(), then `return loss`); no weights were changed")


def no_grad_message(name: str, closure, when: str = "") -> str:
    """The error of a step that found no gradient at all (no ``backward()``)."""
    if closure is None:
        return (f"{name}.step() found no gradient on any parameter: call loss.backward() "
                f"before {name}.step(), or pass a closure that zeroes the gradients, runs the "
                "forward pass, calls loss.backward() and returns the loss; no weights were "
                "changed")
    return (f"the closure passed to {name}.step did not call backward(){when}: after it "
            "ran, no parameter has a gradient; call loss.backward() inside the closure "
            "before returning the loss; no weights were changed")


def evaluate(opt, closure):
    """Run the closure (factor gradients cleared first) with gradients on; None without one."""
    if closure is None:
        return None
    for layer in opt.layers.values():
        layer.reset_factor_grads()
    with torch.enable_grad():
        loss = closure()
    check_loss(type(opt).__name__, loss)
    return loss


def has_grads(opt) -> bool:
    """Is there any gradient: a ``.grad`` on a parameter (a layer's G_K / G_L included)?"""
    return any(p.grad is not None for g in opt.param_groups for p in g["params"])


def amp_unscale(opt) -> bool:
    """torch.amp.GradScaler: with ``_step_supports_amp_scaling``, ``scaler.step(opt)`` checks
    ``.grad`` for inf, sets ``opt.grad_scale`` (None after ``scaler.unscale_(opt)``) and
    ``opt.found_inf``, and calls ``opt.step()``. The factor gradients G_K, G_L are U's and V's
    ``.grad``, so ``scaler.unscale_(opt)`` covers them. Unscale every gradient if the scaler has
    not; False if the step must be skipped."""
    if not hasattr(opt, "found_inf"):
        return True
    if opt.dp is not None:
        raise ValueError("torch.amp.GradScaler with a data-parallel DLRT/SDLRT (`process_group`) is "
                         "not supported: each rank would decide on its own whether to skip the step")
    found_inf, scale = opt.found_inf, getattr(opt, "grad_scale", None)  # (GradScaler deletes both after)
    if float(found_inf) > 0:
        return False
    if scale is not None:  # not unscaled yet (no scaler.unscale_(opt) before scaler.step(opt))
        inv = 1.0 / scale.double()
        for t in (p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None):
            t.mul_(inv.to(t))
    return True


def warn_without_group(opt) -> None:
    """Several processes but no `process_group` (a DDP wrapper cannot average the factor
    gradients, and every rank would integrate its own shard's): warn once."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        import warnings

        warnings.warn(f"torch.distributed runs {dist.get_world_size()} processes but this "
                      f"{type(opt).__name__} was built without `process_group`: each process integrates "
                      "its own gradients and the replicas drift apart; build it on the "
                      "DistributedDataParallel wrapper of a model converted with `capacity` "
                      "(DLRT(DDP(model), …)), or with process_group=torch.distributed.group.WORLD and no "
                      "DDP wrapper",
                      UserWarning, stacklevel=4)
