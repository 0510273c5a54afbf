"""2-D coded checkpoint codec: throughput and bytes moved, side by side with 1-D Reed-Solomon
and (t+1)-way replication, in one run.

Run: ``.venv/bin/python benchmarks/ckpt_codec.py`` (256 MiB for ISA-L, 16 MiB for the numpy
reference backend; ``--mib`` / ``--numpy-mib`` to change, ``--quick`` for a smoke run).

Throughputs are ratios to a numpy memcpy of the same data measured in the same run.
Repair is timed two ways: the sum over all k helpers plus the decode (one machine does all
the work), and the critical path (the slowest single helper + the decode), which is what a
replacement waits for when the helpers run on their own machines.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from rankwise.ckpt import Code2D
from rankwise.ckpt._backends import isal_available

CASES = [(4, 1), (10, 3), (31, 10)]


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        out = None  # the previous result is freed first: its memory is reused, as in a training loop
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run_case(n: int, t: int, data: bytes, backend: str, repeats: int, memcpy_s: float) -> dict:
    code = Code2D(n, t, backend=backend)
    k, size = code.k, len(data)
    enc_s, disp = timed(lambda: code.encode(data), repeats)
    com = disp.commitment
    ret_s, out = timed(lambda: code.retrieve(disp.fragments[t:], com), repeats)  # parity included
    assert out == data
    target, helpers = 0, disp.fragments[1:k + 1]
    per_helper, syms = [], []
    for f in helpers:
        s, sym = timed(lambda f=f: code.helper_symbols(f, target), 1)
        per_helper.append(s)
        syms.append(sym)
    dec_s, frag = timed(lambda: code.repair(target, syms, com), repeats)
    assert frag == disp.fragments[target]
    payload = sum(s.nbytes for s in syms)
    return dict(
        n=n, t=t, k=k, backend=backend, mib=size / 2**20,
        encode=memcpy_s / enc_s, retrieve=memcpy_s / ret_s, encode_mbs=size / 1e6 / enc_s,
        memcpy_mbs=size / 1e6 / memcpy_s,
        repair_seq_s=sum(per_helper) + dec_s, repair_crit_s=max(per_helper) + dec_s, retrieve_s=ret_s,
        stored=2 * n * k * com.block_size / size, repair_bytes=payload / size,
        repair_formula=2 * k / k**2, wire=sum(s.wire_bytes for s in syms) / size,
    )


def profile(mib: int) -> None:
    """Where an encode spends its time: GF(2^8) products alone, then a cProfile of one encode."""
    import cProfile
    import pstats

    from rankwise.ckpt import _isal

    rng = np.random.default_rng(0)
    X = rng.integers(0, 256, (3, 32 << 20), dtype=np.uint8)
    A = _isal.cauchy_generator(4, 3)[3:]
    s, _ = timed(lambda: _isal.matmul(A, X), 3)
    print(f"ISA-L product alone (1×3 coefficients over 3×32 MiB): {X.nbytes / 1e6 / s:.0f} MB/s of input")
    data = rng.integers(0, 256, mib << 20, dtype=np.uint8).tobytes()
    code = Code2D(4, 1)
    prof = cProfile.Profile()
    prof.runcall(code.encode, data)
    pstats.Stats(prof).sort_stats("tottime").print_stats(8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="data size for ISA-L")
    ap.add_argument("--numpy-mib", type=int, default=16, help="data size for the numpy backend")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="4 MiB / 1 MiB, one repeat")
    ap.add_argument("--profile", action="store_true",
                    help="instead: the ISA-L product alone, and a cProfile of one encode (n=4, t=1)")
    args = ap.parse_args()
    if args.profile:
        profile(args.mib)
        return
    if args.quick:
        args.mib, args.numpy_mib, args.repeats = 4, 1, 1
    rng = np.random.default_rng(0)
    rows = []
    backends = (["isal"] if isal_available() else []) + ["numpy"]
    for backend in backends:
        mib = args.mib if backend == "isal" else args.numpy_mib
        buf = rng.integers(0, 256, mib << 20, dtype=np.uint8)
        memcpy_s, _ = timed(lambda buf=buf: buf.copy(), 5)
        data = buf.tobytes()
        for n, t in CASES:
            rows.append(run_case(n, t, data, backend, args.repeats, memcpy_s))
            r = rows[-1]
            print(f"done n={n} t={t} {backend} ({r['mib']:.0f} MiB)", flush=True)
    head = ("| n | t | backend | MiB | encode MB/s (memcpy MB/s) | encode ×memcpy | retrieve ×memcpy | "
            "repair / retrieve time "
            "(critical path; all on one machine) | stored ×|m| (2-D / RS / repl.) | repair bytes ×|m| "
            "(measured; formula 2/k; 1-D RS 1; repl. 1) |")
    print("\n" + head + "\n|" + "---|" * 10)
    for r in rows:
        print(f"| {r['n']} | {r['t']} | {r['backend']} | {r['mib']:.0f} | {r['encode_mbs']:.0f} "
              f"({r['memcpy_mbs']:.0f}) | {r['encode']:.3f} | "
              f"{r['retrieve']:.3f} | {r['repair_crit_s'] / r['retrieve_s']:.3f}; "
              f"{r['repair_seq_s'] / r['retrieve_s']:.2f} (target 3/k = {3 / r['k']:.3f}) | "
              f"{r['stored']:.3f} / {r['n'] / r['k']:.3f} / {r['t'] + 1} | "
              f"{r['repair_bytes']:.4f} (wire {r['wire']:.4f}); {r['repair_formula']:.4f} |")


if __name__ == "__main__":
    main()
