"""DDTree: device-side draft-tree construction from per-depth DFlash logits.

The tree is the `budget` highest-scoring prefixes, where a prefix (x_1..x_d) scores sum_d log q_d(x_d) under
the drafter's per-depth marginals q_d (T=1 log-softmax of the raw draft logits, independent of the request's
sampling temperature), restricted to the per-depth top-K tokens. Nodes come out in the pop order of the
reference best-first heap (liranringel/ddtree `build_ddtree_tree`):

  seed: (rank 0 at depth 1, parent = root)
  pop the best candidate -> emit it as the next node;
  push its next sibling (same parent, rank + 1 at the same depth) if rank + 1 < K;
  push its first child (rank 0 at depth + 1) if depth < L.

Tie-break (matches the reference heap, whose entries are tuples (-score, ranks, ...)): higher score first; on
equal score, the lexicographically smaller per-depth rank tuple (r_1, ..., r_d) first, where a tuple sorts
before its own extensions (so a parent precedes its child, rank 0 precedes rank 1). The ranks tuple uniquely
identifies a prefix, so the order is total. Because every push has a score <= its generator and a larger
ranks tuple, pop order is the global sort of all prefixes by that key, and the budget-b tree is a prefix of
the budget-b' tree for b < b' (given the same K cap). Scores are accumulated as f32 sums along the path in
depth order (score(child) = score(parent) + logp), never by subtract-and-add, so equal paths tie exactly.

Device formulation: a parent has at most one candidate child in the heap at any time (its children are
pushed as a sibling chain), so the frontier is one slot per emitted node (root included): slot j holds node
j's next candidate child (rank, score, rank path), kept up to date in the loop state. Each of the N steps of
a `lax.fori_loop` pops the best slot with one variadic reduce over the state's columns (max score, then
lexicographic rank path), emits the node and writes the two changed slots (the popped one's next sibling,
the new node's first child) in one select: two kernel launches per step on the GPU. Work O(N (N + L)) per
request; no scatters in the loop body, so it vmaps cleanly and compiles fast. NaN draft logits are not
supported (they break the total order). The pops live in pallas_kernels/ddtree_frontier.py: this XLA loop
(`frontier_ref`) and the same pops as one kernel per request (opt-in: `kimijax.RoundKernels(tree=...)`).

Tree layout (N+1 slots, root = the bonus token at index 0, drafted nodes 1..N in pop order, so parents
always precede children and siblings appear in rank order):
  tokens         int32 [N+1]   root = -1 (the caller fills in the bonus token); invalid nodes -1
  parents        int32 [N+1]   root -1; invalid -1
  depths         int32 [N+1]   root 0; invalid 0; the verify position of node i is S + depths[i]
  ranks          int32 [N+1]   rank of the node's token in its depth's top-K; root/invalid -1
  scores         f32   [N+1]   path log-prob under the draft marginals; root 0; invalid -inf
  valid          bool  [N+1]   root True; nodes past the number of existing prefixes (tiny V*L) False
  ancestor_mask  bool  [N+1, N+1]  row i = ancestors of i and i itself; invalid rows see only themselves
  first_child    int32 [N+1]   lowest-index (= rank-0-most) child, -1 if none    (left-child/right-sibling
  next_sibling   int32 [N+1]   next child of the same parent, -1 if none          form for EAGLE-style kernels)
  max_depth      static int    L, the number of drafted depths (pytree metadata, not an array; SpecRound drafts
                               min(budget, block_size - 1): a budget-N tree is at most N deep)
Valid nodes are always a contiguous prefix 0..n_valid-1. The acceptance walk (spec/accept.py) matches a
choice against children by scanning `parents` (O(N) per step); first_child/next_sibling are for consumers
that want the linked form.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import ddtree_frontier

__all__ = ["Tree", "build_tree", "build_tree_batched", "build_tree_from_topk", "chain_tree", "topk_logprobs", "tree_width"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "parents", "depths", "ranks", "scores", "valid", "ancestor_mask", "first_child",
                 "next_sibling"],
    meta_fields=["max_depth"])
@dataclasses.dataclass(frozen=True)
class Tree:
    """A draft tree (pytree; vmap adds a leading axis to every array field). See the module docstring."""

    tokens: jax.Array  # int32 [N+1]
    parents: jax.Array  # int32 [N+1]
    depths: jax.Array  # int32 [N+1]
    ranks: jax.Array  # int32 [N+1]
    scores: jax.Array  # f32 [N+1]
    valid: jax.Array  # bool [N+1]
    ancestor_mask: jax.Array  # bool [N+1, N+1]
    first_child: jax.Array  # int32 [N+1]
    next_sibling: jax.Array  # int32 [N+1]
    max_depth: int  # static L, the drafted depths (block_size - 1, or the budget if smaller): bounds the
    #                 acceptance walk and the emitted-token width

    def replace(self, **kw) -> "Tree":
        return dataclasses.replace(self, **kw)


def tree_width(budget: int, vocab: int, topk_cap: int | None = None) -> int:
    """Per-depth candidate count K = min(budget, V, topk_cap). More than `budget` ranks can never be used."""
    if int(budget) < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    k = min(int(budget), int(vocab))
    if topk_cap is not None:
        if topk_cap < 1:
            raise ValueError(f"topk_cap must be >= 1, got {topk_cap}")
        k = min(k, int(topk_cap))
    return k


def _links(parents_N1, valid_N1):
    """first_child / next_sibling from the parent array (children sorted by index = pop = rank order)."""
    n1 = parents_N1.shape[0]
    idx_N1 = jnp.arange(n1, dtype=jnp.int32)
    big = jnp.int32(n1)
    # is_child_PC[p, c]: c is a valid child of p.
    is_child_PC = (parents_N1[None, :] == idx_N1[:, None]) & valid_N1[None, :]
    first = jnp.min(jnp.where(is_child_PC, idx_N1[None, :], big), axis=1)
    # Later sibling: same parent, higher index.
    same_parent_IJ = (parents_N1[:, None] == parents_N1[None, :]) & (parents_N1[:, None] >= 0)
    later_IJ = same_parent_IJ & valid_N1[None, :] & (idx_N1[None, :] > idx_N1[:, None])
    nxt = jnp.min(jnp.where(later_IJ, idx_N1[None, :], big), axis=1)
    to_link = lambda x: jnp.where(x == big, -1, x).astype(jnp.int32)
    return to_link(first), jnp.where(valid_N1, to_link(nxt), -1)


def build_tree_from_topk(top_logp_LK, top_tokens_LK, budget: int, frontier_impl: str = "xla") -> Tree:
    """Best-first tree from per-depth top-K (log-probs sorted descending, with their token ids).

    Split out of `build_tree` so a tensor-parallel caller can merge per-shard top-K instead of gathering
    full-vocab logits.
    """
    L, K = top_logp_LK.shape
    N = int(budget)
    if N < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    n1 = N + 1
    top_logp_LK = top_logp_LK.astype(jnp.float32)
    top_tokens_LK = top_tokens_LK.astype(jnp.int32)
    idx_N1 = jnp.arange(n1, dtype=jnp.int32)
    with jax.named_scope("ddtree_frontier"):  # the N pops (pallas_kernels/ddtree_frontier.py: XLA or one kernel)
        parents, depths, ranks, scores = ddtree_frontier.frontier(top_logp_LK, N, frontier_impl)

    with jax.named_scope("ddtree_layout"):
        valid = (idx_N1 == 0) | (parents >= 0)
        tokens = jnp.where(valid & (idx_N1 > 0),
                           top_tokens_LK[jnp.clip(depths - 1, 0, L - 1), jnp.clip(ranks, 0, K - 1)], -1)
        # Ancestor-or-self mask by chasing parent pointers (depth <= L, so L hops reach the root).
        anc = jnp.eye(n1, dtype=bool)
        cur = idx_N1
        for _ in range(L):
            cur = jnp.where(cur >= 0, parents[jnp.clip(cur, 0, None)], -1)
            anc |= (cur[:, None] == idx_N1[None, :])
        first_child, next_sibling = _links(parents, valid)
    return Tree(tokens=tokens, parents=parents, depths=depths, ranks=ranks, scores=scores, valid=valid,
                ancestor_mask=anc, first_child=first_child, next_sibling=next_sibling, max_depth=L)


def build_tree(draft_logits_LV, budget: int, topk_cap: int | None = None) -> Tree:
    """DDTree for one request from the drafter's logits for depths 1..L. `budget` (= N) and `topk_cap` static."""
    K = tree_width(budget, draft_logits_LV.shape[-1], topk_cap)
    with jax.named_scope("ddtree_topk"):
        top_logp_LK, top_tokens_LK = topk_logprobs(draft_logits_LV, K)
    return build_tree_from_topk(top_logp_LK, top_tokens_LK, budget)


# `chunked_top_k` on the GPU for at most TOPK_CHUNK_MAX_ROWS rows (B x depths), in slices of TOPK_CHUNK: XLA sorts
# each whole row for lax.top_k, and many short rows sort faster while there are few rows. H200 kernel time
# (scripts/bench_topk.py, BENCHMARKS.md "Tree top-K"): Kimi 1x7x163840 K=8 158 -> 76 us, K=16 327 -> 122 us;
# SmolLM2 1x15x49152 K=16 160 -> 86 us; but 8x7x163840 K=8 197 -> 412 us (too many rows), hence the row cap.
TOPK_CHUNK = 512
TOPK_CHUNK_MAX_ROWS = 16


def default_topk_chunk(rows: int) -> int:
    """Slice width `chunked_top_k` uses for `rows` rows by default (0: one lax.top_k per row)."""
    return TOPK_CHUNK if jax.default_backend() == "gpu" and rows <= TOPK_CHUNK_MAX_ROWS else 0


def chunked_top_k(x, k: int, chunk: int | None = None):
    """lax.top_k over the last axis of a float array in two stages: the top-k of each `chunk`-wide slice, then the
    top-k of those candidates.  Same values and indices as lax.top_k: the global top-k lies in the union of the
    slices' top-k, and equal values keep ascending index order (slices are contiguous and taken in order;
    padding is -inf at the end, after every real index).  chunk None: `default_topk_chunk` of the rows this call
    sees (under vmap, one mapped call's rows: the Engine calls it on the whole [B, L, V]); 0: lax.top_k."""
    if chunk is None:
        chunk = default_topk_chunk(math.prod(x.shape[:-1]))
    n = x.shape[-1]
    if not chunk or n <= chunk or k > chunk:
        return jax.lax.top_k(x, k)
    c = -(-n // chunk)
    if c * chunk > n:
        x = jnp.concatenate([x, jnp.full(x.shape[:-1] + (c * chunk - n,), -jnp.inf, x.dtype)], axis=-1)
    v, i = jax.lax.top_k(x.reshape(x.shape[:-1] + (c, chunk)), k)  # [..., c, k]
    i = i + jnp.arange(c, dtype=i.dtype)[:, None] * chunk
    v, pos = jax.lax.top_k(v.reshape(x.shape[:-1] + (c * k,)), k)
    return v, jnp.take_along_axis(i.reshape(x.shape[:-1] + (c * k,)), pos, axis=-1)


def topk_logprobs(draft_logits_V, K: int, chunk: int | None = None):
    """Per-depth top-K of the T=1 log-softmax of raw draft logits [..., V] (tree scores ignore the request
    temperature). Equal values come in ascending index order (as lax.top_k), the per-depth rank tie-break."""
    return chunked_top_k(jax.nn.log_softmax(draft_logits_V.astype(jnp.float32), axis=-1), K, chunk)


def build_tree_batched(draft_logits_BLV, budget: int, topk_cap: int | None = None) -> Tree:
    """`build_tree` vmapped over requests: every Tree field gains a leading B axis."""
    return jax.vmap(functools.partial(build_tree, budget=budget, topk_cap=topk_cap))(draft_logits_BLV)


def chain_tree(draft_logits_LV) -> Tree:
    """The DFlash chain (argmax at every depth, N = L, node i at depth i) in the Tree format."""
    L, V = draft_logits_LV.shape
    n1 = L + 1
    with jax.named_scope("chain_tree"):
        logp_LV = jax.nn.log_softmax(draft_logits_LV.astype(jnp.float32), axis=-1)
        tok_L = jnp.argmax(logp_LV, axis=-1).astype(jnp.int32)
        lp_L = jnp.max(logp_LV, axis=-1)
        idx_N1 = jnp.arange(n1, dtype=jnp.int32)
        # Sequential f32 sum in depth order, same rule as build_tree's scores.
        _, cum_L = jax.lax.scan(lambda c, x: (c + x, c + x), jnp.float32(0.0), lp_L)
        scores = jnp.concatenate([jnp.zeros((1,), jnp.float32), cum_L])
        parents = idx_N1 - 1
        return Tree(
            tokens=jnp.concatenate([jnp.full((1,), -1, jnp.int32), tok_L]),
            parents=parents,
            depths=idx_N1,
            ranks=jnp.where(idx_N1 == 0, -1, 0).astype(jnp.int32),
            scores=scores,
            valid=jnp.ones((n1,), bool),
            ancestor_mask=idx_N1[None, :] <= idx_N1[:, None],
            first_child=jnp.where(idx_N1 < L, idx_N1 + 1, -1).astype(jnp.int32),
            next_sibling=jnp.full((n1,), -1, jnp.int32),
            max_depth=L,
        )
