"""Can a model-wide rank allocation beat a uniform one on the LM? The spectra of a trained dense
GPT's projections answer it without training: each projection truncated at the uniform start
ranks of a compression (what ``dlrt`` and ``fixed`` start from) against the ranks the budget's
allocation rule gives for the same parameters, compared by the relative error of the weights
and by the validation bits of the truncated model (no fine-tuning).

``python -m rankwise.experiments.lm.lm_spectra --width 128 --context 64 --steps 1500 --lr 0.01``
trains the dense model (``rankwise lm``'s run, its defaults otherwise) and prints the tables.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch

from .lm_compare import LmRunSpec, _bits, projections, rank_for, run_one, spaced


def analyse(model: torch.nn.Module, compression: float, rule: str = "error-sqrt") -> dict:
    """Per projection: shape, uniform rank, allocated rank and the relative truncation error
    ‖σ[r:]‖/‖σ‖ at each; totals over all projections (energy-weighted)."""
    from rankwise.nn._budget import allocate_ranks

    proj = projections(model)
    spectra = {n: torch.linalg.svdvals(m.weight.detach().double()) for n, m in proj.items()}
    shapes = {n: (m.out_features, m.in_features) for n, m in proj.items()}
    uniform = {n: rank_for(*shapes[n], compression) for n in proj}
    budget = sum(r * (m + n_) + r * r for r, (m, n_) in ((uniform[n], shapes[n]) for n in proj))
    allocated = allocate_ranks(spectra, shapes, budget, min_rank=1, rule=rule)

    def tail(s: torch.Tensor, r: int) -> float:
        return float(s[r:].norm() / s.norm())

    rows = {n: dict(shape=shapes[n], uniform=uniform[n], allocated=allocated[n],
                    err_uniform=tail(spectra[n], uniform[n]), err_allocated=tail(spectra[n], allocated[n]))
            for n in proj}
    total = lambda ranks: math.sqrt(sum(float(s[ranks[n]:].square().sum()) for n, s in spectra.items())  # noqa: E731
                                    / sum(float(s.square().sum()) for s in spectra.values()))
    return dict(rows=rows, total_uniform=total(uniform), total_allocated=total(allocated),
                budget=budget, used=sum(r * (m + n_) + r * r for r, (m, n_) in
                                        ((allocated[n], shapes[n]) for n in proj)))


def truncated_bits(model: torch.nn.Module, ranks: dict[str, int], x, y) -> float:
    """Validation bits of `model` with each projection replaced by its rank-`ranks` SVD."""
    import rankwise

    low = copy.deepcopy(model)
    for r in sorted(set(ranks.values())):
        rankwise.to_low_rank(low, rank=r, include=[n for n, k in ranks.items() if k == r])
    return _bits(low, x, y)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("width", 128), ("context", 64), ("steps", 1500), ("batch", 16), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--compressions", default="0.5,0.75")
    p.add_argument("--windows", type=int, default=1024)
    a = p.parse_args(argv)
    from ...data._bytes import load_bbc_text, sequential_windows

    torch.set_num_threads(1)
    keep: list = []
    spec = LmRunSpec("dense", lr=a.lr, seed=a.seed, steps=a.steps, batch=a.batch, context=a.context,
                     width=a.width, clip=a.clip, final_windows=a.windows)
    rec = run_one(spec, keep=keep)
    model = keep[0].eval()
    vx, vy = spaced(*sequential_windows(load_bbc_text().val, a.context), a.windows)
    print(f"dense: {rec['val_bits']:.3f} validation bits ({a.windows} windows)")
    for c in (float(v) for v in a.compressions.split(",")):
        res = analyse(model, c)
        uni = {n: row["uniform"] for n, row in res["rows"].items()}
        alloc = {n: row["allocated"] for n, row in res["rows"].items()}
        print(f"\ncompression {c:g}: budget {res['budget']:,} parameters (allocated: {res['used']:,})")
        print("| projection | shape | uniform rank | error | allocated rank | error |")
        print("|---|---|---|---|---|---|")
        for n, row in res["rows"].items():
            m, k = row["shape"]
            print(f"| {n} | {m}×{k} | {row['uniform']} | {row['err_uniform']:.3f} | "
                  f"{row['allocated']} | {row['err_allocated']:.3f} |")
        print(f"| all (energy-weighted) | | | {res['total_uniform']:.3f} | | {res['total_allocated']:.3f} |")
        print(f"truncated, no fine-tuning: uniform {truncated_bits(model, uni, vx, vy):.3f} bits, "
              f"allocated {truncated_bits(model, alloc, vx, vy):.3f} bits")


if __name__ == "__main__":
    main()
