"""The flop floor of benchmarks/step_time.py: counts against hand counts."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import load_benchmark


def _step_time():
    return load_benchmark("step_time")


def test_factorisations_are_counted_by_their_textbook_formulas():
    st = _step_time()
    A = torch.randn(300, 40, dtype=torch.float64)
    G = A.T @ A + torch.eye(40, dtype=torch.float64)
    with FlopCounterMode(display=False, custom_mapping=st._lapack_formulas()) as c:
        torch.linalg.qr(A)
        torch.linalg.eigh(G)
        torch.linalg.svd(A, full_matrices=False)
        L, _ = torch.linalg.cholesky_ex(G)
        torch.linalg.solve_triangular(L, A.T, upper=False)
    counts = {str(k).split(".")[-1].rstrip("')>"): v for k, v in c.get_flop_counts()["Global"].items()}
    m, n = 300, 40
    assert counts == {"linalg_qr": int(4 * m * n * n - 4 * n**3 / 3), "_linalg_eigh": 9 * n**3,
                      "_linalg_svd": 6 * m * n * n + 20 * n**3, "linalg_cholesky_ex": n**3 // 3,
                      "linalg_solve_triangular": n * n * m}
    with FlopCounterMode(display=False, custom_mapping=st._lapack_formulas()) as c:  # a batch of 3
        torch.linalg.eigh(G.expand(3, n, n))
        torch.linalg.svd(A.expand(3, m, n), full_matrices=False)
        L, _ = torch.linalg.cholesky_ex(G.expand(3, n, n))
        torch.linalg.solve_triangular(L, A.T.expand(3, n, m), upper=False)
    counts = {str(k).split(".")[-1].rstrip("')>"): v for k, v in c.get_flop_counts()["Global"].items()}
    assert counts == {"_linalg_eigh": 3 * 9 * n**3, "_linalg_svd": 3 * (6 * m * n * n + 20 * n**3),
                      "linalg_cholesky_ex": 3 * (n**3 // 3), "linalg_solve_triangular": 3 * n * n * m}


def test_a_dense_step_counts_its_matrix_products():
    st = _step_time()
    b, w, depth = 8, 16, 3
    model = st.dense_mlp(w, depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(b, w), torch.randn(b, w)
    cfg = st.Config("dense", model=model, opt=opt, closure=st.make_closure(opt, model, x, y))
    # per layer 2bw² forward and 2bw² for the weight gradient; the input gradient (2bw²) for
    # every layer but the first (x needs none)
    assert st.counted_flops(cfg) == 2 * b * w * w * (2 * depth + depth - 1)
