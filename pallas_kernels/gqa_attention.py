"""Grouped-query attention of T new tokens per request over a Llama-style KV cache, with a tree mask.

Cache (kimijax/models/llama.py): [B, L, 2, KV, e]; slot j holds the rotated key (index 0) and the value
(index 1) of the token at slot j. Queries q [B, KV, T*g, e]: row r = t*g + j is query head kv*g + j of
new token t (g query heads per kv head, HF repeat_kv order). Visibility is the tree-attention rule
(`pallas_kernels.tree_attention.visibility_mask`): slots < lengths[b] always, the T new rows (already
written at lengths..lengths+T-1) per the tree mask, nothing else.

Why a kernel: at SmolLM2 shapes a decode step is launch-bound. The XLA formulation of this attention is
7-9 kernels per layer (two slices of the cache, the score dot, masked max, exp-sum, divide, value dot), each
~1.3-5 us on an H200 with almost no work in it (scripts/profile_round.py). This is one kernel (plus a small
XLA combine when the keys are split across programs).

Implementations (`gqa_tree_attention(..., impl=...)`):
  "xla"        `gqa_tree_attention_ref`, the plain-XLA reference.
  "pallas"     the Pallas kernel below, Triton lowering (GPU).
  "interpret"  the same kernel with `interpret=True` (CPU tests).
`default_impl()` is "pallas" on a GPU backend and "xla" elsewhere.

Kernel: grid (B, KV, row blocks of block_m query rows, S key splits). Program (b, h, m, s) loads its query
rows once and walks keys [s*split, (s+1)*split) clipped to lengths[b] + T in blocks of block_k, reading
the key and value rows of kv head h straight from the cache (strided; no copy). Online softmax in base 2;
blocks inside the committed prefix skip the mask, the blocks that overlap the tree rows read the
bit-packed tree mask (`tree_attention.pack_tree_mask`). S = 1 writes the normalised output; S > 1 writes f32
partials + LSE merged by an XLA log-sum-exp combine. Splits (`default_splits`): at least 64 keys each, about
two programs per SM in all. On the H200 at SmolLM2 shapes (B = 1, L = 640) 64 keys per split took 13.2 / 17.4 us
per call (T = 1 / 17) against 20.7 / 21.0 at 128, 31.3 / 29.8 at 256 and 36.0 / 42.0 with one split (the few
programs of one split leave the GPU idle); the XLA reference 21.5 / 28.0 (BENCHMARKS.md, "Where a round's time
goes, and a decode-attention kernel"). Dots take the operands' precision: f32 models run
IEEE f32 dots (`precision=HIGHEST`, as the XLA reference), so a tree-verify pass and an AR step agree as
closely as the reference makes them (f32_algo="tf32x3", three TF32 tensor-core products, took 17.9 / 17.1 us
at 128 keys per split against IEEE's 20.7 / 21.0, but is not the reference's arithmetic, so it is an option, not
the default). A row that sees no key gets 0 (the reference gives NaN).
Shapes: any B, T >= 1, KV, g, L; e must be a power of two >= 16 for the GPU lowering (SmolLM2: 64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tree_attention import (combine_splits, kernel_dot, next_pow2, pack_tree_mask, split_blocks,
                                           split_size, visibility_mask, visible_tile)

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def default_impl() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def kernel_supports(head_dim: int) -> bool:
    """Whether the GPU lowering takes this head size (Triton dots want power-of-two tiles of >= 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def gqa_tree_attention_ref(q_BkMe, cache_BL2ke, lengths_B, tree_mask_BTT, scale: float, precision=None):
    """XLA reference: q [B, KV, T*g, e] -> out [B, KV, T*g, e] in q's dtype."""
    B, KV, M, E = q_BkMe.shape
    T = tree_mask_BTT.shape[-1]
    g = M // T
    L = cache_BL2ke.shape[1]
    q_BktgE = q_BkMe.reshape(B, KV, T, g, E)
    s = jnp.einsum("bktge,blke->bkgtl", q_BktgE, cache_BL2ke[:, :, 0], preferred_element_type=jnp.float32,
                   precision=precision) * scale
    s = jnp.where(visibility_mask(lengths_B, tree_mask_BTT, L)[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(cache_BL2ke.dtype)
    o = jnp.einsum("bkgtl,blke->bktge", p, cache_BL2ke[:, :, 1], preferred_element_type=jnp.float32,
                   precision=precision)
    return o.reshape(B, KV, M, E).astype(q_BkMe.dtype)


# ----------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------


def _gqa_kernel(len_ref, bits_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, T, g, M, L, W, bm, bk, split, scale_log2,
                f32_dots, f32_algo):
    b = pl.program_id(0)
    mi = pl.program_id(2)
    s = pl.program_id(3)
    length = len_ref[b]
    lo, n_free, n_all = split_blocks(length, T, L, s, split, bk)

    rows = mi * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)
    row_ok = rows < M
    q = pltriton.load(q_ref.at[pl.ds(mi * bm, bm), :], mask=row_ok[:, None], other=0.0)  # [bm, e]
    t_rows = jnp.minimum(rows // g, T - 1)
    words = [bits_ref[t_rows, w] for w in range(W)]  # W x [bm] int32, gathered once
    c11 = (((1,), (1,)), ((), ()))  # a @ b.T
    c10 = (((1,), (0,)), ((), ()))  # a @ b

    def step(i, carry, masked):
        m_prev, l_prev, acc = carry
        start = lo + i * bk
        keys = start + lax.broadcasted_iota(jnp.int32, (bk,), 0)
        if masked:
            in_range = (keys < L)[:, None]
            k = pltriton.load(k_ref.at[pl.ds(start, bk), :], mask=in_range, other=0.0)
            v = pltriton.load(v_ref.at[pl.ds(start, bk), :], mask=in_range, other=0.0)
        else:
            k = k_ref[pl.ds(start, bk), :]
            v = v_ref[pl.ds(start, bk), :]
        sc = kernel_dot(q, k, c11, f32_dots, f32_algo) * scale_log2  # [bm, bk]
        if masked:
            sc = jnp.where(visible_tile(keys, length, T, words, (bm, bk), lambda x: x[None, :],
                                        lambda x: x[:, None]), sc, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_prev - m_use)
        p = jnp.exp2(sc - m_use[:, None])
        l_new = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + kernel_dot(p.astype(v.dtype), v, c10, f32_dots, f32_algo)
        return m_new, l_new, acc

    E = q.shape[-1]
    carry = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32), jnp.zeros((bm, E), jnp.float32))
    carry = lax.fori_loop(0, n_free, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(n_free, n_all, functools.partial(step, masked=True), carry)
    m_i, l_i, acc = carry
    seen = l_i > 0.0
    out = acc * (1.0 / jnp.where(seen, l_i, 1.0))[:, None]
    lse = jnp.where(seen, (m_i + jnp.log2(jnp.where(seen, l_i, 1.0))) * _LN2, -jnp.inf)
    pltriton.store(o_ref.at[pl.ds(mi * bm, bm), :], out.astype(o_ref.dtype), mask=row_ok[:, None])
    pltriton.store(lse_ref.at[pl.ds(mi * bm, bm)], lse, mask=row_ok)


def default_splits(programs: int, L: int, keys_per_split: int = 64, target_programs: int = 264) -> int:
    """Splits along L for a grid of `programs` (b, kv, row block) programs: enough for about target_programs
    programs in all (two per H200 SM), never fewer than keys_per_split keys per split. At small batch this
    is ceil(L / keys_per_split); at large batch the grid is already full and the combine (f32 partials of
    every split) would cost memory for nothing, so it drops to 1."""
    return max(1, min(-(-L // keys_per_split), -(-target_programs // max(programs, 1))))


def gqa_tree_attention_pallas(q_BkMe, cache_BL2ke, lengths_B, tree_mask_BTT, scale: float, *,
                              block_m: int | None = None, block_k: int | None = None, num_splits: int | None = None,
                              keys_per_split: int = 64, target_programs: int = 264, num_warps: int = 4, num_stages: int = 2,
                              f32_algo: str = "ieee", interpret: bool = False):
    """Pallas GQA tree attention (module docstring); same contract as `gqa_tree_attention_ref`.
    Splits along L: num_splits, else `default_splits` (at least keys_per_split keys each, about
    target_programs programs in all). Default blocks: f32 16 query rows x 64 keys
    (IEEE f32 dots run on the FMA units; at 32+ rows Triton spills or needs 255 registers, scripts/triton_sass.py
    style check), 16-bit up to 64 rows x 32 keys (tensor cores)."""
    B, KV, M, E = q_BkMe.shape
    T = tree_mask_BTT.shape[-1]
    if M % T:
        raise ValueError(f"query rows {M} are not T={T} tokens x g heads")
    g = M // T
    L = cache_BL2ke.shape[1]
    f32 = jnp.dtype(q_BkMe.dtype) == jnp.float32
    bm = block_m or (16 if f32 else min(64, max(16, next_pow2(M))))
    bk = block_k or (64 if f32 else 32)
    n_mb = -(-M // bm)
    W = -(-T // 32)
    S = num_splits or default_splits(B * KV * n_mb, L, keys_per_split, target_programs)
    split, S = split_size(L, S, bk)
    single = S == 1
    kernel = functools.partial(_gqa_kernel, T=T, g=g, M=M, L=L, W=W, bm=bm, bk=bk, split=split,
                               scale_log2=float(scale) * _LOG2E, f32_dots=interpret, f32_algo=f32_algo)
    if single:
        out_shape = [jax.ShapeDtypeStruct((B, KV, M, E), q_BkMe.dtype), jax.ShapeDtypeStruct((B, KV, M), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, M, E), lambda b, h, m, s: (b, h, 0, 0)),
                     pl.BlockSpec((None, None, M), lambda b, h, m, s: (b, h, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((B, KV, S, M, E), jnp.float32),
                     jax.ShapeDtypeStruct((B, KV, S, M), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, M, E), lambda b, h, m, s: (b, h, s, 0, 0)),
                     pl.BlockSpec((None, None, None, M), lambda b, h, m, s: (b, h, s, 0))]
    if interpret and L % bk:  # the interpreter cannot slice a block past a short array's end (the GPU masks)
        cache_BL2ke = jnp.pad(cache_BL2ke, ((0, 0), (0, -L % bk), (0, 0), (0, 0), (0, 0)))
    Lp = cache_BL2ke.shape[1]
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, KV, n_mb, S),
        in_specs=[
            pl.BlockSpec((B,), lambda b, h, m, s: (0,)),
            pl.BlockSpec((None, T, W), lambda b, h, m, s: (b, 0, 0)),
            pl.BlockSpec((None, None, M, E), lambda b, h, m, s: (b, h, 0, 0)),
            pl.BlockSpec((None, Lp, None, None, E), lambda b, h, m, s: (b, 0, 0, h, 0)),  # keys of kv head h
            pl.BlockSpec((None, Lp, None, None, E), lambda b, h, m, s: (b, 0, 1, h, 0)),  # its values
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gqa_tree_attention",
    )(lengths_B.astype(jnp.int32), pack_tree_mask(tree_mask_BTT), q_BkMe, cache_BL2ke, cache_BL2ke)
    if single:
        return o
    # the weights as a column: one launch fewer per layer in the b16 verify (T = 17), the same at T = 1 and 9
    return combine_splits(o, lse, axis=2, weights_column=True)[0].astype(q_BkMe.dtype)


def gqa_tree_attention(q_BkMe, cache_BL2ke, lengths_B, tree_mask_BTT, scale: float, *, impl: str = "xla",
                       precision=None):
    """Dispatch point used by the Llama target: impl "xla" (reference), "pallas" (GPU kernel) or "interpret".
    precision applies to the reference (the kernel picks IEEE f32 dots for f32 operands itself)."""
    if impl == "xla":
        return gqa_tree_attention_ref(q_BkMe, cache_BL2ke, lengths_B, tree_mask_BTT, scale, precision)
    if impl in ("pallas", "interpret"):
        return gqa_tree_attention_pallas(q_BkMe, cache_BL2ke, lengths_B, tree_mask_BTT, scale,
                                         interpret=impl == "interpret")
    raise ValueError(f"unknown GQA attention impl {impl!r}")


def _main():  # pragma: no cover - manual check / timing on the GPU
    """Kernel vs reference at SmolLM2's head shape (KV=3, g=3, e=64, f32) for an AR step and a 17-node
    verify, a few block/split variants. Time per call = a chain of 20 dependent calls in one program / 20
    (the output feeds the next call's queries), so dispatch is amortised but launch gaps count, as in a round."""
    import time

    import numpy as np

    def chain(f, n=20):
        def run(q, cache, lengths, tree):
            for _ in range(n):
                q = f(q, cache, lengths, tree)
            return q
        return jax.jit(run)

    def per_call_us(f, args, n=20, reps=30):
        g = chain(f, n)
        jax.block_until_ready(g(*args))
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(g(*args))
            ts.append(time.perf_counter() - t)
        return float(np.median(ts)) / n * 1e6

    on_gpu = jax.default_backend() == "gpu"
    KV, g, e = 3, 3, 64
    scale = e ** -0.5
    roof = float("nan")
    if on_gpu:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
        from bench_slice import measure_roof
        roof = measure_roof()
    print(f"backend {jax.default_backend()}; KV={KV} g={g} e={e} f32; HBM read roof {roof / 1e12:.2f} TB/s; "
          f"us per call (chain of 20); floor = the committed K/V bytes at the roof")
    # (B, T, L, committed length): C=1 AR / b16 verify at a 400-token context; C=32 AR / b4 verify at ~300
    for B, T, L, n in ((1, 1, 640, 400), (1, 17, 640, 400), (32, 1, 512, 300), (32, 5, 512, 300)):
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(T), 3)
        q = jax.random.normal(k1, (B, KV, T * g, e), jnp.float32)
        cache = jax.random.normal(k2, (B, L, 2, KV, e), jnp.float32)
        lengths = jnp.full((B,), n, jnp.int32)
        tree = jnp.tril(jax.random.bernoulli(k3, 0.5, (B, T, T))) | jnp.eye(T, dtype=bool)[None]
        args = (q, cache, lengths, tree)
        floor_us = B * (n + T) * 2 * KV * e * 4 / roof * 1e6
        ref = functools.partial(gqa_tree_attention_ref, scale=scale, precision=lax.Precision.HIGHEST)
        r = jax.jit(ref)(*args)
        variants = {"default": {}, "1 split": dict(num_splits=1), "2 splits": dict(num_splits=2),
                    "128 keys/split": dict(keys_per_split=128), "256 keys/split": dict(keys_per_split=256),
                    "bk 32": dict(block_k=32), "bk 128": dict(block_k=128), "2 warps": dict(num_warps=2),
                    "tf32x3": dict(f32_algo="tf32x3")}
        print(f"B={B} T={T} L={L} len={n}: floor {floor_us:.1f}, XLA reference "
              f"{per_call_us(ref, args) if on_gpu else float('nan'):.1f}")
        for name, kw in variants.items():
            f = functools.partial(gqa_tree_attention_pallas, scale=scale, interpret=not on_gpu, **kw)
            try:
                err = float(jnp.max(jnp.abs(jax.jit(f)(*args) - r)))
            except Exception as ex:  # a variant the shapes do not allow: say so, go on
                print(f"  kernel {name:<15} failed: {type(ex).__name__}: {str(ex)[:120]}")
                continue
            print(f"  kernel {name:<15} max|err| {err:.1e}  {per_call_us(f, args) if on_gpu else float('nan'):7.1f}")

if __name__ == "__main__":  # pragma: no cover
    _main()
