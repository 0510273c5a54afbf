"""DDP and FSDP2 at N gloo ranks against one process: the equality cases of the integration tests
(``tests/optim/parallel/test_ddp.py``, ``test_fsdp.py``: float64, half or quarter batches, ranks moving)
at another world size, printed as the largest loss and weight differences.

How to run (from the repository root)
    .venv/bin/python benchmarks/dp_match.py --world 4          # about 1 min on 2 cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the tests' cases and process harness)

import torch
from tests.distributed import run_world
from tests.integration import test_ddp as ddp
from tests.integration import test_fsdp as fsdp


def _ddp(rank: int, world: int) -> dict:
    return {c: ddp._train(c, rank, world) for c in ddp.CASES}


def _fsdp(rank: int, world: int) -> dict:
    return {c: fsdp._train(c, rank, world) for c in fsdp.CASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    a = ap.parse_args()
    print("| engine | case | same ranks | max loss difference | max weight difference | a parameter moved |")
    print("|---|---|---|---|---|---|")
    for name, mod, fn in (("DDP", ddp, _ddp), ("FSDP2", fsdp, _fsdp)):
        got = run_world(fn, a.world, Path("/tmp"), a.world, timeout=900)
        for case in mod.CASES:
            one = mod._train(case, None, 1)
            dl = max(abs(x - y) for r in got for x, y in zip(r[case]["losses"], one["losses"], strict=True))
            dw = (max(float((torch.tensor(w) - torch.tensor(v)).abs().max()) for r in got
                      for w, v in zip(r[case]["weights"], one["weights"], strict=True))
                  if "weights" in one else float("nan"))
            same = all(r[case]["ranks"] == one["ranks"] for r in got)
            moved = any(r[case]["moved"] for r in got)
            print(f"| {name} ({a.world} ranks) | {case} | {same} | {dl:.1e} | {dw:.1e} | {moved} |")


if __name__ == "__main__":
    main()
