"""Absorbed-MLA attention of T query tokens per request over the latent cache, with a tree mask.

Cache row per token: [c_kv (K=512) | k_pe (R=64)] = C values. Queries are already absorbed:
q_cat = [q_nope @ W_UK | q_pe] with C values per head. Values are the first K entries of each cache row.

Visibility for query t of request b (S_b = lengths[b], the committed length before this pass):
  slot j < S_b                      always visible (committed prefix)
  slot S_b + u, 0 <= u < T          visible iff tree_mask[b, t, u] (ancestor-or-self; causal for prefill/AR)
  any other slot                    invisible
The T new rows must already be written at slots S_b .. S_b+T-1.

Implementations (`tree_attention(..., impl=...)`):
  "xla"        `tree_attention_ref`, the plain-XLA reference.
  "pallas"     the Pallas kernel below, Triton lowering (GPU).
  "interpret"  the same kernel with `interpret=True` (CPU tests).
  "auto"       the kernel or the reference per shape (`auto_uses_reference`, measured crossover).
`default_impl()` is "auto" on a GPU backend and "xla" elsewhere.

Kernel (split-K flash decoding, after jax.experimental.pallas.ops.gpu.decode_attention):
  * The T*H query rows of a request are folded into the M dimension of the dots (row r = t*H + h),
    so one program's [block_m, C] query tile meets every key block once; with H=64 and block_m=64 a
    program holds the 64 heads of one tree token.
  * Grid (B, cdiv(T*H, block_m), S): program (b, m, s) walks keys [s*split, (s+1)*split) of request b
    (S chosen to fill the SMs with >= 128 keys per split: measured 1.2-1.6x faster than >= 512 at B=1),
    clipped to lengths[b] + T, in blocks of block_k.  Scores are two dots (latent K and rope R columns
    of the cache row), values are the latent columns of the same loaded key tile (read once).
  * Blocks entirely below lengths[b] (committed prefix) run with no mask at all; only the blocks that
    overlap [lengths[b], lengths[b]+T) (at most ceil((T+block_k-1)/block_k)+1 per split) evaluate the
    tree mask.  The mask travels bit-packed (int32 [B, T, ceil(T/32)], bit u%32 of word u//32 = key
    u of the tree block); each program gathers the words of its rows once.
  * S = 1: the kernel writes the normalised output (q dtype) and the LSE directly.  S > 1: each split
    writes a normalised f32 partial and its LSE; a log-sum-exp combine merges the splits (XLA's, three
    launches, or `combine="pallas"`: one more small kernel, opt-in until timed).
  * Online softmax in base 2 with -inf masking; a row that sees no visible key anywhere gets output
    0 and lse -inf (the XLA reference returns NaN for such rows).
  * Options: transposed=True computes S^T = K q^T and O^T = V^T P^T (q on the N side); value_splits=2 gives
    each program half of the value columns (no register spills, but Q K^T is computed twice).  Both were
    measured slower on the H200 than the default (BENCHMARKS.md, "Kernels").
Backend: the Triton lowering of Pallas (`pl.pallas_call` + `pltriton.CompilerParams`), testable with
interpret=True on CPU; Mosaic GPU was not tried.  At Kimi width (H = 64, C = 576) this attention is
compute-bound for T >= 2 (about 1088 FLOP per cache byte at T*H = 576 query rows), and the Triton kernel
spills registers ([64, 512] f32 accumulator + q tile): it reaches 19-26 % of the bf16 matmul rate; it is
faster than the XLA reference (cuBLAS batched GEMMs) while B*T*L is small (decode at small batch), slower
once the pass is compute-bound, hence "auto".
Shapes: any B, T >= 1, H, L; K and R must be powers of two >= 16 for the GPU lowering (Kimi: 512, 64);
the interpret mode accepts any K, R.  `lengths[b] + T <= L` is required (as for the reference).  There
is no shape fallback in "pallas": every (B, T, H, L) runs the kernel (block sizes are padded / masked).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax.experimental.pallas import triton as pltriton  # Triton lowering (deprecated in jax 0.11, working)

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def default_impl() -> str:
    return "auto" if jax.default_backend() == "gpu" else "xla"


# "auto" (the GPU default) picks per shape, from the H200 crossover run (BENCHMARKS.md, "MLA tree attention",
# benchmarks/2026-12-03c_bench_kernels_attn_crossover.json; H = 64): the kernel wins while the work is small
# (B*T*L <= 131k: 1.4-2.1x; at 295k within 3-11 % either way), the XLA reference (cuBLAS GEMMs) once the
# pass is compute-bound (B=32 L=4k T=9: 780 vs 1215 us; B=128 L=2k T=9: 1441 vs 2068 us).  The threshold is
# on B*T*H*L (proportional to the FLOPs; H other than 64 was not measured), and the reference only while
# its f32 scores [B, T, H, L] stay under AUTO_MAX_SCORE_BYTES.  Those were wall times of standalone calls;
# inside one compiled round kernel time decides, and there the reference also wins from T = 17 tokens (b16
# verify) up: B=1 L=4k T=17, the whole MLA block 139 vs 163 us of kernels and the 5-layer Engine b16 round
# 8.40 vs 8.53 ms (BENCHMARKS.md, "MLA attention block per kernel, and "auto" inside the Engine"), so
# T >= AUTO_XLA_MIN_T also picks the reference.  At T = 9 the evidence is mixed (block 123 vs 127 us, Engine
# round 6.85 vs 6.73 ms), at T = 1 the kernel wins.
AUTO_XLA_MIN_WORK = (1 << 18) * 64
AUTO_XLA_MIN_T = 17
AUTO_MAX_SCORE_BYTES = 2 << 30


def auto_uses_reference(B: int, T: int, H: int, L: int) -> bool:
    """Whether "auto" runs the XLA reference for this shape (else the Pallas kernel)."""
    return ((B * T * H * L >= AUTO_XLA_MIN_WORK or T >= AUTO_XLA_MIN_T)
            and 4 * B * T * H * L <= AUTO_MAX_SCORE_BYTES)


def visibility_mask(lengths_B, tree_mask_BTT, L: int):
    """bool [B, T, L]: which cache slots each query may attend to."""
    T = tree_mask_BTT.shape[-1]
    rel_BL = jnp.arange(L, dtype=jnp.int32)[None, :] - lengths_B[:, None]
    in_prefix_BL = rel_BL < 0
    in_block_BL = (rel_BL >= 0) & (rel_BL < T)
    idx_BL = jnp.clip(rel_BL, 0, T - 1)
    tree_BTL = jnp.take_along_axis(tree_mask_BTT, jnp.broadcast_to(idx_BL[:, None, :], (idx_BL.shape[0], T, L)), axis=2)
    return in_prefix_BL[:, None, :] | (in_block_BL[:, None, :] & tree_BTL)


def tree_attention_ref(q_BTHC, cache_BLC, lengths_B, tree_mask_BTT, scale: float, kv_rank: int = 512):
    """XLA reference. Returns (out [B, T, H, kv_rank] in q's dtype, lse [B, T, H] f32)."""
    L = cache_BLC.shape[1]
    s_BHTL = jnp.einsum("bthc,blc->bhtl", q_BTHC, cache_BLC, preferred_element_type=jnp.float32) * scale
    vis_BTL = visibility_mask(lengths_B, tree_mask_BTT, L)
    s_BHTL = jnp.where(vis_BTL[:, None], s_BHTL, -jnp.inf)
    m_BHT = jnp.max(s_BHTL, axis=-1, keepdims=True)
    p_BHTL = jnp.exp(s_BHTL - m_BHT)
    l_BHT = jnp.sum(p_BHTL, axis=-1, keepdims=True)
    p_BHTL = p_BHTL / l_BHT
    # "->bhtk" then a transpose: XLA:CPU's dot thunk rejects the bf16 x bf16 -> f32 dot written as "->bthk".
    out_BHTK = jnp.einsum("bhtl,blk->bhtk", p_BHTL.astype(cache_BLC.dtype), cache_BLC[..., :kv_rank],
                          preferred_element_type=jnp.float32)
    out_BTHK = jnp.transpose(out_BHTK, (0, 2, 1, 3))
    lse_BTH = jnp.transpose((m_BHT + jnp.log(l_BHT))[..., 0], (0, 2, 1))
    return out_BTHK.astype(q_BTHC.dtype), lse_BTH


# ----------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pack_tree_mask(tree_mask_BTT):
    """bool [B, T, T] -> int32 [B, T, ceil(T/32)]: bit u % 32 of word u // 32 is tree_mask[b, t, u]."""
    B, T, _ = tree_mask_BTT.shape
    W = -(-T // 32)
    m = jnp.pad(tree_mask_BTT.astype(jnp.uint32), ((0, 0), (0, 0), (0, W * 32 - T))).reshape(B, T, W, 32)
    words = jnp.sum(m << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
    return lax.bitcast_convert_type(words, jnp.int32)


def kernel_dot(a, b, dn, f32_operands: bool, f32_algo: str = "ieee"):
    """A dot inside the attention kernels, f32 accumulation. f32 operands take IEEE f32 dots (HIGHEST; FMA
    units), f32_algo="tf32x3" three TF32 tensor-core products (about f32 accuracy), or f32_algo="backend" the
    lowering's default (Triton: one TF32 product; the MLA kernel, whose models are bf16). f32_operands (interpret
    mode) upcasts 16-bit operands: XLA:CPU cannot run a bf16 x bf16 -> f32 dot inside the interpreter's loop,
    and bf16 -> f32 is exact (same products, f32 accumulation as on the tensor cores); it always runs IEEE."""
    if f32_operands:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    prec = None
    if a.dtype == jnp.float32 and f32_algo != "backend":
        prec = (lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if f32_algo == "tf32x3" and not f32_operands
                else lax.Precision.HIGHEST)
    return lax.dot_general(a, b, dn, precision=prec, preferred_element_type=jnp.float32)


def split_size(L: int, S: int, bk: int) -> tuple[int, int]:
    """(keys per split, splits): ceil(L / S) rounded up to a multiple of bk, and the splits that leaves."""
    split = -(-(-(-L // S)) // bk) * bk
    return split, -(-L // split)


def split_blocks(length, T: int, L: int, s, split: int, bk: int):
    """(first key, blocks fully inside the committed prefix, all blocks) of split s for a request with
    committed length `length` and T new rows: keys [s*split, (s+1)*split) clipped to length + T."""
    lo = s * split
    hi = jnp.minimum(lo + split, jnp.minimum(length + T, L))
    n_free = jnp.maximum(jnp.minimum(hi, length) - lo, 0) // bk
    n_all = (jnp.maximum(hi - lo, 0) + bk - 1) // bk
    return lo, n_free, n_all


def combine_splits(o, lse, axis: int, weights_column: bool = False):
    """Log-sum-exp merge of per-split normalised outputs o (split axis `axis`, one more trailing axis than lse)
    and their lse -> (o, lse) without that axis. Splits that saw nothing (lse -inf) weigh 0; a row no split saw
    gets 0 and lse -inf. weights_column: sum the weights as one more column of the weighted outputs (one
    reduction instead of two); which form XLA compiles to fewer launches depends on the shapes (offline counts
    for an H200: fewer at T = 1 and for the GQA verify, one more for the MLA block at T = 9), so callers pick."""
    mx = jnp.max(lse, axis=axis)
    mx_safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(lse - jnp.expand_dims(mx_safe, axis))[..., None]
    if weights_column:
        acc = jnp.sum(jnp.concatenate([w * o, w], axis=-1), axis=axis)
        o, den = acc[..., :-1], acc[..., -1]
    else:
        o, den = jnp.sum(w * o, axis=axis), jnp.sum(w[..., 0], axis=axis)
    o = o / jnp.where(den > 0, den, 1.0)[..., None]
    return o, jnp.where(den > 0, mx_safe + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)


def visible_tile(keys, length, T: int, words, tile, col, row):
    """bool tile: which of a block's keys (absolute slots `keys` [bk]) each query row may see, from the
    committed length and the rows' bit-packed tree-mask words (W x [bm], `pack_tree_mask`). col/row
    broadcast a key vector / a query-row vector to the tile's layout."""
    rel = keys - length
    in_prefix = rel < 0
    in_tree = (rel >= 0) & (rel < T)
    relc = jnp.clip(rel, 0, len(words) * 32 - 1)
    wsel = relc // 32
    bit = relc % 32
    word = jnp.zeros(tile, jnp.int32)
    for w, wd in enumerate(words):
        word = jnp.where(col(wsel == w), row(wd), word)
    tree_vis = ((word >> col(bit)) & 1) != 0
    return col(in_prefix) | (col(in_tree) & tree_vis)


def _attn_kernel(len_ref, bits_ref, q_ref, cache_ref, o_ref, lse_ref, *, T, H, K, R, L, W, bm, bk, split,
                 scale_log2, f32_dots, transposed, VS):
    """One program: request b, query rows [mi*bm, (mi+1)*bm), keys [s*split, (s+1)*split) clipped to the
    visible range.  transposed=True computes S^T = K q^T and O^T = V^T P^T (queries on the N side of the
    dots, so the loop-invariant q tile is a shared-memory operand instead of occupying registers)."""
    b = pl.program_id(0)
    mi = pl.program_id(1) // VS  # query row block
    v0 = (pl.program_id(1) % VS) * (K // VS)  # first value column of this program
    KV = K // VS
    s = pl.program_id(2)
    length = len_ref[b]
    lo, n_free, n_all = split_blocks(length, T, L, s, split, bk)

    q_lat = q_ref[:, pl.ds(0, K)]  # [bm, K]
    q_pe = q_ref[:, pl.ds(K, R)]  # [bm, R]
    rows = mi * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)
    t_rows = jnp.minimum(rows // H, T - 1)
    words = [bits_ref[t_rows, w] for w in range(W)]  # W x [bm] int32, gathered once
    # query axis of the score tile: 0 (S = q K^T, [bm, bk]) or 1 (S^T = K q^T, [bk, bm])
    qa = 1 if transposed else 0
    ka = 1 - qa
    row = lambda v: jnp.expand_dims(v, ka)  # [bm] -> broadcastable over the key axis
    col = lambda v: jnp.expand_dims(v, qa)  # [bk] -> broadcastable over the query axis
    tile = (bk, bm) if transposed else (bm, bk)
    c11 = (((1,), (1,)), ((), ()))  # a @ b.T
    c00 = (((0,), (0,)), ((), ()))  # a.T @ b
    c10 = (((1,), (0,)), ((), ()))  # a @ b
    f32_algo = "backend"  # f32 operands keep the lowering's default dot here (the MLA models are bf16)

    def step(i, carry, masked):
        m_prev, l_prev, acc = carry
        start = lo + i * bk
        if masked:
            keys = start + lax.broadcasted_iota(jnp.int32, (bk,), 0)
            in_range = (keys < L)[:, None]
            k_lat = pltriton.load(cache_ref.at[pl.ds(start, bk), pl.ds(0, K)], mask=in_range, other=0.0)
            k_pe = pltriton.load(cache_ref.at[pl.ds(start, bk), pl.ds(K, R)], mask=in_range, other=0.0)
            v = k_lat if VS == 1 else pltriton.load(cache_ref.at[pl.ds(start, bk), pl.ds(v0, KV)],
                                                    mask=in_range, other=0.0)
        else:
            k_lat = cache_ref[pl.ds(start, bk), pl.ds(0, K)]
            k_pe = cache_ref[pl.ds(start, bk), pl.ds(K, R)]
            v = k_lat if VS == 1 else cache_ref[pl.ds(start, bk), pl.ds(v0, KV)]
        if transposed:
            sc = kernel_dot(k_lat, q_lat, c11, f32_dots, f32_algo) + kernel_dot(k_pe, q_pe, c11, f32_dots, f32_algo)
        else:
            sc = kernel_dot(q_lat, k_lat, c11, f32_dots, f32_algo) + kernel_dot(q_pe, k_pe, c11, f32_dots, f32_algo)
        sc = sc * scale_log2
        if masked:
            sc = jnp.where(visible_tile(keys, length, T, words, tile, col, row), sc, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(sc, axis=ka))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_prev - m_use)
        p = jnp.exp2(sc - row(m_use))
        l_new = l_prev * alpha + jnp.sum(p, axis=ka)
        pv = p.astype(k_lat.dtype)
        if transposed:  # O^T [KV, bm] += V^T [KV, bk] @ P^T [bk, bm]
            acc = acc * alpha[None, :] + kernel_dot(v, pv, c00, f32_dots, f32_algo)
        else:  # O [bm, KV] += P [bm, bk] @ V [bk, KV]
            acc = acc * alpha[:, None] + kernel_dot(pv, v, c10, f32_dots, f32_algo)
        return m_new, l_new, acc

    acc0 = jnp.zeros((KV, bm) if transposed else (bm, KV), jnp.float32)
    carry = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32), acc0)
    carry = lax.fori_loop(0, n_free, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(n_free, n_all, functools.partial(step, masked=True), carry)
    m_i, l_i, acc = carry
    seen = l_i > 0.0
    inv = 1.0 / jnp.where(seen, l_i, 1.0)
    out = (acc * inv[None, :]).T if transposed else acc * inv[:, None]
    lse = jnp.where(seen, (m_i + jnp.log2(jnp.where(seen, l_i, 1.0))) * _LN2, -jnp.inf)
    pltriton.store(o_ref, out.astype(o_ref.dtype))
    pltriton.store(lse_ref, lse)


def _combine_kernel(lse_ref, o_ref, out_ref, lse_out_ref, *, S: int, SC: int):
    """Program (b, row block, value-column block): the log-sum-exp merge of the S splits' normalised partials,
    `combine_splits` in one launch (XLA needs three: a max, a weighted sum, a divide and cast)."""
    Sp = lse_ref.shape[0]
    valid = (lax.broadcasted_iota(jnp.int32, (Sp,), 0) < S)[:, None]
    m = jnp.max(pltriton.load(lse_ref, mask=valid, other=-jnp.inf), axis=0)  # [bm]
    m = jnp.where(m == -jnp.inf, 0.0, m)
    den = jnp.sum(jnp.exp(pltriton.load(lse_ref, mask=valid, other=-jnp.inf) - m[None]), axis=0)

    def chunk(c, acc):
        ok = (c * SC + lax.broadcasted_iota(jnp.int32, (SC,), 0)) < S
        w = jnp.exp(pltriton.load(lse_ref.at[pl.ds(c * SC, SC)], mask=ok[:, None], other=-jnp.inf) - m[None])
        o = pltriton.load(o_ref.at[pl.ds(c * SC, SC)], mask=ok[:, None, None], other=0.0)
        return acc + jnp.sum(w[:, :, None] * o, axis=0)

    acc = lax.fori_loop(0, Sp // SC, chunk, jnp.zeros(out_ref.shape, jnp.float32))
    seen = den > 0
    pltriton.store(out_ref, (acc / jnp.where(seen, den, 1.0)[:, None]).astype(out_ref.dtype))

    @pl.when(pl.program_id(2) == 0)
    def _():
        pltriton.store(lse_out_ref, jnp.where(seen, m + jnp.log(jnp.where(seen, den, 1.0)), -jnp.inf))


def combine_splits_pallas(o_BSMK, lse_BSM, dtype, *, interpret: bool = False, bm: int = 16, bk: int = 32):
    """`combine_splits(o, lse, axis=1)` cast to `dtype`, as one kernel: -> (o [B, M, K] dtype, lse [B, M] f32).
    M must be a multiple of bm and K of bk (the attention kernel's padded rows; K = 512)."""
    B, S, M, K = o_BSMK.shape
    bk = min(bk, K)
    SC = min(16, next_pow2(S))  # splits per loop step: [SC, bm, bk] f32 partials in registers
    Sp = -(-S // SC) * SC
    return pl.pallas_call(
        functools.partial(_combine_kernel, S=S, SC=SC),
        grid=(B, M // bm, K // bk),
        in_specs=[pl.BlockSpec((None, next_pow2(Sp), bm), lambda b, m, k: (b, 0, m)),
                  pl.BlockSpec((None, next_pow2(Sp), bm, bk), lambda b, m, k: (b, 0, m, k))],
        out_specs=[pl.BlockSpec((None, bm, bk), lambda b, m, k: (b, m, k)),
                   pl.BlockSpec((None, bm), lambda b, m, k: (b, m))],
        out_shape=[jax.ShapeDtypeStruct((B, M, K), dtype), jax.ShapeDtypeStruct((B, M), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name="tree_attention_combine",
    )(lse_BSM, o_BSMK)


def _auto_splits(B: int, n_mblocks: int, L: int, bk: int, n_sm: int = 132, min_split: int = 128) -> int:
    """Splits along L so that B * n_mblocks * S programs fill whole waves of the SMs (>= 90 %)."""
    base = B * n_mblocks
    max_s = max(1, L // min_split)
    best = 1
    for waves in range(1, 9):
        s = min(max_s, (waves * n_sm) // base)
        if s < 1:
            continue
        if base * s >= 0.9 * waves * n_sm:
            best = s
            break
        best = max(best, s)
    return max(1, min(best, max_s))


def tree_attention_pallas(q_BTHC, cache_BLC, lengths_B, tree_mask_BTT, scale: float, kv_rank: int = 512, *,
                          block_m: int | None = None, block_k: int | None = None, num_splits: int | None = None,
                          num_warps: int | None = None, num_stages: int | None = None, transposed: bool = False,
                          value_splits: int = 1, interpret: bool = False, n_sm: int = 132, min_split: int = 128,
                          combine: str = "xla"):
    """Pallas tree attention (see module docstring). Same contract as `tree_attention_ref`.  min_split: the
    fewest keys per split when the splits along L are chosen automatically (num_splits=None). combine: how the
    splits merge, "xla" (`combine_splits`, three launches; measured) or "pallas" (`combine_splits_pallas`, one
    launch; offline a K2.6 layer at T=1 / 9 is 2 / 1 launches fewer; opt-in until timed)."""
    if combine not in ("xla", "pallas"):
        raise ValueError(f"unknown split combine {combine!r}: choose xla or pallas")
    B, T, H, C = q_BTHC.shape
    L = cache_BLC.shape[1]
    K = kv_rank
    R = C - K
    M = T * H
    bm = block_m or min(64, max(16, next_pow2(M)))
    bk = block_k or 32
    Mp = -(-M // bm) * bm
    n_mb = Mp // bm
    W = -(-T // 32)
    S = num_splits or _auto_splits(B, n_mb * value_splits, L, bk, n_sm, min_split)
    split, S = split_size(L, S, bk)
    single = S == 1
    warps = num_warps or (8 if bm >= 64 else 4)
    stages = num_stages or 2

    q_BMC = q_BTHC.reshape(B, M, C)
    if Mp != M:
        q_BMC = jnp.pad(q_BMC, ((0, 0), (0, Mp - M), (0, 0)))
    bits_BTW = pack_tree_mask(tree_mask_BTT)
    lengths_B = lengths_B.astype(jnp.int32)

    VS = value_splits
    KV = K // VS
    kernel = functools.partial(_attn_kernel, T=T, H=H, K=K, R=R, L=L, W=W, bm=bm, bk=bk, split=split,
                               scale_log2=float(scale) * _LOG2E, f32_dots=interpret, transposed=transposed, VS=VS)
    if single:
        out_shape = [jax.ShapeDtypeStruct((B, Mp, K), q_BTHC.dtype), jax.ShapeDtypeStruct((B, Mp), jnp.float32)]
        out_specs = [pl.BlockSpec((None, bm, KV), lambda b, m, s: (b, m // VS, m % VS)),
                     pl.BlockSpec((None, bm), lambda b, m, s: (b, m // VS))]
    else:
        out_shape = [jax.ShapeDtypeStruct((B, S, Mp, K), jnp.float32),
                     jax.ShapeDtypeStruct((B, S, Mp), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, bm, KV), lambda b, m, s: (b, s, m // VS, m % VS)),
                     pl.BlockSpec((None, None, bm), lambda b, m, s: (b, s, m // VS))]
    params = pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, n_mb * VS, S),
        in_specs=[
            pl.BlockSpec((B,), lambda b, m, s: (0,)),
            pl.BlockSpec((None, T, W), lambda b, m, s: (b, 0, 0)),
            pl.BlockSpec((None, bm, C), lambda b, m, s: (b, m // VS, 0)),
            pl.BlockSpec((None, L, C), lambda b, m, s: (b, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="tree_attention",
    )(lengths_B, bits_BTW, q_BMC, cache_BLC)

    if not single and combine == "pallas":
        o, lse = combine_splits_pallas(o, lse, q_BTHC.dtype, interpret=interpret, bk=min(32, K))
    elif not single:
        o, lse = combine_splits(o, lse, axis=1, weights_column=T == 1)  # fewer launches at T = 1 only
        o = o.astype(q_BTHC.dtype)
    if Mp != M:
        o, lse = o[:, :M], lse[:, :M]
    return o.reshape(B, T, H, K), lse.reshape(B, T, H)


def tree_attention(q_BTHC, cache_BLC, lengths_B, tree_mask_BTT, scale: float, kv_rank: int = 512, *, impl: str = "xla"):
    """Dispatch point used by the model: impl "xla" (reference), "pallas" (GPU kernel), "auto" (either, per
    shape: `auto_uses_reference`) or "interpret"."""
    if impl == "auto":
        B, T, H, _ = q_BTHC.shape
        impl = "xla" if auto_uses_reference(B, T, H, cache_BLC.shape[1]) else "pallas"
    if impl == "xla":
        return tree_attention_ref(q_BTHC, cache_BLC, lengths_B, tree_mask_BTT, scale, kv_rank)
    if impl == "pallas":
        return tree_attention_pallas(q_BTHC, cache_BLC, lengths_B, tree_mask_BTT, scale, kv_rank)
    if impl == "interpret":
        return tree_attention_pallas(q_BTHC, cache_BLC, lengths_B, tree_mask_BTT, scale, kv_rank, interpret=True)
    raise ValueError(f"unknown tree attention impl {impl!r}")


def _main():  # pragma: no cover - manual check / timing
    import time

    B, L, T, H, K, R = 1, 4096, 9, 64, 512, 64
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu:
        B, L, T, H, K, R = 2, 300, 5, 4, 64, 16
    ks = jax.random.split(jax.random.key(int(time.time())), 3)
    q = jax.random.normal(ks[0], (B, T, H, K + R), jnp.bfloat16)
    cache = jax.random.normal(ks[1], (B, L, K + R), jnp.bfloat16)
    lengths = jnp.full((B,), L - T, jnp.int32)
    tree = jnp.tril(jnp.ones((T, T), bool))[None].repeat(B, 0)
    scale = 1.0 / math.sqrt(192)
    impl = "pallas" if on_gpu else "interpret"
    f = jax.jit(functools.partial(tree_attention, scale=scale, kv_rank=K, impl=impl))
    g = jax.jit(functools.partial(tree_attention, scale=scale, kv_rank=K, impl="xla"))
    o, lse = jax.block_until_ready(f(q, cache, lengths, tree))
    o_r, lse_r = g(q, cache, lengths, tree)
    err = float(jnp.linalg.norm((o.astype(jnp.float32) - o_r.astype(jnp.float32)).ravel())
                / jnp.linalg.norm(o_r.astype(jnp.float32).ravel()))
    print(f"rel err out {err:.2e}  max |dlse| {float(jnp.max(jnp.abs(lse - lse_r))):.2e}")
    for name, fn in ((impl, f), ("xla", g)):
        jax.block_until_ready(fn(q, cache, lengths, tree))
        t0 = time.perf_counter()
        for _ in range(20):
            r = fn(q, cache, lengths, tree)
        jax.block_until_ready(r)
        print(f"{name}: {(time.perf_counter() - t0) / 20 * 1e6:.1f} us/call (B={B} L={L} T={T} H={H})")


if __name__ == "__main__":
    _main()
