"""DFlash block drafter (z-lab `DFlashDraftModel` checkpoint format): KV injection + bidirectional block.

The drafter is a small Qwen3-style stack without embedding or lm_head (it borrows the target's). Per
committed token it keeps, for every draft layer, one context K/V row computed from the target's residual
stream after the layers `target_layer_ids` (concat -> `fc` -> `hidden_norm` -> the layer's k_proj + k_norm +
rope at the token's absolute position, and v_proj). The context vectors never pass through the draft layers.
One draft pass runs the block `[bonus, MASK x (bs-1)]` at positions S..S+bs-1 over [context slots < S ; the
whole block] (bidirectional inside the block); block slot i >= 1 predicts the token at position S+i.

Draft context cache: a list (one entry per draft layer) of arrays [B, Lc, 2, Hkv, hd] in the drafter dtype;
slot p mod Lc holds K (index 0, normed and rotated) and V (index 1) of the committed token at absolute position p
(Lc covers the context, or with a draft window W is a ring of W + block slots; see Drafter.init_cache).
The configuration (`DrafterConfig`, HF translation, `DrafterError`) is in models/drafter_config.py.

Names: B batch, T tokens this pass, L context slots, D model dim, F = nL*D fused feature dim, H query heads,
k kv heads, g query heads per kv head, e head dim, M mlp hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import zlib
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax.traverse_util import unflatten_dict

from kimijax.config import ConfigError
from kimijax.models.common import MLP, RMSNorm, apply_rope_half, param, rope_cos_sin
from kimijax.models.drafter_config import (KIMI_K25_DFLASH, DrafterConfig, DrafterError,  # noqa: F401 (re-exported)
                                           default_target_layer_ids)


# ---------------------------------------------------------------- modules
def _block_mask(T: int, causal: bool, window: int | None):
    """bool [T, T]: query slot i sees block slot s."""
    i = jnp.arange(T)[:, None]
    s = jnp.arange(T)[None, :]
    m = jnp.ones((T, T), bool)
    if causal:
        m &= s <= i
    if window is not None:
        m &= i - s < window
        if not causal:
            m &= s - i < window
    return m


class DraftAttention(nn.Module):
    """Qwen3 GQA attention with q/k norms; keys/values = [injected context ; block]."""
    cfg: DrafterConfig
    dtype: Any

    def setup(self):
        c, dt = self.cfg, self.dtype
        D, H, KV, E = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = param(self, "q_proj", (H, E, D), ("heads", "head_dim", "embed"), dt)
        self.k_proj = param(self, "k_proj", (KV, E, D), ("kv_heads", "head_dim", "embed"), dt)
        self.v_proj = param(self, "v_proj", (KV, E, D), ("kv_heads", "head_dim", "embed"), dt)
        self.o_proj = param(self, "o_proj", (D, H, E), ("embed", "heads", "head_dim"), dt, fan_in=H * E)
        self.q_norm = RMSNorm(E, c.rms_norm_eps, dt)
        self.k_norm = RMSNorm(E, c.rms_norm_eps, dt)

    def kv(self, x_BTD, cos_BTe, sin_BTe):
        """-> [B, T, 2, k, e]: k_norm'ed, rotated keys and values of x."""
        k_BTke = self.k_norm(jnp.einsum("btd,ked->btke", x_BTD, self.k_proj))
        k_BTke = apply_rope_half(k_BTke, cos_BTe[:, :, None], sin_BTe[:, :, None])
        v_BTke = jnp.einsum("btd,ked->btke", x_BTD, self.v_proj)
        return jnp.stack([k_BTke, v_BTke], axis=2)

    def __call__(self, x_BTD, cos_BTe, sin_BTe, ctx_BL2ke, ctx_mask_BTL, blk_mask_TT):
        c = self.cfg
        B, T, _ = x_BTD.shape
        KV, G, E = c.num_key_value_heads, c.q_per_kv, c.head_dim
        q_BTHe = self.q_norm(jnp.einsum("btd,hed->bthe", x_BTD, self.q_proj))
        q_BTHe = apply_rope_half(q_BTHe, cos_BTe[:, :, None], sin_BTe[:, :, None])
        q_BTkge = q_BTHe.reshape(B, T, KV, G, E)  # query head h uses kv head h // G (HF repeat_kv)
        # One key/value sequence [context ; block]: a score and a value product instead of two of each plus the
        # slices between them (offline count: 5 fewer launches per drafter layer).
        # J is rounded up to a multiple of 32 with masked zero rows, which GEMM tiles want: otherwise XLA pads
        # both products' operands in launches of their own.
        blk_BT2ke = self.kv(x_BTD, cos_BTe, sin_BTe)
        L = ctx_BL2ke.shape[1]
        pad = -(L + T) % 32
        kv_BJ2ke = jnp.concatenate([ctx_BL2ke, blk_BT2ke, jnp.zeros((B, pad) + blk_BT2ke.shape[2:], blk_BT2ke.dtype)],
                                   axis=1)
        f32 = jnp.float32
        s = jnp.einsum("btkge,bjke->bkgtj", q_BTkge, kv_BJ2ke[:, :, 0], preferred_element_type=f32) * (E ** -0.5)
        mask_BTJ = jnp.concatenate([ctx_mask_BTL, jnp.broadcast_to(blk_mask_TT, (B, T, T)),
                                    jnp.zeros((B, T, pad), bool)], axis=-1)
        s = jnp.where(mask_BTJ[:, None, None], s, -jnp.inf)  # every query sees at least itself
        p = jax.nn.softmax(s, axis=-1).astype(self.dtype)
        o = jnp.einsum("bkgtj,bjke->btkge", p, kv_BJ2ke[:, :, 1], preferred_element_type=f32)
        o_BTHe = o.astype(self.dtype).reshape(B, T, KV * G, E)
        return jnp.einsum("bthe,dhe->btd", o_BTHe, self.o_proj)


class DraftLayer(nn.Module):
    cfg: DrafterConfig
    dtype: Any

    def setup(self):
        c = self.cfg
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.self_attn = DraftAttention(c, self.dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, self.dtype)

    def context_kv(self, ctx_BTD, cos_BTe, sin_BTe):
        return self.self_attn.kv(ctx_BTD, cos_BTe, sin_BTe)

    def __call__(self, x_BTD, cos_BTe, sin_BTe, ctx_BL2ke, ctx_mask_BTL, blk_mask_TT):
        h = self.input_layernorm(x_BTD)
        x_BTD = x_BTD + self.self_attn(h, cos_BTe, sin_BTe, ctx_BL2ke, ctx_mask_BTL, blk_mask_TT)
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))


class DFlash(nn.Module):
    """Param tree mirrors the checkpoint: fc, hidden_norm, norm, layers_{i}/{input_layernorm, self_attn/...,
    post_attention_layernorm, mlp/...}. q/k/v_proj are stored per head ([H|k, e, D]); o_proj [D, H, e]."""
    cfg: DrafterConfig

    @property
    def dtype(self):
        return jnp.dtype(self.cfg.dtype)

    def setup(self):
        c = self.cfg
        self.fc = param(self, "fc", (c.hidden_size, c.num_features * c.hidden_size), ("embed", "draft_features"),
                        self.dtype)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.layers = [DraftLayer(c, self.dtype) for _ in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)

    def _rope(self, positions_BT):
        inv, amp = self.cfg.rope_tables()
        return rope_cos_sin(positions_BT, inv, amp)

    def context_kv(self, feats_BTF, positions_BT, fc_out_BTD=None):
        """Fused target features -> per-layer context rows [B, T, 2, k, e]. fc_out_BTD: feats x fc computed
        outside (a tensor-split fc, sharding/drafter_fc.py), else computed here."""
        with jax.named_scope("drafter_context"):
            if fc_out_BTD is None:
                fc_out_BTD = jnp.einsum("btf,df->btd", feats_BTF.astype(self.dtype), self.fc)
            ctx_BTD = self.hidden_norm(fc_out_BTD.astype(self.dtype))
            cos, sin = self._rope(positions_BT)
            return [layer.context_kv(ctx_BTD, cos, sin) for layer in self.layers]

    def block(self, x_BTD, positions_BT, ctx_kv, ctx_pos_BL, ctx_valid_BL):
        """Block hidden states (after the final norm) [B, T, D]; ctx_kv[i] [B, L, 2, k, e] at ctx_pos_BL."""
        c = self.cfg
        T = x_BTD.shape[1]
        cos, sin = self._rope(positions_BT)
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"drafter_layer_{i}"):
                w = c.layer_window(i)
                ctx_mask_BTL = jnp.broadcast_to(ctx_valid_BL[:, None, :], (x_BTD.shape[0], T, ctx_valid_BL.shape[1]))
                if w is not None:  # context positions are < every query position, so one side suffices
                    ctx_mask_BTL = ctx_mask_BTL & (positions_BT[:, :, None] - ctx_pos_BL[:, None, :] < w)
                x_BTD = layer(x_BTD, cos, sin, ctx_kv[i], ctx_mask_BTL, _block_mask(T, c.layer_causal(i), w))
        return self.norm(x_BTD)

    def init_all(self, feats_BTF, x_BTD, positions_BT):
        """Touches every parameter (used by init)."""
        kv = self.context_kv(feats_BTF, positions_BT)
        return self.block(x_BTD, positions_BT, kv, positions_BT, jnp.ones(positions_BT.shape, bool))


# ---------------------------------------------------------------- the drafter object
def check_compatible(cfg: DrafterConfig, target) -> None:
    """Raise DrafterError when the drafter cannot run on this target."""
    if cfg.hidden_size != target.hidden_size:
        raise DrafterError(f"drafter hidden_size={cfg.hidden_size} != target hidden_size={target.hidden_size}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_layers:
        raise DrafterError(f"drafter num_target_layers={cfg.num_target_layers} != target num_layers="
                           f"{target.num_layers}")
    if max(cfg.target_layer_ids) >= target.num_layers:
        raise DrafterError(f"drafter target_layer_ids {list(cfg.target_layer_ids)} reach past the target's "
                           f"{target.num_layers} layers")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise DrafterError(f"drafter mask_token_id={cfg.mask_token_id} is outside the target vocabulary "
                           f"(vocab_size={target.vocab_size})")
    if cfg.vocab_size is not None and cfg.vocab_size != target.vocab_size:
        raise DrafterError(f"drafter vocab_size={cfg.vocab_size} != target vocab_size={target.vocab_size}")


@dataclasses.dataclass
class Drafter:
    """A DFlash drafter: config + params + module. Methods are pure in their params (jit-friendly)."""
    cfg: DrafterConfig
    params: Any
    source: str = ""
    random_weights: bool = False
    mesh: Any = None  # set by on_mesh: params on it by sharding.rules; fc's input split over "tensor"

    def __post_init__(self):
        self.module = DFlash(self.cfg)

    def on_mesh(self, mesh) -> "Drafter":
        """This drafter on a device mesh: params placed by sharding.rules (drafter_shardings), and the context
        projection through sharding/drafter_fc.py where fc's input dimension is split."""
        from sharding.rules import drafter_shardings
        return dataclasses.replace(self, params=jax.device_put(self.params, drafter_shardings(self.cfg, mesh)),
                                   mesh=mesh)

    @property
    def dtype(self):
        return jnp.dtype(self.cfg.dtype)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    def init_cache(self, B: int, Lc: int):
        """Per-layer context K/V: list of zeros [B, Lc, 2, Hkv, hd]. Position p lives in slot p mod Lc: with
        Lc >= the context that is slot p; with a draft window W the engine sizes Lc = W + block and the cache
        is a ring (the window and one round's appended rows never share a slot)."""
        c = self.cfg
        return [jnp.zeros((B, Lc, 2, c.num_key_value_heads, c.head_dim), self.dtype)
                for _ in range(c.num_hidden_layers)]

    def context_kv(self, dparams, feats_nBTD, positions_BT):
        """Target residual streams after each layer in target_layer_ids [nL, B, T, D] -> per-layer K/V rows
        [B, T, 2, Hkv, hd] at absolute positions_BT."""
        nL, B, T, D = feats_nBTD.shape
        if nL != self.cfg.num_features or D != self.cfg.hidden_size:
            raise DrafterError(f"context features {feats_nBTD.shape}: expected [{self.cfg.num_features}, B, T, "
                               f"{self.cfg.hidden_size}]")
        feats_BTF = jnp.moveaxis(feats_nBTD, 0, 2).reshape(B, T, nL * D)  # concat in target_layer_ids order
        fc_out = None
        if self.mesh is not None:
            from sharding.drafter_fc import fc_axis, project_features
            if fc_axis(self.mesh, nL * D):
                fc_out = project_features(feats_BTF, dparams["fc"], self.mesh)
        return self.module.apply({"params": dparams}, feats_BTF, positions_BT.astype(jnp.int32), fc_out,
                                 method=DFlash.context_kv)

    def append_context(self, dcache, kv_rows, start_B):
        """Write each layer's T rows for positions start_b .. start_b+T-1 (slots mod Lc; T <= Lc)."""
        Lc, T = dcache[0].shape[1], kv_rows[0].shape[1]
        if T > Lc:
            raise DrafterError(f"{T} context rows do not fit a {Lc}-slot drafter cache")
        slot_BT = (start_B.astype(jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)[None]) % Lc
        b_B1 = jnp.arange(slot_BT.shape[0])[:, None]
        return [c.at[b_B1, slot_BT].set(r.astype(c.dtype)) for c, r in zip(dcache, kv_rows)]

    def extend_context(self, dparams, dcache, feats_nBTD, start_B):
        """context_kv at positions start_b.. then append_context."""
        T = feats_nBTD.shape[2]
        pos_BT = start_B[:, None].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)[None]
        return self.append_context(dcache, self.context_kv(dparams, feats_nBTD, pos_BT), start_B)

    def _window_view(self, dcache, ctx_len_B, window):
        """The context slots one draft pass reads: (per-layer K/V, slot positions [B, L'], visible [B, L'])."""
        B, Lc = dcache[0].shape[:2]
        S = ctx_len_B.astype(jnp.int32)
        if window is None or window >= Lc:  # the whole cache, slot = position (no ring without a window)
            pos_BL = jnp.broadcast_to(jnp.arange(Lc, dtype=jnp.int32), (B, Lc))
            kv = dcache
        else:  # read only the window's positions S-W .. S-1 (static size; slots mod Lc)
            pos_BL = S[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None]
            slot_BL = pos_BL % Lc
            kv = [jnp.take_along_axis(c, slot_BL.reshape(slot_BL.shape + (1,) * (c.ndim - 2)), axis=1)
                  for c in dcache]
        valid_BL = (pos_BL < S[:, None]) & (pos_BL >= 0)
        if window is not None:
            valid_BL &= pos_BL >= S[:, None] - window
        return kv, pos_BL, valid_BL

    def block_hidden(self, dparams, target, tparams, dcache, ctx_len_B, bonus_B, window: int | None = None):
        """Final-normed hidden states of the block [bonus, MASK x (bs-1)] at positions S..S+bs-1 -> [B, bs, D]."""
        c = self.cfg
        B = bonus_B.shape[0]
        bs = c.block_size
        if window is not None and window < 1:
            raise DrafterError(f"draft window must be >= 1, got {window}")
        tokens_BT = jnp.concatenate([bonus_B.astype(jnp.int32)[:, None],
                                     jnp.full((B, bs - 1), c.mask_token_id, jnp.int32)], axis=1)
        x_BTD = target.embed(tparams, tokens_BT).astype(self.dtype)
        if c.input_embedding_scale != 1.0:
            x_BTD = x_BTD * jnp.asarray(c.input_embedding_scale, self.dtype)
        pos_BT = ctx_len_B.astype(jnp.int32)[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
        kv, ctx_pos_BL, valid_BL = self._window_view(dcache, ctx_len_B, window)
        return self.module.apply({"params": dparams}, x_BTD, pos_BT, kv, ctx_pos_BL, valid_BL, method=DFlash.block)

    def draft_logits(self, dparams, target, tparams, dcache, ctx_len_B, bonus_B, window: int | None = None,
                     depths: int | None = None):
        """f32 logits [B, bs-1, V]; row i-1 is the draft distribution of the token at position S+i (no shift).

        ctx_len_B = S (committed tokens with context rows in dcache, slots 0..S-1); bonus_B = the token at S.
        window: the drafter sees only context slots S-window .. S-1 (absolute rope positions kept).
        depths: only the first `depths` rows [B, depths, V] (the block still runs whole, so they are the same
        values): a DDTree of budget N never reaches below depth N, and the lm_head is the drafter's largest dot."""
        L = self.cfg.block_size - 1
        if depths is not None and not 1 <= depths <= L:
            raise DrafterError(f"depths={depths} outside 1..{L} (block_size - 1)")
        h_BTD = self.block_hidden(dparams, target, tparams, dcache, ctx_len_B, bonus_B, window)[:, 1:1 + (depths or L)]
        tdt = getattr(target, "dtype", None)
        if tdt is not None:
            h_BTD = h_BTD.astype(tdt)
        head = getattr(target, "draft_head", target.head)  # a faster lm_head where the target has one
        logits = head(tparams, h_BTD).astype(jnp.float32)
        c = self.cfg
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping is not None:
            logits = jnp.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits


def _init_inputs(cfg: DrafterConfig):
    return (jnp.zeros((1, 1, cfg.num_features * cfg.hidden_size), jnp.dtype(cfg.dtype)),
            jnp.zeros((1, 1, cfg.hidden_size), jnp.dtype(cfg.dtype)), jnp.zeros((1, 1), jnp.int32))


def abstract_drafter_params(cfg: DrafterConfig):
    """ShapeDtypeStructs with logical axis names (boxed), without allocating anything."""
    module = DFlash(cfg)
    return jax.eval_shape(lambda k: module.init(k, *_init_inputs(cfg), method=DFlash.init_all),
                          jax.random.PRNGKey(0))["params"]


@functools.lru_cache(maxsize=8)
def _jitted_init(cfg: DrafterConfig):
    module = DFlash(cfg)
    return jax.jit(lambda k: module.init(k, *_init_inputs(cfg), method=DFlash.init_all))


def random_drafter(cfg: DrafterConfig, target=None, seed: int = 0) -> Drafter:
    """Random weights (norm weights perturbed around 1 so tests see them) for tests and benchmarks."""
    from flax.core import meta

    if target is not None:
        check_compatible(cfg, target)
    key = jax.random.PRNGKey(seed)
    params = _jitted_init(cfg)(key)["params"]
    params = meta.unbox(params)
    nkey = jax.random.fold_in(key, 1)

    def perturb(path, x):
        names = [getattr(p, "key", str(p)) for p in path]
        if len(names) >= 2 and names[-1] == "weight" and names[-2].endswith("norm"):
            k = jax.random.fold_in(nkey, zlib.crc32("/".join(names).encode()) % (2 ** 31))
            return (1.0 + 0.1 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
        return x

    params = jax.tree_util.tree_map_with_path(perturb, params)
    return Drafter(cfg, params, source="random", random_weights=True)


# ---------------------------------------------------------------- checkpoints (z-lab format)
INDEX = "model.safetensors.index.json"
_FLOAT_DTYPES = {"BF16", "F16", "F32"}


def _param_name(path: tuple[str, ...]) -> str:
    parts = [p.replace("layers_", "layers.") if p.startswith("layers_") else p for p in path]
    name = ".".join(parts)
    return name if parts[-1] == "weight" else name + ".weight"


def _ckpt_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    if path[-1] in ("q_proj", "k_proj", "v_proj"):
        return (shape[0] * shape[1], shape[2])
    if path[-1] == "o_proj":
        return (shape[0], shape[1] * shape[2])
    return tuple(shape)


def drafter_tensors(cfg: DrafterConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]]:
    """Checkpoint tensor name -> (param path, param shape, checkpoint shape), for every parameter."""
    from flax.core import meta

    flat = jax.tree_util.tree_flatten_with_path(meta.unbox(abstract_drafter_params(cfg)))[0]
    out = {}
    for kp, leaf in flat:
        path = tuple(k.key for k in kp)
        out[_param_name(path)] = (path, tuple(leaf.shape), _ckpt_shape(path, tuple(leaf.shape)))
    return out


def _tensor_files(path: Path) -> dict[str, str]:
    idx = path / INDEX
    if idx.exists():
        try:
            wm = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DrafterError(f"{idx}: not a valid safetensors index ({e})") from None
        return {n: f for n, f in wm.items()}
    if (path / "model.safetensors").exists():
        return {}
    raise DrafterError(f"{path}: no model.safetensors and no {INDEX}")


def load_drafter(path: str | os.PathLike, target, dtype: str | None = None,
                 yarn_attention_factor: str | float | None = None, shardings=None) -> Drafter:
    """Load a z-lab-format DFlash drafter (config.json + model.safetensors or index + shards) for `target`.

    dtype: parameter dtype (default: the target's). yarn_attention_factor: "ratio" | "legacy" | float, overriding
    the config. shardings: optional tree of shardings matching the params."""
    from safetensors import safe_open

    p = Path(path)
    cfg_file = p / "config.json"
    if not cfg_file.exists():
        raise DrafterError(f"{p}: no config.json (expected a z-lab DFlash drafter directory)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DrafterError(f"{cfg_file}: not valid JSON ({e})") from None
    if dtype is None:
        tdt = getattr(target, "dtype", None)
        dtype = jnp.dtype(tdt).name if tdt is not None else "bfloat16"
    try:
        cfg = DrafterConfig.from_hf(hf, dtype=dtype, yarn_attention_factor=yarn_attention_factor)
    except ConfigError as e:
        raise DrafterError(f"{cfg_file}: {e}") from None
    check_compatible(cfg, target)

    want = drafter_tensors(cfg)
    wm = _tensor_files(p)
    files = sorted(set(wm.values())) if wm else ["model.safetensors"]
    handles, where = {}, {}
    for f in files:
        if not (p / f).exists():
            raise DrafterError(f"shard {f} is listed in {INDEX} but missing from {p}")
        try:
            handles[f] = safe_open(str(p / f), framework="np")
        except Exception as e:  # noqa: BLE001 - corrupt header etc.
            raise DrafterError(f"{p / f}: cannot open safetensors file ({e})") from None
        for n in handles[f].keys():
            if not wm or wm.get(n) == f:
                where[n] = f
    if wm:
        lost = [n for n in wm if n not in where]
        if lost:
            raise DrafterError(f"tensor {lost[0]!r} is listed in {INDEX} under {wm[lost[0]]!r} but that shard "
                               "does not contain it")
    missing = sorted(n for n in want if n not in where)
    if missing:
        raise DrafterError(f"drafter checkpoint {p} lacks tensor {missing[0]!r}"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(n for n in where if n not in want)
    if extra:
        raise DrafterError(f"drafter checkpoint {p} has unexpected tensor {extra[0]!r}"
                           + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                           + " for this config")
    for n, (ppath, pshape, cshape) in want.items():
        sl = handles[where[n]].get_slice(n)
        dt, shape = sl.get_dtype(), tuple(sl.get_shape())
        if dt not in _FLOAT_DTYPES:
            raise DrafterError(f"tensor {n!r} has dtype {dt}; expected a float dtype (BF16, F16 or F32)")
        if shape != cshape:
            raise DrafterError(f"tensor {n!r} has shape {list(shape)}; expected {list(cshape)}")

    sh_flat = None
    if shardings is not None:
        sh_flat = {tuple(k.key for k in kp): s for kp, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    np_dt = jnp.dtype(dtype)
    flat = {}
    for n, (ppath, pshape, _) in want.items():
        try:
            arr = handles[where[n]].get_tensor(n)
        except Exception as e:  # noqa: BLE001
            raise DrafterError(f"cannot read tensor {n!r} from {where[n]}: {e}") from None
        arr = np.asarray(arr).astype(np_dt, copy=False).reshape(pshape)
        flat[ppath] = jax.device_put(arr, None if sh_flat is None else sh_flat.get(ppath))
    return Drafter(cfg, unflatten_dict(flat), source=str(p))


def save_drafter(drafter: Drafter, path: str | os.PathLike, dtype: str = "bfloat16") -> Path:
    """Write config.json + model.safetensors in the z-lab format (tensors in `dtype`, default bf16)."""
    from flax.core import meta
    from safetensors.numpy import save_file

    np_dt = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}[dtype]
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    flat = {tuple(k.key for k in kp): v
            for kp, v in jax.tree_util.tree_flatten_with_path(meta.unbox(drafter.params))[0]}
    tensors = {}
    for n, (ppath, _, cshape) in drafter_tensors(drafter.cfg).items():
        if ppath not in flat:
            raise DrafterError(f"drafter params lack {'/'.join(ppath)} (tensor {n!r})")
        tensors[n] = np.ascontiguousarray(np.asarray(jax.device_get(flat[ppath])).astype(np_dt).reshape(cshape))
    save_file(tensors, str(p / "model.safetensors"), metadata={"format": "pt"})
    cfg_hf = drafter.cfg.to_hf()
    cfg_hf["torch_dtype"] = dtype
    (p / "config.json").write_text(json.dumps(cfg_hf, indent=1))
    return p


__all__ = ["DrafterConfig", "DrafterError", "DFlash", "Drafter", "KIMI_K25_DFLASH", "default_target_layer_ids",
           "check_compatible", "random_drafter", "load_drafter", "save_drafter", "drafter_tensors"]
