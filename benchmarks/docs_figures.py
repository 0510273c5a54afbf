"""Regenerate the README's measured tables from their commands (``make docs-figures``).

Each table sits in README.md between ``<!-- figure:NAME -->`` and ``<!-- /figure:NAME -->``
and is replaced by the fresh output of its command, with a line naming the command and the
commit it ran at:

- ``demo``: ``rankwise demo`` (dense vs DLRT vs SDLRT on the digits);
- ``inference``: ``benchmarks/inference.py`` (dense vs exported low-rank model at 90 %).

Run it on a clean checkout (the commit line says ``+dirty`` otherwise), then commit README.md.
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("demo", "inference")


def demo() -> str:
    from rankwise.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        md = Path(tmp) / "demo.md"
        rc = main(["demo", "--out", str(Path(tmp) / "runs"), "--markdown", str(md)])
        if rc != 0:
            raise SystemExit(f"rankwise demo failed with exit status {rc}")
        return md.read_text()


def inference() -> str:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import inference as bench
    from rankwise._provenance import source_commit

    t0 = time.perf_counter()
    table = bench.main([])
    return (table.rstrip() + "\n\n"
            "*Produced by `python benchmarks/inference.py` (`make docs-figures`) at commit "
            f"{source_commit()}: "
            f"torch {torch.__version__}, {platform.machine()}, 1 thread, float32, median of 15 interleaved "
            f"blocks; ratios are low-rank / dense in the same run; {time.perf_counter() - t0:.0f} s.*\n")


def splice(text: str, name: str, body: str) -> str:
    """`text` with the block between the markers of figure `name` replaced by `body`."""
    pattern = re.compile(rf"(<!-- figure:{name} -->\n).*?(<!-- /figure:{name} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no <!-- figure:{name} --> … <!-- /figure:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text, count=1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help=f"figures to regenerate (default: all of {', '.join(FIGURES)})")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in FIGURES]
    if unknown:
        p.error(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
    from rankwise._io import write_atomic

    for name in args.names or FIGURES:  # each written as soon as it is ready
        body = {"demo": demo, "inference": inference}[name]()
        write_atomic(args.readme, splice(args.readme.read_text(), name, body).encode())
        print(f"README.md: figure {name} regenerated")


if __name__ == "__main__":
    main()
