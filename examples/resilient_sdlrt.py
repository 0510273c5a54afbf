"""Data-parallel SDLRT that survives a lost worker: the three capabilities in one job.

The hidden layers of an MLP on scikit-learn's digits are low-rank and trained by
``rankwise.SDLRT(..., process_group=WORLD)`` on 4 torchrun workers (each on its shard of every
batch); a 2-D coded checkpoint is written every 5 steps. The harness kills one worker with
SIGKILL mid-run and wipes its node-local store; torchrun restarts the group; the lost fragment
is repaired from its peers; training finishes with a loss curve, parameters and ranks bitwise
equal to an uninterrupted run. Run it with either of::

    python examples/resilient_sdlrt.py [WORKDIR]
    rankwise ckpt demo --method sdlrt

One job yourself (multi-node: torchrun's usual ``--nnodes`` / ``--rdzv-endpoint``)::

    torchrun --nproc_per_node=4 --max-restarts=1 -m rankwise.experiments.ddp_resilience worker \\
        --method sdlrt --out runs/me --store runs/me/store

The pattern in a training script::

    init_process_group()                                   # rankwise.dist: restart-safe
    model = rankwise.to_low_rank(model, rank=16)           # the same model on every rank
    opt = rankwise.SDLRT(model, 1e-2, tau=0.2, optimizer="adam",
                         process_group=torch.distributed.group.WORLD)   # no DDP wrapper
    ck = rankwise.ckpt.CodedCheckpointer(t=1, store_dir="/local/ckpt")
    ...                                                    # restore, then train on this rank's shard
"""

import json
import sys

from rankwise.experiments.ddp_resilience import run_demo

if __name__ == "__main__":
    workdir = sys.argv[1] if len(sys.argv) > 1 else "runs/resilient_sdlrt"
    try:
        r = run_demo(workdir, method="sdlrt", corrupt_scenario=False)
    except (ValueError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    keys = ("bitwise_equal", "ranks_first", "ranks_final", "kill_rank", "kill_step", "restored_step",
            "repaired", "state_bytes", "repair_bytes_total", "repair_seconds", "reference_seconds")
    print(json.dumps({k: r[k] for k in keys}, indent=1))
    sys.exit(0 if r["bitwise_equal"] else 1)
