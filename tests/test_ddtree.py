"""kimijax.spec.ddtree: device tree build == a best-first heap reference (same nodes, same order)."""

import functools
import heapq
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kimijax.spec import ddtree


def build_tree_reference(logp_LV, budget, topk_cap=None):
    """Plain-Python heapq statement of the DDTree build.

    Heap entries are (-score, ranks, parent): the best score pops first, equal scores pop in lexicographic
    order of the per-depth rank tuple (a tuple before its extensions), as in the reference implementation.
    Scores are float32 sums along the path in depth order; per-depth ranks come from a stable descending
    sort (equal log-probs -> lower token id first). Returns (tokens, parents, depths) lists including the root.
    """
    logp_LV = np.asarray(logp_LV, np.float32)
    L, V = logp_LV.shape
    K = min(budget, V) if topk_cap is None else min(budget, V, topk_cap)
    order_LK = np.argsort(-logp_LV, axis=1, kind="stable")[:, :K]
    lp_LK = np.take_along_axis(logp_LV, order_LK, axis=1)
    tokens, parents, depths, scores = [-1], [-1], [0], [np.float32(0.0)]
    heap = [(-(scores[0] + lp_LK[0, 0]), (0,), 0)]
    while heap and len(tokens) <= budget:
        neg_score, ranks, parent = heapq.heappop(heap)
        depth, rank, me = len(ranks), ranks[-1], len(tokens)
        tokens.append(int(order_LK[depth - 1, rank]))
        parents.append(parent)
        depths.append(depth)
        scores.append(np.float32(-neg_score))
        if rank + 1 < K:  # next sibling under the same parent
            heapq.heappush(heap, (-(scores[parent] + lp_LK[depth - 1, rank + 1]), ranks[:-1] + (rank + 1,), parent))
        if depth < L:  # first child
            heapq.heappush(heap, (-(scores[me] + lp_LK[depth, 0]), ranks + (0,), me))
    return tokens, parents, depths


@functools.lru_cache(maxsize=None)
def _batched_builder(budget, topk_cap):
    return jax.jit(lambda lg: ddtree.build_tree_batched(lg, budget, topk_cap))


def check_structure(tree, budget):
    """Invariants every tree must satisfy (numpy tree for one request)."""
    n1 = budget + 1
    tokens, parents, depths, valid = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths, tree.valid))
    anc = np.asarray(tree.ancestor_mask)
    assert tokens.shape == (n1,) and anc.shape == (n1, n1)
    assert valid[0] and parents[0] == -1 and depths[0] == 0 and tokens[0] == -1
    n_valid = int(valid.sum())
    assert valid[:n_valid].all() and not valid[n_valid:].any(), "valid nodes must be a contiguous prefix"
    for i in range(n1):
        if not valid[i]:
            assert anc[i].tolist() == [j == i for j in range(n1)] and parents[i] == -1 and tokens[i] == -1
            continue
        if i == 0:
            assert anc[0].tolist() == [j == 0 for j in range(n1)]
            continue
        p = parents[i]
        assert 0 <= p < i, "parents precede children"
        assert depths[i] == depths[p] + 1 and 1 <= depths[i] <= tree.max_depth
        want = anc[p].copy()
        want[i] = True
        np.testing.assert_array_equal(anc[i], want)
    # Sibling tokens are distinct (so at most one child can match a choice); scores non-increasing.
    for p in range(n_valid):
        kids = [i for i in range(1, n_valid) if parents[i] == p]
        assert len({int(tokens[i]) for i in kids}) == len(kids)
        fc = int(tree.first_child[p])
        assert fc == (kids[0] if kids else -1)
        for a, b in zip(kids, kids[1:] + [-1]):
            assert int(tree.next_sibling[a]) == b
    sc = np.asarray(tree.scores)[1:n_valid]
    assert np.all(sc[1:] <= sc[:-1])


def assert_matches_reference(tree, logp_LV, budget, topk_cap):
    tokens, parents, depths = build_tree_reference(logp_LV, budget, topk_cap)
    n = len(tokens)
    assert int(np.asarray(tree.valid).sum()) == n
    np.testing.assert_array_equal(np.asarray(tree.tokens)[:n], tokens)
    np.testing.assert_array_equal(np.asarray(tree.parents)[:n], parents)
    np.testing.assert_array_equal(np.asarray(tree.depths)[:n], depths)


# Shapes (L, V, budget, topk_cap) spanning L 1..7, V 2..50, budgets 1..128, with and without a cap. A fixed
# list so each compiles once (XLA CPU compiles cost ~1 s each); hypothesis varies the logits. The first three
# are also the hand examples below.
CONFIGS = [(2, 3, 5, None), (2, 2, 7, None), (4, 9, 4, 1), (1, 2, 1, None), (3, 5, 17, 2), (5, 11, 40, None),
           (7, 50, 128, None), (7, 5, 128, 4), (6, 50, 6, None)]
B = 6  # trees per device call


def build_batch(logits_LV_or_BLV, budget, topk_cap):
    lg = np.asarray(logits_LV_or_BLV, np.float32)
    if lg.ndim == 2:  # a single hand example rides in a batch of the shared shape
        lg = np.broadcast_to(lg, (B, *lg.shape))
    return jax.tree.map(np.asarray, _batched_builder(budget, topk_cap)(jnp.asarray(lg)))


@settings(max_examples=18, deadline=None, derandomize=True)
@given(config=st.sampled_from(CONFIGS), kind=st.sampled_from(["ties", "float", "masked"]),
       seed=st.integers(0, 2**31 - 1))
def test_device_tree_matches_heap_reference(config, kind, seed):
    L, V, budget, topk_cap = config
    rng = np.random.default_rng(seed)
    if kind == "ties":  # a tiny integer alphabet -> many exactly equal log-probs and path scores
        logits = rng.integers(-1, 2, size=(B, L, V)).astype(np.float32)
    elif kind == "float":
        logits = (rng.normal(size=(B, L, V)) * 3).astype(np.float32)
    else:  # some vocab entries with zero draft mass (-inf log-probs), ties among them
        logits = rng.integers(-1, 2, size=(B, L, V)).astype(np.float32)
        logits[rng.random(size=(B, L, V)) < 0.4] = -np.inf
        logits[:, :, 0] = 0.0
    logits[0] = 0.0  # one fully uniform request: every score ties at each depth
    tree_b = build_batch(logits, budget, topk_cap)
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    for b in range(B):
        tree = jax.tree.map(lambda x: x[b], tree_b)
        assert tree.max_depth == L
        assert_matches_reference(tree, logp[b], budget, topk_cap)
        check_structure(tree, budget)
        # A smaller budget's tree is a prefix of this one (pop order is a global sort).
        small = int(rng.integers(1, budget + 1))
        tok, par, dep = build_tree_reference(logp[b], small, topk_cap)
        np.testing.assert_array_equal(tree.tokens[:len(tok)], tok)
        np.testing.assert_array_equal(tree.parents[:len(par)], par)


def test_hand_example():
    # Depth-1 probs over tokens (0, 1, 2) = (.3, .1, .6); depth 2 = (.2, .7, .1). Prefix probabilities:
    # (2)=.6, (2,1)=.42, (0)=.3, (0,1)=.21, (2,0)=.12, (1)=.1, ... -> the best five, in that order.
    logits = np.log(np.array([[0.3, 0.1, 0.6], [0.2, 0.7, 0.1]], np.float32))
    tree = jax.tree.map(lambda x: x[0], build_batch(logits, 5, None))
    assert tree.max_depth == 2
    np.testing.assert_array_equal(tree.tokens, [-1, 2, 1, 0, 1, 0])
    np.testing.assert_array_equal(tree.parents, [-1, 0, 1, 0, 3, 1])
    np.testing.assert_array_equal(tree.depths, [0, 1, 2, 1, 2, 2])
    np.testing.assert_array_equal(tree.ranks, [-1, 0, 0, 1, 0, 1])
    np.testing.assert_allclose(np.exp(tree.scores), [1.0, 0.6, 0.42, 0.3, 0.21, 0.12], rtol=1e-5)
    anc = [[0], [0, 1], [0, 1, 2], [0, 3], [0, 3, 4], [0, 1, 5]]
    want = np.zeros((6, 6), bool)
    for i, row in enumerate(anc):
        want[i, row] = True
    np.testing.assert_array_equal(tree.ancestor_mask, want)
    np.testing.assert_array_equal(tree.first_child, [1, 2, -1, 4, -1, -1])
    np.testing.assert_array_equal(tree.next_sibling, [-1, 3, 5, -1, -1, -1])


def test_hand_example_exact_ties_and_short_tree():
    # Uniform V=2, L=2: every depth-1 prefix scores log(1/2), every depth-2 one log(1/4). Ties pop in
    # lexicographic rank order: (0), (1), (0,0), (0,1), (1,0), (1,1). Only 6 prefixes exist: node 7 is invalid.
    tree = jax.tree.map(lambda x: x[0], build_batch(np.zeros((2, 2)), 7, None))
    np.testing.assert_array_equal(tree.tokens, [-1, 0, 1, 0, 1, 0, 1, -1])
    np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 1, 1, 2, 2, -1])
    np.testing.assert_array_equal(tree.depths, [0, 1, 1, 2, 2, 2, 2, 0])
    np.testing.assert_array_equal(tree.valid, [True] * 7 + [False])
    assert build_tree_reference(np.log(np.full((2, 2), 0.5, np.float32)), 7)[1] == [-1, 0, 0, 1, 1, 2, 2]
    check_structure(tree, 7)


def test_cap_one_is_the_chain():
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(B, 4, 9)) * 2).astype(np.float32)
    capped = build_batch(logits, 4, 1)
    chain = jax.tree.map(np.asarray, jax.jit(jax.vmap(ddtree.chain_tree))(jnp.asarray(logits)))
    for f in ("tokens", "parents", "depths", "valid", "ancestor_mask", "first_child", "next_sibling", "ranks"):
        np.testing.assert_array_equal(getattr(capped, f), getattr(chain, f), err_msg=f)
    np.testing.assert_allclose(capped.scores, chain.scores, rtol=1e-6)
    assert chain.max_depth == 4
    np.testing.assert_array_equal(chain.tokens[:, 1:], np.argmax(logits, -1))
    np.testing.assert_array_equal(chain.parents[0], np.arange(5) - 1)
    np.testing.assert_array_equal(chain.depths[1], np.arange(5))
    np.testing.assert_array_equal(chain.ancestor_mask[2], np.tril(np.ones((5, 5), bool)))
    check_structure(jax.tree.map(lambda x: x[0], chain), 4)




def test_chunked_top_k_equals_lax_top_k():
    # random rows with ties across and inside slices, -inf entries and a length no slice width divides: the
    # two-stage top-k must give lax.top_k's values and ids, equal values in ascending id order
    from kimijax.spec.ddtree import chunked_top_k
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    x = rng.normal(size=(2, 3, 1001)).astype(np.float32)
    x[0, 0, ::37] = 5.0
    x[1, 2, 990:] = 7.0
    x[0, 1, :500] = -np.inf
    x = jnp.asarray(x)
    for k in (1, 8, 16):
        want = jax.lax.top_k(x, k)
        for chunk in (0, 7, 64, 100, 512, 2000):
            got = chunked_top_k(x, k, chunk)
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]), err_msg=f"k={k} chunk={chunk}")
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]), err_msg=f"k={k} chunk={chunk}")


@pytest.mark.parametrize("L,budget", [(15, 4), (15, 8), (7, 7), (5, 9)])
def test_tree_from_first_budget_depths_is_the_same(L, budget):
    # SpecRound drafts only min(L, budget) depths: a budget-N tree never goes deeper than N, so the tree built
    # from those rows must equal the one built from all L (ties included), max_depth aside.
    rng = np.random.default_rng(L * 100 + budget)
    V = 11
    logits = rng.integers(-1, 2, size=(B, L, V)).astype(np.float32)
    logits[: B // 2] = (rng.normal(size=(B // 2, L, V)) * 3).astype(np.float32)
    full = build_batch(logits, budget, None)
    n = min(L, budget)
    short = build_batch(logits[:, :n], budget, None)
    for f in ("tokens", "parents", "depths", "ranks", "scores", "valid", "ancestor_mask", "first_child",
              "next_sibling"):
        np.testing.assert_array_equal(getattr(short, f), getattr(full, f), err_msg=f)
