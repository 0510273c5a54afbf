"""Binomial checkpointing (Griewank 1992; ``revolve``, Griewank & Walther 2000): reverse n
steps of a forward map holding at most s states besides the initial one, recomputing as few
forward steps as possible.

Reversing steps 0…n−1 from the stored state at step 0 with s free slots: with no slot left,
step j is reached by recomputing j steps from the start (n(n−1)/2 in all); otherwise advance m
steps, store that state (one slot), reverse the last n − m steps with s − 1 slots, free it, and
reverse the first m with s. The best m gives

    cost(n, s) = min over 1 ≤ m < n of  m + cost(n − m, s − 1) + cost(m, s),

Griewank's optimum t(n, s + 1) = r·n − C(s + 1 + r, s + 2) with r the least integer such that
C(s + 1 + r, s + 1) ≥ n (tested against this closed form).

:class:`~rankwise.ode.LowRankODEBlock` runs the forward pass anyway (it needs the output), so
the states it stores on the way cost nothing to reach: it stores checkpoints at the positions
:func:`plan` chooses, the optimum of

    D(n, s) = min( cost(n, s),  min over 1 ≤ m < n of  cost(m, s) + D(n − m, s − 1) ),

where the first segment is reversed last, with the s slots its right neighbours freed. A
backward that has to replay every segment then recomputes exactly D(n, s) steps, revolve's
optimum for the same budget when its first forward sweep is free (tested against a brute-force
search over every set of checkpoint positions).
"""

from __future__ import annotations

from functools import cache


@cache
def _table(n: int, s: int) -> tuple[list[list[int]], list[list[int]]]:
    """cost[k][j] and split[k][j] for every k ≤ n, j ≤ s (bottom up: no recursion depth)."""
    cost = [[0] * (s + 1) for _ in range(n + 1)]
    best = [[0] * (s + 1) for _ in range(n + 1)]
    for k in range(2, n + 1):
        cost[k][0] = k * (k - 1) // 2
    for j in range(1, s + 1):
        for k in range(2, n + 1):
            c, arg = None, 0
            for m in range(1, k):
                v = m + cost[k - m][j - 1] + cost[m][j]
                if c is None or v < c:
                    c, arg = v, m
            cost[k][j], best[k][j] = c, arg
    return cost, best


def _checked(n: int, s: int) -> None:
    if not (isinstance(n, int) and isinstance(s, int) and n >= 0 and s >= 0):
        raise ValueError(f"need integers n >= 0 and s >= 0; got n={n!r}, s={s!r}")


def recompute_cost(n: int, s: int) -> int:
    """The fewest forward steps computed to reverse ``n`` steps from a stored initial state
    with ``s`` further states storable: every advance counts, including those that reach the
    states the schedule stores (so ``recompute_cost(n, n − 1) = n − 1``)."""
    _checked(n, s)
    s = min(s, max(n - 1, 0))
    return _table(n, s)[0][n][s]


def split(n: int, s: int) -> int:
    """Where the optimal schedule stores its first state: m steps after the start (0: none)."""
    _checked(n, s)
    s = min(s, max(n - 1, 0))
    return _table(n, s)[1][n][s]


@cache
def _plan_table(n: int, s: int) -> tuple[list[list[int]], list[list[int]]]:
    """D[k][j] and the first segment's length for every k ≤ n, j ≤ s."""
    cost = _table(n, s)[0]
    D = [[cost[k][j] for j in range(s + 1)] for k in range(n + 1)]
    first = [[k] * (s + 1) for k in range(n + 1)]  # k: store nothing more
    for j in range(1, s + 1):
        for k in range(2, n + 1):
            for m in range(1, k):
                v = cost[m][j] + D[k - m][j - 1]
                if v < D[k][j]:
                    D[k][j], first[k][j] = v, m
    return D, first


def plan(n: int, s: int) -> list[int]:
    """Segment lengths (summing to n) between the checkpoints a forward pass of n steps should
    store with s slots besides its initial state, so that a backward replaying every segment
    recomputes as few steps as possible (:func:`planned_cost`). Segment j (from the left) is
    reversed with s − j free slots."""
    _checked(n, s)
    if n < 1:
        raise ValueError("need n >= 1 steps")
    s = min(s, n - 1)
    first = _plan_table(n, s)[1]
    lengths, k, j = [], n, s
    while k > 0:
        m = first[k][j] if j > 0 else k
        lengths.append(m)
        k, j = k - m, j - 1
    return lengths


def planned_cost(n: int, s: int) -> int:
    """Steps a backward recomputes when every segment of :func:`plan` is replayed: D(n, s)."""
    _checked(n, s)
    if n < 1:
        raise ValueError("need n >= 1 steps")
    s = min(s, n - 1)
    return _plan_table(n, s)[0][n][s]
