"""DDTree's best-first frontier (kimijax/spec/ddtree.py): the N pops that choose a budget-N tree's nodes from the
drafter's per-depth top-K log-probs, as one kernel.

The XLA form (`frontier_ref`) pops with one variadic reduce and rewrites two slots with one select per node:
2 launches per node after unrolling, 32 of a b16 round's ~40 tree launches (scripts/offline_gpu.py). Here one
program per request runs all N pops on vectors of N+1 slots held in registers (one slot per lane):

  state per slot: parent, depth, rank, next candidate child's rank (K = none), node score, candidate score,
                  the candidate's rank path (an [L, slots] tile: ranks + 1, 0 = unused)
  a pop:          max candidate score over the live slots, then (only if several slots tie on it) the
                  smallest candidate rank path depth by depth, then the smallest slot: the reference's key
                  (ddtree.py "Tie-break") as masked reductions; the winner's fields, its rank path included,
                  are read with one-hot reductions (no gathers): ~13 reductions per pop without ties
  candidates:     a child's score is parent score + logp[depth, rank] in that order (the same f32 sums)

Same parents, depths, ranks and scores as `frontier_ref`, bit for bit (tests: random logits, ties, tiny V).

Implementations: "xla" `frontier_ref`; "pallas" the kernel (GPU, Triton); "interpret" the kernel on the CPU.
The round uses "xla" until a GPU run measures the kernel (`kimijax.RoundKernels(tree=...)`, an Engine
argument). Triton needs power-of-two vectors: slots pad to n1p = next_pow2(N + 1) lanes, the [L, K] table to [Lp, Kp] (-inf).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tree_attention import next_pow2

__all__ = ["frontier", "frontier_ref", "frontier_pallas"]

_BIG = 1 << 30


# ---------------------------------------------------------------- XLA reference
def _pick_better(n_keys: int, a, b):
    """Combiner for the frontier pop over tuples (live, score, rank path..., slot, payload...): keep the entry
    whose (live, score, -rank path..., -slot) is lexicographically larger; payload rides along. The key is a
    total order (slots are unique), so the reduction is associative and commutative as XLA requires."""
    better = a[0] & ~b[0]
    tie = a[0] == b[0]
    better |= tie & (a[1] > b[1])
    tie &= a[1] == b[1]
    for x, y in zip(a[2:n_keys], b[2:n_keys]):  # rank path columns, then the slot index: smaller wins
        better |= tie & (x < y)
        tie &= x == y
    return tuple(jnp.where(better, x, y) for x, y in zip(a, b))


def frontier_ref(top_logp_LK, budget: int):
    """XLA: the N pops for one request. top_logp_LK f32 [L, K] (sorted descending per depth) -> parents, depths,
    ranks (int32 [N+1]) and scores (f32 [N+1]) in pop order, root at 0; slots past the last existing prefix are
    (-1, 0, -1, -inf)."""
    L, K = top_logp_LK.shape
    N = int(budget)
    n1 = N + 1
    top_logp_LK = top_logp_LK.astype(jnp.float32)
    idx_N1 = jnp.arange(n1, dtype=jnp.int32)
    depth_iota_L = jnp.arange(L, dtype=jnp.int32)

    # Per-slot state packed in one int32 [N+1, 6+2L] array, so a step is one reduce over plain column slices and
    # one select that writes the next state (~2 kernel launches per step on the GPU once the loop is unrolled):
    # parent, depth, rank, next candidate child's rank (the frontier slot), the node's path score (f32 bits),
    # the candidate's score (f32 bits, -inf if none), the node's rank path, the candidate's rank path.
    PAR, DEP, RNK, NXT, SC, CSC, RP = 0, 1, 2, 3, 4, 5, 6
    CP = RP + L
    as_bits = lambda x: lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)
    as_f32 = lambda x: lax.bitcast_convert_type(x, jnp.float32)
    ninf = as_bits(-jnp.inf)
    # rank path row = (r_1 + 1, ..., r_d + 1, 0, ...): +1 so a tuple sorts before its extensions under a plain
    # lexicographic integer compare. NXT = K means no pending candidate child (exhausted, at depth L, or not
    # emitted); its candidate score is then -inf.
    empty_row = jnp.concatenate([jnp.array([-1, 0, -1, K], jnp.int32), ninf[None], ninf[None],
                                 jnp.zeros((2 * L,), jnp.int32)])
    root = empty_row.at[NXT].set(0).at[SC].set(as_bits(0.0)).at[CSC].set(as_bits(top_logp_LK[0, 0]))
    root = root.at[CP].set(1)  # the root's candidate: rank 0 at depth 1
    meta0 = jnp.tile(empty_row[None, :], (n1, 1)).at[0].set(root)

    def candidate(score, path, depth, rank):
        """(live, score bits, rank path) of the child candidate at 0-based depth row `depth`, `rank`."""
        live = (rank < K) & (depth < L)
        sc = jnp.where(live, score + top_logp_LK[jnp.clip(depth, 0, L - 1), jnp.clip(rank, 0, K - 1)], -jnp.inf)
        cpath = path + jnp.where((depth_iota_L == depth) & live, rank + 1, 0)
        return live, as_bits(sc), cpath

    def step(t, meta):
        # Pop = max candidate score, then lexicographically smallest candidate ranks tuple (the reference heap's
        # tuple order), as one variadic reduce over the state's columns. Keys are unique per live slot; the slot
        # index only orders the dead ones. Candidate fields ride along, so the winner needs no gathers (and the
        # step has no scatters: writes are one-hot selects, cheap under vmap).
        cand_ok = meta[:, NXT] < K
        ops = (cand_ok, as_f32(meta[:, CSC]), *[meta[:, CP + d] for d in range(L)], idx_N1, meta[:, DEP],
               meta[:, NXT], meta[:, SC])
        init = ((jnp.bool_(False), jnp.float32(-jnp.inf)) + (jnp.int32(0),) * L
                + (jnp.int32(n1), jnp.int32(0), jnp.int32(0), jnp.int32(0)))
        won = lax.reduce(ops, init, functools.partial(_pick_better, L + 3), (0,))
        any_live, score_n, path_n = won[0], won[1], jnp.stack(won[2:2 + L])
        p, depth_p, r_new, psc = won[2 + L:]
        i = t + 1  # the new node's index = pop order
        d_new = depth_p + 1
        # the new node i: its first child is its candidate
        c_live, c_sc, c_path = candidate(score_n, path_n, d_new, jnp.int32(0))
        row_i = jnp.concatenate([jnp.stack([p, d_new, r_new, jnp.where(c_live, 0, K), as_bits(score_n), c_sc]),
                                 path_n, c_path])
        # the popped slot p moves on to its next sibling (exhausted at rank K)
        par_path = path_n - jnp.where(depth_iota_L == depth_p, r_new + 1, 0)
        s_live, s_sc, s_path = candidate(as_f32(psc), par_path, depth_p, r_new + 1)
        at_i, at_p = idx_N1 == i, (idx_N1 == p) & any_live
        col = jnp.arange(meta.shape[1])
        row_p = jnp.where(col == NXT, jnp.where(s_live, r_new + 1, K), jnp.where(col == CSC, s_sc, 0))
        row_p = jnp.where(col >= CP, jnp.concatenate([jnp.zeros((CP,), jnp.int32), s_path]), row_p)
        keep_p = (col == NXT) | (col == CSC) | (col >= CP)
        meta = jnp.where(at_p[:, None] & keep_p[None, :], row_p[None, :], meta)
        return jnp.where(at_i[:, None], jnp.where(any_live, row_i, empty_row)[None, :], meta)

    # Unrolled for small budgets (a device while loop costs launches per step and splits command buffers);
    # large budgets keep the loop to bound compile time.
    meta = lax.fori_loop(0, N, step, meta0, unroll=True if N <= 32 else 8)
    return meta[:, PAR], meta[:, DEP], meta[:, RNK], as_f32(meta[:, SC])


# ---------------------------------------------------------------- kernel
def _frontier_kernel(logp_ref, par_ref, dep_ref, rnk_ref, sc_ref, *, N, L, K, Lp, Kp, n1p, masked):
    n1 = N + 1
    li = lax.broadcasted_iota(jnp.int32, (Lp, Kp), 0)
    ki = lax.broadcasted_iota(jnp.int32, (Lp, Kp), 1)
    if masked:
        logp = pltriton.load(logp_ref.at[pl.ds(0, Lp), pl.ds(0, Kp)], mask=(li < L) & (ki < K), other=-jnp.inf)
    else:
        logp = logp_ref[...]
    idx = lax.broadcasted_iota(jnp.int32, (n1p,), 0)
    ninf = jnp.float32(-jnp.inf)

    def lookup(depth, rank):  # logp[depth, rank] for in-range scalars (one-hot max: exact, no gather)
        hit = (li == depth) & (ki == rank)
        return jnp.max(jnp.max(jnp.where(hit, logp, ninf), axis=1), axis=0)

    def pick_i(v, p):  # v[p], int vector
        return jnp.sum(jnp.where(idx == p, v, jnp.int32(0)))

    def pick_f(v, p):  # v[p], f32 vector (exact)
        return jnp.max(jnp.where(idx == p, v, ninf))

    i32 = jnp.int32  # explicit: a where over two Python ints lowers to an i1 select in Triton (jax 0.11.2)
    lvec = lax.broadcasted_iota(jnp.int32, (Lp,), 0)
    lrow = lax.broadcasted_iota(jnp.int32, (Lp, n1p), 0)
    lane = lax.broadcasted_iota(jnp.int32, (Lp, n1p), 1)

    def candidate(score, path_L, depth, rank):  # path_L: a rank path as an [Lp] vector
        live = (rank < K) & (depth < L)
        sc = jnp.where(live, score + lookup(jnp.clip(depth, 0, L - 1), jnp.clip(rank, 0, K - 1)), ninf)
        return live, sc, path_L + jnp.where((lvec == depth) & live, rank + 1, i32(0))

    def tiebreak(tie, cp):  # equal best scores: the smallest candidate rank path, depth by depth
        for d in range(L):
            c = jnp.sum(jnp.where(lrow == d, cp, i32(0)), axis=0)
            tie = tie & (c == jnp.min(jnp.where(tie, c, i32(_BIG))))
        return tie

    full_i = lambda x: jnp.full((n1p,), x, jnp.int32)
    root = idx == 0
    par, dep, rnk = full_i(-1), full_i(0), full_i(-1)
    nxt = jnp.where(root, i32(0), i32(K))
    sc = jnp.where(root, jnp.float32(0.0), ninf)
    csc = jnp.where(root, lookup(0, 0), ninf)
    # candidate rank paths, depth rows x slot lanes; the root's candidate is rank 0 at depth 1
    cp = jnp.where((lrow == 0) & (lane == 0), i32(1), i32(0))

    def step(t, st):
        par, dep, rnk, nxt, sc, csc, cp = st
        live = nxt < K
        any_live = jnp.max(live.astype(jnp.int32)) > 0
        best = jnp.max(jnp.where(live, csc, ninf))
        tie = live & (csc == best)
        # exact score ties are rare with real logits: the depth-by-depth path compare runs only when needed
        tie = lax.cond(jnp.sum(tie.astype(jnp.int32)) > 1, tiebreak, lambda x, _: x, tie, cp)
        p = jnp.min(jnp.where(tie, idx, i32(_BIG)))
        depth_p, r_new, psc, score_n = pick_i(dep, p), pick_i(nxt, p), pick_f(sc, p), pick_f(csc, p)
        path_n = jnp.sum(jnp.where(lane == p, cp, i32(0)), axis=1)  # [Lp], one reduction
        i = t + 1
        d_new = depth_p + 1
        c_live, c_sc, c_path = candidate(score_n, path_n, d_new, jnp.int32(0))
        par_path = path_n - jnp.where(lvec == depth_p, r_new + 1, i32(0))
        s_live, s_sc, s_path = candidate(psc, par_path, depth_p, r_new + 1)
        at_p = (idx == p) & any_live  # the popped slot moves on to its next sibling
        nxt = jnp.where(at_p, jnp.where(s_live, r_new + 1, i32(K)), nxt)
        csc = jnp.where(at_p, s_sc, csc)
        cp = jnp.where(at_p[None, :], s_path[:, None], cp)
        at_i = idx == i  # the new node (an empty slot when nothing was live)
        put = lambda new, empty, old: jnp.where(at_i, jnp.where(any_live, new, empty), old)
        par, dep, rnk = put(p, i32(-1), par), put(d_new, i32(0), dep), put(r_new, i32(-1), rnk)
        nxt = put(jnp.where(c_live, i32(0), i32(K)), i32(K), nxt)
        sc, csc = put(score_n, ninf, sc), put(c_sc, ninf, csc)
        cp = jnp.where(at_i[None, :], jnp.where(any_live, c_path, i32(0))[:, None], cp)
        return par, dep, rnk, nxt, sc, csc, cp

    par, dep, rnk, _, sc, _, _ = lax.fori_loop(0, N, step, (par, dep, rnk, nxt, sc, csc, cp))
    keep = idx < n1
    for ref, v in ((par_ref, par), (dep_ref, dep), (rnk_ref, rnk), (sc_ref, sc)):
        if masked:
            pltriton.store(ref.at[pl.ds(0, n1p)], v, mask=keep)
        else:
            ref[...] = v


def frontier_pallas(top_logp_LK, budget: int, *, interpret: bool = False):
    """The kernel: same contract as `frontier_ref` (one request; vmap adds a grid axis)."""
    L, K = top_logp_LK.shape
    N = int(budget)
    if N < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    n1, n1p, Lp, Kp = N + 1, next_pow2(N + 1), next_pow2(L), next_pow2(K)
    logp = top_logp_LK.astype(jnp.float32)
    masked = (n1, L, K) != (n1p, Lp, Kp) and not interpret
    if interpret:  # the interpreter cannot slice past an array's end: pad; outputs are n1p wide, sliced below
        logp = jnp.pad(logp, ((0, Lp - L), (0, Kp - K)), constant_values=-jnp.inf)
    w = n1p if interpret else n1
    outs = pl.pallas_call(
        functools.partial(_frontier_kernel, N=N, L=L, K=K, Lp=Lp, Kp=Kp, n1p=n1p, masked=masked),
        out_shape=[jax.ShapeDtypeStruct((w,), jnp.int32)] * 3 + [jax.ShapeDtypeStruct((w,), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1), interpret=interpret,
        name="ddtree_frontier",
    )(logp)
    return tuple(o[:n1] for o in outs)


def frontier(top_logp_LK, budget: int, impl: str = "xla"):
    """Dispatch: impl "xla" (reference), "pallas" (GPU kernel) or "interpret"."""
    if impl == "xla":
        return frontier_ref(top_logp_LK, budget)
    if impl in ("pallas", "interpret"):
        return frontier_pallas(top_logp_LK, budget, interpret=impl == "interpret")
    raise ValueError(f"unknown frontier impl {impl!r}")
