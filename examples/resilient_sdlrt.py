"""Data-parallel SDLRT that survives a lost worker: the three capabilities in one job.

``rankwise train --nproc 4 --checkpoint-every 10 --checkpoint-dir DIR --max-restarts 1`` trains
an MLP on scikit-learn's digits with SDLRT on 4 torchrun workers, each on its shard of every
batch (``rankwise.SDLRT(..., process_group=WORLD)``), writing a 2-D coded checkpoint every 10
steps. This script runs that job twice: uninterrupted, and while it SIGKILLs worker 2 right
after the first checkpoint and deletes its node-local checkpoint folder. torchrun restarts the
group; the lost fragment is repaired from its peers; training finishes with losses,
accuracies, ranks and τ equal to the uninterrupted run's bit for bit. ::

    python examples/resilient_sdlrt.py [WORKDIR] [-- rankwise train options]

Multi-node: the same ``rankwise.train`` under torchrun's own ``--nnodes`` / ``--rdzv-endpoint``
(``torchrun ... -m rankwise.cli._train_dp CONFIG_JSON SUMMARY_PATH`` is what ``--nproc``
launches). The pattern in a training script of your own::

    rankwise.dist.init_process_group()                     # restart-safe
    pg = torch.distributed.group.WORLD
    model = rankwise.to_low_rank(model, rank=32)           # the same model on every rank
    opt = rankwise.SDLRT(model, 0.05, tau=0.1, momentum=0.9, process_group=pg)   # no DDP wrapper
    ck = CodedCheckpoints(CodedCheckpointer(t=1, store_dir="/local/ckpt", process_group=pg), every=10)
    rankwise.train.fit(model, opt, X, y, epochs=3, batch_size=64, process_group=pg,
                       shuffle=torch.Generator().manual_seed(0), callbacks=[ck])  # resumes if it can
"""

import json
import sys

from rankwise.experiments.resilient_train import run_resilient

if __name__ == "__main__":
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    usage = "usage: python examples/resilient_sdlrt.py [WORKDIR] [-- rankwise train options]"
    if argv in (["-h"], ["--help"]):
        print(__doc__.split("::")[0].strip() + "\n\n" + usage)
        sys.exit(0)
    if any(a.startswith("-") for a in argv) or len(argv) > 1:
        sys.exit(f"error: unknown arguments {argv}\n{usage}")
    workdir = argv[0] if argv else "runs/resilient_sdlrt"
    options = extra or ["--method", "sdlrt", "--model", "mlp", "--rank", "32", "--tau", "0.3",
                        "--epochs", "3"]
    try:
        r = run_resilient(workdir, args=tuple(options))
    except (FileExistsError, NotADirectoryError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    last = r["faulty"]["history"][-1]
    print(json.dumps({"bitwise_equal": r["bitwise_equal"], "killed_after": r["killed_after_checkpoint"],
                      "restored_from": r["restored_from"], "final_ranks": r["faulty"]["ranks"],
                      "test_acc": r["faulty"]["test_acc"], "last_epoch_train_loss": last["train_loss"],
                      "seconds": r["seconds"]}, indent=1))
    sys.exit(0 if r["bitwise_equal"] else 1)
