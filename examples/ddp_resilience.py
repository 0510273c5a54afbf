"""Survive losing a worker under torchrun with 2-D coded checkpoints.

Run the whole demonstration (reference run, killed worker + wiped store + torchrun restart,
lying rank) with either of::

    python examples/ddp_resilience.py demo
    rankwise ckpt demo

or one training job yourself::

    torchrun --nproc_per_node=4 --max-restarts=1 examples/ddp_resilience.py worker \\
        --out runs/me --store runs/me/store

The worker and the harness live in ``rankwise.experiments.ddp_resilience``; the pattern in a
training script is::

    from rankwise.ckpt import CodedCheckpointer
    from rankwise.dist import init_process_group

    init_process_group("gloo")            # one store namespace per torchrun restart attempt
    ck = CodedCheckpointer(t=1, store_dir="/local/ckpt")
    restored = ck.restore()               # repairs this rank from its peers if its store is gone
    if restored is not None:
        state, step = restored.state, restored.step
        ...                               # load model / optimizer; restored.per_rank: RNG states
    ...
    ck.save({"model": model.state_dict(), "optim": opt.state_dict()}, step,
            per_rank={"torch_rng": torch.get_rng_state()})
"""

from rankwise.experiments.ddp_resilience import main

if __name__ == "__main__":
    main()
