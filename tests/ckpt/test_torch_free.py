"""The codec, the file formats and the one layout's reader need numpy only: `rankwise ckpt`'s
argument errors and its folder commands do not pay for importing torch (issue 41's newcomer
round: `ckpt encode --out EXISTING` took 2–4.5 s, importing torch through rankwise.ckpt)."""

from __future__ import annotations

import subprocess
import sys


def test_ckpt_argument_errors_do_not_import_torch():
    code = ("import sys, rankwise.ckpt as c; from rankwise.ckpt import _layout; "
            "c.read_commitment, c.read_fragment, c.Code2D, c.Commitment, c.Fragment, _layout.scan; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
