"""Acceptance for a verified draft tree: per-node target choices, the walk, and the emitted tokens.

Lossless rule (DDTree reference): the target makes ONE choice per tree node from its own distribution at that
node's prefix (argmax, or an independent sample under the request's temperature/top-k/top-p with a key per
node). Walking from the root while the choice equals a child's token, every emitted token is then a fresh
target sample given the committed prefix; the tree only decides how many of them were pre-computed. No draft
probabilities are needed, and siblings need no special handling (they carry distinct tokens).

All functions handle one request with static shapes; vmap over the batch (or use `node_choices_batched`).
Row i of the verify logits is the target's distribution for the token AFTER node i's prefix.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kimijax.sampling import sample_tokens
from kimijax.spec.ddtree import Tree

__all__ = ["node_choices", "node_choices_batched", "walk", "emitted_tokens", "Emitted"]


def _split_per_node(key, n: int):
    return jax.random.split(key, n)


def node_choices(key, target_logits_NV, temperature, top_k, top_p):
    """One target choice per node -> int32 [N+1]. Scalar (per-request) sampling params; temperature <= 0 = argmax.

    Node i uses key `jax.random.split(key, N+1)[i]`, so a node's sample depends only on its own key and logits.
    """
    with jax.named_scope("node_choices"):
        n1 = target_logits_NV.shape[0]
        keys_N = _split_per_node(key, n1)
        bc = lambda x: jnp.broadcast_to(jnp.asarray(x), (n1,))
        return sample_tokens(keys_N, target_logits_NV, bc(temperature), bc(top_k), bc(top_p))


def node_choices_batched(keys_B, target_logits_BNV, temperature_B, top_k_B, top_p_B):
    """`node_choices` over a batch of requests (same results row by row) -> int32 [B, N+1].

    Prefer this to vmap(node_choices): the sampler skips its vocab sort when no row uses top-k/top-p, and that
    branch only survives outside vmap.
    """
    with jax.named_scope("node_choices"):
        B, n1 = target_logits_BNV.shape[:2]
        keys_BN = jax.vmap(lambda k: _split_per_node(k, n1))(keys_B)
        per_node = lambda x: jnp.broadcast_to(jnp.asarray(x)[:, None], (B, n1))
        return sample_tokens(keys_BN, target_logits_BNV, per_node(temperature_B), per_node(top_k_B),
                             per_node(top_p_B))


def walk(tree: Tree, choices_N, max_depth: int | None = None):
    """Follow the target's choices down the tree.

    Returns (path [L+1] int32 node indices, root first, padded with -1; n_accepted int32 = number of path nodes
    including the root = tau = accepted draft tokens + 1; bonus int32 = choice at the last path node).

    Computed without a sequential walk (a walk of L dependent steps costs ~2 kernel launches per depth on the
    GPU): an edge parent -> child is taken iff the child's token is the parent's choice, and a node is on the
    path iff every edge from the root to it is taken, i.e. iff all of its ancestors (tree.ancestor_mask) are
    taken or the root. Children carry distinct tokens, so at most one child per node is taken and the nodes
    on the path form one chain, one node per depth.
    """
    L = tree.max_depth if max_depth is None else int(max_depth)
    with jax.named_scope("accept_walk"):
        n1 = tree.tokens.shape[0]
        choices_N = choices_N.astype(jnp.int32)
        idx_N = jnp.arange(n1)
        is_node = tree.valid & (idx_N > 0)
        taken_N = is_node & (tree.tokens == choices_N[jnp.clip(tree.parents, 0, n1 - 1)])
        ok_N = taken_N | (idx_N == 0)
        on_N = (is_node & jnp.all(ok_N[None, :] | ~tree.ancestor_mask, axis=1)) | (idx_N == 0)
        # depth d of the chain -> its node (depths beyond the walk's L are never on a path of a valid tree)
        at_DN = on_N[None, :] & (tree.depths[None, :] == jnp.arange(L + 1)[:, None])
        path = jnp.where(jnp.any(at_DN, axis=1), jnp.argmax(at_DN, axis=1), -1).astype(jnp.int32)
        n = jnp.sum(on_N & ((tree.depths <= L) | (idx_N == 0))).astype(jnp.int32)
        last = path[jnp.clip(n - 1, 0, L)]
        return path, n, choices_N[last]


class Emitted(NamedTuple):
    tokens: jax.Array  # int32 [L+1]: tree tokens at path[1:n] then the bonus; padded with -1 after `count`
    count: jax.Array  # int32: tokens to emit/commit this round (after stop / max_emit truncation)
    stopped: jax.Array  # bool: a stop token is among the first `count` tokens (it is the last one kept)


def emitted_tokens(tree: Tree, path, n_accepted, bonus, stop_ids=None, max_emit=None) -> Emitted:
    """Tokens emitted this round: tree tokens at path[1:n] followed by the bonus (n tokens; the root's token was
    emitted last round).

    `stop_ids` int32 [S] (entries < 0 are padding): truncate after the first stop token and report stopped.
    `max_emit` (int32, e.g. the request's remaining token budget): cap the count first; stop tokens past the
    cap are not seen. Without truncation the engine commits the n path nodes to the cache and `bonus` becomes
    the next round's root; with truncation the request is finished.
    """
    with jax.named_scope("emitted_tokens"):
        P = path.shape[0]  # L + 1
        j_P = jnp.arange(P, dtype=jnp.int32)
        nxt_P = jnp.concatenate([path[1:], jnp.full((1,), -1, jnp.int32)])
        tree_tok_P = tree.tokens[jnp.clip(nxt_P, 0, None)]
        n = n_accepted.astype(jnp.int32)
        toks_P = jnp.where(j_P < n - 1, tree_tok_P, jnp.where(j_P == n - 1, bonus.astype(jnp.int32), -1))
        limit = n if max_emit is None else jnp.clip(jnp.asarray(max_emit, jnp.int32), 0, n)
        if stop_ids is None:
            is_stop_P = jnp.zeros((P,), bool)
        else:
            stop_S = jnp.asarray(stop_ids, jnp.int32).reshape(-1)
            is_stop_P = jnp.any((toks_P[:, None] == stop_S[None, :]) & (stop_S[None, :] >= 0), axis=1)
        is_stop_P &= j_P < limit
        stopped = jnp.any(is_stop_P)
        count = jnp.where(stopped, jnp.argmax(is_stop_P).astype(jnp.int32) + 1, limit)
        toks_P = jnp.where(j_P < count, toks_P, -1)
        return Emitted(tokens=toks_P, count=count, stopped=stopped)
