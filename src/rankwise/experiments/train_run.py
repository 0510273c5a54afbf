"""``rankwise train``'s run: dense SGD, DLRT or SDLRT (:mod:`rankwise.methods`) on the bundled digits,
with run records.

It never prints. Progress goes to an optional callback and, when ``config.out`` is set, to
``metrics.csv``, TensorBoard events and ``final.json``. The loop itself is :func:`fit`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .. import methods
from .._io import write_atomic
from ..models import get_model
from ..nn import compression, to_low_rank
from ..optim import AugmentedBUG, Budget, Tolerance
from ..train import Callback, CodedCheckpoints, Loop, accuracy, fit
from ..train_config import FORMAT_VERSION, RAMP_SHARE, TrainConfig


class EpochRecord(NamedTuple):
    """Statistics of one finished epoch.

    `train_loss` is the mean minibatch loss during the epoch; `train_acc` and `test_acc` are
    accuracies in [0, 1] of the model at the end of the epoch (evaluated in eval mode on the
    whole split); `ranks` maps each low-rank layer to its rank and `taus` to its truncation
    tolerance τ (both empty for dense; with a target, each layer's relative discarded tail);
    `compression` is ``compression(model)["ratio"]``; `epoch_time` is in seconds (training
    only, not evaluation); `budget` the parameter budget at the end of the epoch (with a
    target, else ``None``).
    """

    epoch: int
    train_loss: float
    train_acc: float
    test_acc: float
    ranks: dict[str, int]
    compression: float
    epoch_time: float
    taus: dict[str, float] = {}  # noqa: RUF012 (NamedTuple default, never mutated)
    budget: float | None = None


class Progress(NamedTuple):
    """What the progress callback receives after every optimizer step.

    `epoch` (1-based) of `epochs`, `step` (1-based) of `steps` per epoch; `loss` and `acc` are
    the running means over this epoch's minibatches, measured on each batch as it was trained
    (so `acc` is not :attr:`EpochRecord.train_acc`, the end-of-epoch accuracy on the whole
    training split); `ranks` as :attr:`EpochRecord.ranks`;
    `record` is the :class:`EpochRecord` on the last step of an epoch, else ``None``.
    """

    epoch: int
    epochs: int
    step: int
    steps: int
    loss: float
    acc: float
    ranks: dict[str, int]
    record: EpochRecord | None


ProgressCallback = Callable[[Progress], None]


def train(config: TrainConfig, *, callback: ProgressCallback | None = None,
          device: str | torch.device | None = None, save_model: bool = False) -> dict[str, Any]:
    """Train `config.model` on the digits with `config.method` and return the run summary.

    The loop is :func:`rankwise.train.fit`; this function builds the model, the optimizer and
    the callbacks that write the records and the coded checkpoints.

    With ``config.out`` set, writes into that directory: ``metrics.csv`` (a row per epoch:
    epoch, train_loss, train_acc, test_acc, compression, epoch_time, then ``rank/<layer>``
    columns, then ``tau/<layer>``), TensorBoard events (``loss/train``, ``accuracy/train``,
    ``accuracy/test``, ``compression/ratio``, ``rank/<layer>``, ``tau/<layer>``, with a target
    ``budget/params``; metrics.csv's ``budget_params``), with `save_model` the trained model's
    ``state_dict`` (``model.pt``, :func:`torch.save`, atomically; load it into
    ``rankwise.models.get_model`` converted as the run did, or read its tensors) and, last,
    ``final.json`` (atomically).
    Files of an earlier run in ``config.out`` are overwritten (the command line refuses that
    without ``--force``).
    The caller's global RNG state is left untouched.

    **Data-parallel**: called in every process of an initialised ``torch.distributed`` group
    with more than one rank (e.g. under ``torchrun``, after :func:`rankwise.dist.init_process_group`;
    ``rankwise train --nproc N`` does this), every rank trains on its shard of every batch
    (DLRT/SDLRT with ``process_group``, dense with DDP), the gradients are averaged so that a
    step equals the single-process step on the whole batch, and only rank 0 writes records
    and calls `callback` (the losses and accuracies it reports are the whole batch's).

    **Arguments:**
    - `config`: a :class:`TrainConfig`.
    - `callback`: called with a :class:`Progress` after every step; default none.
    - `device`: where the model and the data live (default: the CPU).
    - `save_model`: also write ``model.pt`` into ``config.out`` (``rankwise train`` does).

    **Returns:** a dict with ``config``, ``test_acc``, ``train_acc`` (final, in [0, 1]),
    ``compression`` (the dict of :func:`rankwise.compression`), ``ranks`` and ``taus`` (per
    layer; empty for dense), ``wall_time`` (seconds, from building the model to the final
    evaluation; loading the data and opening the record files are not counted), ``history`` (a list of
    :class:`EpochRecord` as dicts), ``restored_from`` (``None``, or the step of the coded
    checkpoint the run resumed from and the ranks it repaired), ``rankwise_version`` and
    ``format_version``. ``final.json`` holds the same dict.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"`config` must be a TrainConfig; got {type(config).__name__}")
    from ..data import load_digits

    group, rank = _data_parallel()
    if rank != 0:
        config, callback = dataclasses.replace(config, out=None), None
    with torch.random.fork_rng(devices=[]), Records(config.out) as rec:
        torch.manual_seed(config.seed)
        split = load_digits(seed=config.seed)
        t_start = time.perf_counter()  # wall time: model building, training, evaluation
        model, opt = _build(config, config.epochs * math.ceil(len(split.train) / config.batch_size), group,
                            device)
        low_rank = isinstance(opt, AugmentedBUG)
        first = next(model.parameters())  # the data follow the model (e.g. float64, its device)
        x_tr, y_tr = (t.to(first.device) for t in split.train.tensors)
        x_te, y_te = (t.to(first.device) for t in split.test.tensors)
        x_tr, x_te = x_tr.to(first.dtype), x_te.to(first.dtype)
        run = _EpochRecords(x_tr, y_tr, x_te, y_te, rec, callback)
        ck = _checkpoints(config, group)
        fit(model, opt, x_tr, y_tr, epochs=config.epochs, batch_size=config.batch_size,
            shuffle=torch.Generator().manual_seed(config.seed), process_group=group,
            callbacks=[ck, run] if ck is not None else [run])
        train_acc, test_acc = run.history[-1].train_acc, run.history[-1].test_acc  # the last epoch's
        summary = {
            "config": config.to_dict(),
            "test_acc": test_acc,
            "train_acc": train_acc,
            "compression": compression(model),
            "ranks": opt.ranks() if low_rank else {},
            "taus": opt.taus() if low_rank else {},
            "wall_time": time.perf_counter() - t_start,
            "history": [r._asdict() for r in run.history],
            "restored_from": None if ck is None else ck.restored,  # a checkpoint's step, the ranks repaired
            "rankwise_version": _version(),
            "format_version": FORMAT_VERSION,
        }
        if save_model:
            rec.model(model)
        rec.final(summary)
    return summary


# --------------------------------------------------------------------------- internals
def _version() -> str:
    from .. import __version__

    return __version__


def _data_parallel():
    """(process group, this rank) when torch.distributed runs more than one rank, else (None, 0)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD, dist.get_rank()
    return None, 0


def _build(config: TrainConfig, total_steps: int, group=None,
           device: str | torch.device | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = get_model(config.model)
    if device is not None:
        model = model.to(device)
    if config.method == "dense":
        if group is not None:  # dense: DDP does it
            model = nn.parallel.DistributedDataParallel(model, process_group=group)
            if config.checkpoint_every is not None:  # a resumed run must sum in the same order
                from ..dist import ordered_allreduce_hook

                model.register_comm_hook(group, ordered_allreduce_hook)
        return model, torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    # rank=None: start at full rank (to_low_rank clamps the rank to min(out, in) per layer).
    rank = sys.maxsize if config.rank is None else config.rank
    to_low_rank(model, rank=rank, exclude=list(config.exclude) or None)
    if config.target is not None:  # the ramp counts augmentations
        truncation = Budget(config.target, ramp_steps=int(RAMP_SHARE * total_steps) // config.update_every)
    else:
        truncation = Tolerance(config.tau)
    return model, methods.build(config.method, model, config.lr, truncation, tau_min=config.tau_min,
                                momentum=config.momentum, update_every=config.update_every,
                                process_group=group)


def resumable(config: TrainConfig) -> dict:
    """What a checkpoint must agree on to resume a run (not where its records or checkpoints go;
    `update_every` only when it is not 1, so checkpoints written before the option still resume)."""
    return {k: v for k, v in config.to_dict().items()
            if k not in ("out", "checkpoint_dir") and not (k == "update_every" and v == 1)}


class FileCheckpoints:
    """One process's checkpoints for :class:`CodedCheckpoints` (the checkpointer it calls): the
    newest state as ``folder/checkpoint.pt`` (:func:`torch.save`, written atomically, so a crash
    leaves the one before), restored from there with ``torch.load(weights_only=True)``."""

    NAME = "checkpoint.pt"

    def __init__(self, folder: Path) -> None:
        self.root_dir = Path(folder)

    def save(self, state: Any, step: int, *, per_rank: Any = None, blocking: bool = True) -> None:
        import io

        buffer = io.BytesIO()
        torch.save({"step": step, "state": state, "per_rank": per_rank}, buffer)
        self.root_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.root_dir / self.NAME, buffer.getvalue())

    def restore(self):  # type: ignore[no-untyped-def]
        from types import SimpleNamespace

        path = self.root_dir / self.NAME
        if path.is_symlink() or not path.exists():
            return None
        if not path.is_file():
            raise ValueError(f"{path} is not a regular file; remove it or choose another checkpoint folder")
        try:
            got = torch.load(path, weights_only=True)
        except Exception as e:
            raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e}); remove it or "
                             "choose another checkpoint folder") from None
        if not isinstance(got, dict) or not {"step", "state", "per_rank"} <= set(got):
            raise ValueError(f"{path} is not a checkpoint of `rankwise train`; choose another checkpoint "
                             "folder")
        return SimpleNamespace(state=got["state"], per_rank=got["per_rank"], step=got["step"], repaired=[],
                               skipped=[])

    def wait(self) -> None:
        return None


def _checkpoints(config: TrainConfig, group) -> CodedCheckpoints | None:
    """The checkpoint callback when the config asks for checkpoints: one process's
    (:class:`FileCheckpoints` in ``checkpoint_dir``), or the data-parallel run's coded ones."""
    if config.checkpoint_every is None:
        return None
    if group is None:
        return CodedCheckpoints(FileCheckpoints(config.checkpoint_dir), config.checkpoint_every,
                                identity=resumable(config))
    if torch.distributed.get_world_size(group) < 4:
        raise ValueError("coded checkpoints (`checkpoint_every`) need a data-parallel run on >= 4 ranks "
                         "(the code tolerates t = 1 lost rank with n > 3t)")
    from ..ckpt import CodedCheckpointer

    return CodedCheckpoints(CodedCheckpointer(t=1, store_dir=config.checkpoint_dir, process_group=group),
                            config.checkpoint_every, identity=resumable(config))


class _EpochRecords(Callback):
    """The run's :class:`EpochRecord` s (kept in checkpoints), the record files and the progress callback."""

    def __init__(self, x_tr: Tensor, y_tr: Tensor, x_te: Tensor, y_te: Tensor, rec: Records,
                 callback: ProgressCallback | None) -> None:
        self.data = (x_tr, y_tr, x_te, y_te)
        self.rec, self.callback = rec, callback
        self.history: list[EpochRecord] = []

    def _progress(self, loop: Loop, record: EpochRecord | None) -> None:
        if self.callback is not None:
            ranks = loop.optimizer.ranks() if isinstance(loop.optimizer, AugmentedBUG) else {}
            self.callback(Progress(loop.epoch, loop.epochs, loop.step, loop.steps, loop.loss_sum / loop.seen,
                                   loop.correct_sum / loop.seen, ranks, record))

    def on_step_end(self, loop: Loop) -> None:
        if loop.step < loop.steps:  # the epoch's last step reports with its record
            self._progress(loop, None)

    def on_epoch_end(self, loop: Loop) -> None:
        model, opt = loop.model, loop.optimizer
        x_tr, y_tr, x_te, y_te = self.data
        low_rank = isinstance(opt, AugmentedBUG)
        elapsed = time.perf_counter() - loop.epoch_started
        if loop.process_group is not None:  # every rank's record (and checkpoint) the same: the slowest's
            t = torch.tensor([elapsed], dtype=torch.float64)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=loop.process_group)
            elapsed = float(t[0])
        record = EpochRecord(loop.epoch, loop.loss_sum / loop.seen, accuracy(model, x_tr, y_tr),
                             accuracy(model, x_te, y_te), opt.ranks() if low_rank else {},
                             float(compression(model)["ratio"]), elapsed, opt.taus() if low_rank else {},
                             (opt.budget() or {}).get("budget_params") if low_rank else None)
        self.history.append(record)
        self.rec.epoch(record)
        self._progress(loop, record)

    def state_dict(self) -> dict[str, Any]:
        return {"history": [r._asdict() for r in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [EpochRecord(**h) for h in state["history"]]
        for r in self.history:  # a restarted rank 0 writes the records again
            self.rec.epoch(r)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` atomically (see :func:`rankwise._io.write_atomic`)."""
    text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n"
    write_atomic(path, text.encode("utf-8"))


class Records:
    """metrics.csv, TensorBoard and final.json in one directory; does nothing for ``None``."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.writer = None
        self.csv_file = None
        self.csv = None

    def __enter__(self) -> Records:
        if self.out is not None:
            from .._extras import require

            require("tensorboard", "the run records (TensorBoard events)")
            from torch.utils.tensorboard import SummaryWriter

            self.out.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(self.out))
            self.csv_file = open(self.out / "metrics.csv", "w", newline="", encoding="utf-8")
        return self

    def epoch(self, r: EpochRecord) -> None:
        if self.out is None:
            return
        row = {"epoch": r.epoch, "train_loss": r.train_loss, "train_acc": r.train_acc,
               "test_acc": r.test_acc, "compression": r.compression, "epoch_time": r.epoch_time}
        row.update({f"rank/{name}": rank for name, rank in r.ranks.items()})
        row.update({f"tau/{name}": tau for name, tau in r.taus.items()})
        if r.budget is not None:
            row["budget_params"] = r.budget
        if self.csv is None:
            self.csv = csv.DictWriter(self.csv_file, fieldnames=list(row))
            self.csv.writeheader()
        self.csv.writerow(row)
        self.csv_file.flush()
        w = self.writer
        w.add_scalar("loss/train", r.train_loss, r.epoch)
        w.add_scalar("accuracy/train", r.train_acc, r.epoch)
        w.add_scalar("accuracy/test", r.test_acc, r.epoch)
        w.add_scalar("compression/ratio", r.compression, r.epoch)
        for name, rank in r.ranks.items():
            w.add_scalar(f"rank/{name}", rank, r.epoch)
        for name, tau in r.taus.items():
            w.add_scalar(f"tau/{name}", tau, r.epoch)
        if r.budget is not None:
            w.add_scalar("budget/params", r.budget, r.epoch)
        w.flush()

    def model(self, model: nn.Module) -> None:
        """The trained model's ``state_dict`` as ``model.pt`` (on the CPU; a DDP wrapper's module's)."""
        if self.out is None:
            return
        import io

        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        state = {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in inner.state_dict().items()}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_atomic(self.out / "model.pt", buffer.getvalue())

    def final(self, summary: dict[str, Any]) -> None:
        if self.out is not None:
            write_json_atomic(self.out / "final.json", summary)

    def __exit__(self, *exc) -> None:
        if self.csv_file is not None:
            self.csv_file.close()
        if self.writer is not None:
            self.writer.close()
