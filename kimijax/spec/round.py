"""One speculative round (DFlash chain or DDTree), traced into the engine's device loop.

  1 draft    drafter block [bonus, MASK x (bs-1)] at positions S..S+bs-1 over its context cache
  2 tree     DDTree: the `budget` best prefixes of the per-depth top-K (or the argmax chain for DFlash)
  3 verify   one target pass over [bonus] + nodes at positions S + depth with the ancestor mask
  4 accept   one target choice per node (argmax or an independent sample); walk while it is a child
  5 commit   compact the accepted rows of the target cache to S..S+A-1; append the drafter context
             K/V computed from the target hidden states at the accepted node indices
Static shapes throughout: N+1 verify slots, D+1 emitted slots, where D = min(N, L) drafted depths (L =
block_size - 1): a budget-N tree is at most N deep, so the rows past depth N are never drafted, walked or committed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimijax.spec import accept, ddtree
from kimijax.spec.kernels import RoundKernels
from kimijax.target import compact_caches


class SpecRound:
    def __init__(self, target, drafter, method: str, budget: int, topk_cap: int | None, draft_window: int | None,
                 kernels: RoundKernels = RoundKernels()):
        self.target, self.drafter, self.method = target, drafter, method
        self.kernels = kernels
        self.block = drafter.cfg.block_size
        self.depth = self.block - 1  # L: drafted depths
        self.nodes = budget if method == "ddtree" else self.depth
        # Drafted depths the tree can use: a budget-N tree has depth <= N, so b4 at block 16 needs 4 of the
        # 15 rows of draft logits (lm_head and vocabulary top-K over a quarter of the rows), and commits at
        # most 5 rows (cache compaction and drafter context K/V over 5 rows, not 16).
        self.draft_depths = min(self.depth, self.nodes)
        self.topk_cap, self.window = topk_cap, draft_window
        self.capture_layers = tuple(drafter.cfg.target_layer_ids)
        self.moe_layers = [i for i in range(target.num_layers)
                           if getattr(target.cfg, "is_moe_layer", lambda i: False)(i)]

    @property
    def width(self) -> int:  # verify slots: root + nodes
        return self.nodes + 1

    @property
    def max_commit(self) -> int:  # accepted draft tokens + the new bonus
        return self.draft_depths + 1

    def drafter_cache_len(self, L: int) -> int:
        """Drafter context slots: the whole context, or with a draft window W a ring of W + one round's rows."""
        return L if self.window is None else min(L, self.window + self.max_commit)

    def init_state(self, dparams, cap_nBTD, lens_B, L: int):
        B, T = cap_nBTD.shape[1:3]
        Lc = self.drafter_cache_len(L)
        dcache = self.drafter.init_cache(B, Lc)
        if T <= Lc:
            pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
            rows = self.drafter.context_kv(dparams, cap_nBTD, pos_BT)
            dcache = self.drafter.append_context(dcache, rows, jnp.zeros((B,), jnp.int32))
        else:  # a prompt longer than the ring: slot j gets the last prompt position p < len with p = j mod Lc
            j_L = jnp.arange(Lc, dtype=jnp.int32)
            last_B1 = lens_B.astype(jnp.int32)[:, None] - 1
            pos_BL = last_B1 - jnp.remainder(last_B1 - j_L[None], Lc)  # < 0: never read (before position 0)
            pos_BL = jnp.clip(pos_BL, 0, T - 1)
            feats = jnp.take_along_axis(cap_nBTD, pos_BL[None, :, :, None], axis=2)
            rows = self.drafter.context_kv(dparams, feats, pos_BL)
            dcache = [r.astype(c.dtype) for c, r in zip(dcache, rows)]  # already in slot order
        extra = {"dcache": dcache}
        if self.moe_layers:
            extra["experts"] = jnp.zeros((B, len(self.moe_layers)), jnp.float32)
        return extra

    def build_tree(self, draft_logits_BLV):
        if self.method == "ddtree":
            # the target's per-depth top-K (on a mesh: per-shard top-K merged, never a [B, L, V] gather)
            tree_topk = getattr(self.target, "tree_topk", ddtree.topk_logprobs)
            K = ddtree.tree_width(self.nodes, draft_logits_BLV.shape[-1], self.topk_cap)
            with jax.named_scope("ddtree_topk"):
                top_logp_BLK, top_tokens_BLK = tree_topk(draft_logits_BLV, K)
            # From draft_depths rows the tree is the same as from all L (tested); its max_depth (draft_depths)
            # sets the walk's steps and the emitted width max_commit.
            build = lambda lp, tk: ddtree.build_tree_from_topk(lp, tk, self.nodes, frontier_impl=self.kernels.tree)
            return jax.vmap(build)(top_logp_BLK, top_tokens_BLK)
        return jax.vmap(ddtree.chain_tree)(draft_logits_BLV)

    def draft(self, dparams, params, dcache, S_B, bonus_B):
        """Draft logits [B, draft_depths, V] for this round's tree."""
        return self.drafter.draft_logits(dparams, self.target, params, dcache, S_B, bonus_B, self.window,
                                         depths=self.draft_depths)

    def __call__(self, params, dparams, st):
        from kimijax.engine import commit_tokens, row_keys

        tgt, dr = self.target, self.drafter
        S_B, bonus_B = st["lengths"], st["bonus"]
        B = S_B.shape[0]
        with jax.named_scope("draft"):
            dl_BLV = self.draft(dparams, params, st["dcache"], S_B, bonus_B)
        with jax.named_scope("tree"):
            tree = self.build_tree(dl_BLV)
            tokens_BN = jnp.where(jnp.arange(self.width)[None] == 0, bonus_B[:, None], jnp.maximum(tree.tokens, 0))
            pos_BN = S_B[:, None] + tree.depths
        with jax.named_scope("verify"):
            want_experts = bool(self.moe_layers)
            out = tgt.verify(params, st["caches"], tokens_BN, pos_BN, S_B, tree.ancestor_mask, self.capture_layers,
                             **({"with_experts": True} if want_experts else {}))
            logits_BNV, caches, cap_nBND = out[:3]
        with jax.named_scope("accept"):
            choices_BN = accept.node_choices_batched(row_keys(st), logits_BNV, st["temperature"], st["top_k"],
                                                     st["top_p"])
            path_BP, n_B, new_bonus_B = jax.vmap(accept.walk)(tree, choices_BN)
            new_BP = jax.vmap(accept.emitted_tokens)(tree.replace(tokens=tokens_BN), path_BP, n_B, new_bonus_B).tokens
            path_BP = jnp.maximum(path_BP, 0)
            j_P = jnp.arange(path_BP.shape[1])
        with jax.named_scope("commit"):
            live_B = ~st["done"]
            caches = compact_caches(caches, S_B, path_BP, n_B, self.kernels.commit)
            feats = jnp.take_along_axis(cap_nBND, path_BP[None, :, :, None], axis=2)
            rows = dr.context_kv(dparams, feats, S_B[:, None] + j_P[None])
            st["dcache"] = dr.append_context(st["dcache"], rows, S_B)
            st["caches"] = caches
            st["lengths"] = S_B + jnp.where(live_B, n_B, 0)
            if want_experts:
                ids = out[3]  # [n_moe, B, N+1, k]
                E = tgt.cfg.n_routed_experts
                used = jnp.zeros((ids.shape[0], B, E), bool)
                l_idx = jnp.arange(ids.shape[0])[:, None, None, None]
                b_idx = jnp.arange(B)[None, :, None, None]
                used = used.at[l_idx, b_idx, ids].set(True)
                st["experts"] = st["experts"] + jnp.where(live_B[:, None], jnp.sum(used, -1).T, 0)
            st = commit_tokens(st, new_BP, n_B)
        return st
