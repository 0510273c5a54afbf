"""Pretrain a LLaMA-style byte-level language model with rank-adaptive low-rank layers under FSDP2,
with ``torch.distributed.checkpoint`` checkpoints that resume — at the same or another world size.

    torchrun --nproc_per_node 2 examples/pretrain_fsdp.py --steps 40 --every 10 --ckpt runs/fsdp
    torchrun --nproc_per_node 2 examples/pretrain_fsdp.py --text my_corpus.txt --width 256 --steps 2000

Every projection of the model is factorised at compression 0.5 with fixed-capacity factors
(``capacity="auto"``: twice each start rank), every transformer block and the root are sharded with
``fully_shard``, and DLRT trains the factors with the Muon rule (``rule=rankwise.Muon()``; the norms,
embedding and head with AdamW, Muon's recipe). Each rank draws its own random windows of the text
(any UTF-8 file read as bytes, or the bundled BBC News). Every ``--every`` steps the model and the
optimizer (ranks, moments, τ) go to ``--ckpt/step_N`` through DCP: on 4 or more ranks as a coded
checkpoint (:class:`rankwise.ckpt.CodedStorageWriter`, t = 1: each rank writes its row and column
to ``step_N/rank{i}`` on its own disk; a lost or wiped rank is rebuilt from its peers when the group
resumes), on fewer with DCP's own ``FileSystemWriter``. Started again with the same ``--ckpt`` the
run resumes from the newest one — at the same or another world size (a coded checkpoint read by
another world size reads every ``rank{i}`` folder it can reach, any 3 of 4 suffice). The same
script runs on one process without torchrun. Prints the loss and the layers' ranks on rank 0.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import rankwise
from rankwise.ckpt import CodedStorageReader, CodedStorageWriter
from rankwise.models import llama


def text_stream(path: str | None) -> torch.Tensor:
    """Byte tokens of a text file, or of the bundled BBC News training split."""
    if path is None:
        return rankwise.data.load_bbc_text().train
    if not Path(path).is_file():
        raise SystemExit(f"{path}: no such file")
    data = Path(path).read_bytes()
    if len(data) < 1000:
        raise SystemExit(f"{path}: {len(data)} bytes is too short to train on")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", help="a text file (default: the bundled BBC News)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10, help="a DCP checkpoint every this many steps")
    ap.add_argument("--ckpt", default="runs/pretrain_fsdp", help="the checkpoint folder (resumed from)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        rankwise.dist.init_process_group()  # (gloo on CPU, nccl with CUDA)
    try:
        train(a, distributed)
    finally:  # after train() returned: what holds the group (FSDP, the optimizer) is freed before it
        if distributed:
            dist.destroy_process_group()


def train(a: argparse.Namespace, distributed: bool) -> None:
    rank = dist.get_rank() if distributed else 0
    stream = text_stream(a.text)

    torch.manual_seed(0)  # the same model on every rank
    model = llama(context=a.context, width=a.width, depth=a.depth, heads=4)
    ranks = {n: max(1, (m.out_features * m.in_features) // (2 * (m.out_features + m.in_features)))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "head"}
    rankwise.to_low_rank(model, rank=ranks, capacity="auto")  # compression ≈ 0.5, headroom 2×
    if distributed:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = rankwise.DLRT(model, a.lr, tau=0.05, rule=rankwise.Muon())

    start, folder = 0, Path(a.ckpt)
    coded = distributed and dist.get_world_size() >= 4  # a 2-D code needs n ≥ 3t + 1 ranks

    def is_coded(p: Path) -> bool:
        return any(p.glob("rank*/.metadata.rwck"))

    saved = sorted((int(p.name.split("_")[1]), p) for p in folder.glob("step_*")
                   if (p / ".metadata").exists() or is_coded(p))
    if saved:
        start, path = saved[-1]
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        reader = CodedStorageReader(path) if is_coded(path) else None
        dcp.load(state, checkpoint_id=str(path), storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from {path}")

    layers = [m for m in model.modules() if isinstance(m, rankwise.LowRankLinear)]
    for step in range(start, a.steps):
        g = torch.Generator().manual_seed(1_000_003 * step + rank)  # (the same windows after a resume)
        x, y = rankwise.data.random_windows(stream, a.batch, a.context, g)

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            return loss

        loss = opt.step(closure).detach()
        if distributed:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        if rank == 0 and ((step + 1) % 5 == 0 or step + 1 == a.steps):
            print(f"step {step + 1}: loss {loss.item():.4f}, ranks {min(m.rank for m in layers)}–"
                  f"{max(m.rank for m in layers)} (capacity {max(m.capacity for m in layers)})", flush=True)
        if (step + 1) % a.every == 0:
            model_sd, optim_sd = get_state_dict(model, opt)
            path = folder / f"step_{step + 1}"
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path),
                     storage_writer=CodedStorageWriter(path, t=1) if coded else None)


if __name__ == "__main__":
    main()
