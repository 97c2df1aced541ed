"""The target interface the engine and the drafter use, and its Kimi implementation.

A target holds params and knows four pure functions (params passed explicitly so jitted programs never
close over weights):
  prefill(params, caches, tokens_BT, lens_B, capture)        prompt pass from an empty cache
  verify(params, caches, tokens_BT, positions_BT, lengths_B, tree_mask_BTT, capture)
                                                             T new tokens over the committed cache (AR step: T=1)
  embed(params, tokens) / head(params, h)                    shared with the drafter
Caches are a list (one entry per layer) of arrays whose axis 1 is the cache slot ([B, L, ...]).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from kimijax.config import KimiConfig
from kimijax.models.kimi import Kimi
from pallas_kernels.row_move import move_rows


def gather_rows(x_BT, idx_B):
    return x_BT[jnp.arange(x_BT.shape[0]), idx_B]


def compact_caches(caches, lengths_B, path_BP, n_B, impl: str = "xla"):
    """Move accepted tree rows to the committed slots: slot S+path[j] -> S+j for j < n.

    path is strictly increasing with path[j] >= j, so reading every source row before writing is safe.
    Rows j >= n are left unchanged. impl "xla": one fusion per cache; "pallas" / "interpret": one kernel for
    all caches (pallas_kernels/row_move.py).
    """
    return move_rows(caches, lengths_B[:, None] + path_BP, lengths_B, n_B, impl)


class TargetBase:
    """What every target shares, around `self.cfg` and `self.module` (a flax model with embed, logits and a
    __call__(tokens, positions, caches, lengths, tree_mask, <PREFILL_MODE>=..., capture_layers=...)): the facts
    the engine needs and the pure functions that do not differ between models. A subclass builds self.module and
    self._forward = jax.jit(self._forward_fn), and writes verify and init_cache."""
    PREFILL_MODE: dict = {}  # the model's keyword for "a prompt pass from slot 0, not over the cache"

    # ---- facts the engine needs
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def num_layers(self) -> int:
        return self.cfg.num_hidden_layers

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.cfg.eos_token_ids)

    @property
    def max_context(self) -> int:
        return self.cfg.max_position_embeddings

    @property
    def dtype(self):
        return jnp.dtype(self.cfg.dtype)

    # ---- pure functions
    def _apply(self, params, *args, method=None, **kw):
        return self.module.apply({"params": params}, *args, method=method, **kw)

    def embed(self, params, tokens):
        return self._apply(params, tokens, method=type(self.module).embed)

    def head(self, params, h_BTD):
        return self._apply(params, h_BTD, method=type(self.module).logits)

    def prefill(self, params, caches, tokens_BT, lens_B, capture=()):
        """Prompt pass writing cache slots 0..T-1. -> (last-token logits [B,V] f32, caches, captured [n,B,T,D])."""
        B, T = tokens_BT.shape
        pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        h, caches, cap = self._apply(params, tokens_BT, pos_BT, caches, jnp.zeros((B,), jnp.int32),
                                     None, capture_layers=tuple(capture), **self.PREFILL_MODE)  # None: causal
        h_last = gather_rows(h, lens_B - 1)[:, None]
        return self.head(params, h_last)[:, 0], caches, cap

    def _forward_fn(self, params, tokens_BT):
        B, T = tokens_BT.shape
        pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        h, _, _ = self._apply(params, tokens_BT, pos_BT)
        return self.head(params, h)

    def forward(self, tokens_BT):
        """Full-sequence forward without a cache -> f32 logits [B, T, V]."""
        return self._forward(self.params, jnp.asarray(tokens_BT, jnp.int32))


@dataclasses.dataclass
class KimiTarget(TargetBase):
    PREFILL_MODE = {"absorbed": False}  # naive MLA for the prompt; verify runs absorbed MLA over the cache
    cfg: KimiConfig
    params: Any
    attn_impl: str = "xla"
    moe_impl: str = "xla"
    tokenizer: Any = None
    name: str = "kimi"
    random_weights: bool = False
    source: str = ""
    expert_fn: Any = None  # routed-expert override (expert parallelism); see sharding/moe_ep.py
    attn_fn: Any = None  # tree-attention override (heads over "tensor"); see sharding/attention_tp.py
    mesh: Any = None  # a sharding.mesh mesh: params are expected on it (sharding.rules); caches are put on it
    # INT4 routed experts in memory: "checkpoint", "kernel" (the Pallas MoE's layout) or "auto" (kernel when
    # moe_impl is a kernel and the shapes allow it). Params arriving in the other layout are converted once,
    # into a copy (the caller may still hold them); load_target converts in place (donated) before this.
    expert_layout: str = "auto"
    # One-row RMSNorms (decode steps) as one kernel instead of XLA's two launches: "pallas" / "interpret" / "xla";
    # None: `default_kernel_impl("rms_norm")`, "xla" until timed (pallas_kernels/rms_norm.py). Passes of 2+ rows: XLA.
    norm_impl: str | None = None

    def __post_init__(self):
        from pallas_kernels.moe_int4 import IMPLS
        if self.moe_impl not in IMPLS:
            raise ValueError(f"unknown MoE impl {self.moe_impl!r}: choose one of {', '.join(IMPLS)}")
        from pallas_kernels import rms_norm
        if self.norm_impl is None:
            from kimijax.loading import default_kernel_impl
            self.norm_impl = default_kernel_impl("rms_norm")
        if self.norm_impl not in rms_norm.IMPLS:
            raise ValueError(f"unknown RMSNorm impl {self.norm_impl!r}: choose one of {', '.join(rms_norm.IMPLS)}")
        if self.mesh is not None and self.expert_fn is None:
            from sharding.moe_ep import make_expert_fn
            self.expert_fn = make_expert_fn(self.mesh)
        if self.mesh is not None and self.attn_fn is None:  # a Pallas kernel would run all heads on every device
            from sharding.attention_tp import make_attention_fn
            self.attn_fn = make_attention_fn(self.mesh)
        want = resolve_expert_layout(self.cfg, self.moe_impl, self.mesh, self.expert_layout)
        if self.params is not None and params_expert_layout(self.params) != want:
            self.params = convert_expert_layout(self.params, want, self.mesh)
        self.expert_layout = want
        self.module = Kimi(self.cfg, self.attn_impl, self.moe_impl, self.expert_fn, want, self.attn_fn, self.norm_impl)
        self._forward = jax.jit(self._forward_fn)

    def init_cache(self, B: int, L: int):
        if self.mesh is not None:  # batch over "data", replicated over "expert"/"tensor" (sharding/rules.py)
            from sharding.rules import cache_shardings
            return [jnp.zeros((B, L, self.cfg.latent_dim), self.dtype, device=s)
                    for s in cache_shardings(self.cfg, self.mesh, B)]
        return [jnp.zeros((B, L, self.cfg.latent_dim), self.dtype) for _ in range(self.num_layers)]

    def on_mesh(self, mesh, layout: str | None = None, dispatch: str = "auto") -> "KimiTarget":
        """This target on a device mesh: params resharded by sharding.rules, routed experts through
        sharding.moe_ep (for loading straight onto a mesh use load_target(path, mesh=..., layout=...))."""
        from sharding.mesh import mesh_sizes
        from sharding.moe_ep import make_expert_fn
        from sharding.rules import param_shardings
        kernel_layout = self.expert_layout in ("kernel", "mgpu")
        if kernel_layout and _layout_ok(self.cfg, self.expert_layout, mesh_sizes(mesh)["tensor"]):
            # the kernels' layouts split along F like the checkpoint layout does: reshard, no conversion
            params = jax.device_put(self.params, param_shardings(abstract_params(self.cfg, self.expert_layout), mesh,
                                                                 layout))
            layout_pref = self.expert_layout
        else:  # via the checkpoint layout (the kernel's layout does not fit this mesh's tensor axis, or is not used)
            params = convert_expert_layout(self.params, "checkpoint")
            params = jax.device_put(params, param_shardings(self.cfg, mesh, layout))
            layout_pref = "auto" if kernel_layout else self.expert_layout
        return dataclasses.replace(self, params=params, mesh=mesh, expert_fn=make_expert_fn(mesh, dispatch),
                                   attn_fn=None, expert_layout=layout_pref)  # attn_fn: rebuilt for this mesh

    # ---- pure functions (TargetBase: embed, head, prefill, forward)
    def tree_topk(self, logits_BLV, K: int):
        """Per-depth top-K log-probs and token ids of draft logits [B, L, V] (the DDTree input). On a mesh the
        vocab-sharded logits are never gathered: per-shard top-K merged in global ids (sharding/vocab.py)."""
        from sharding.vocab import topk_logprobs
        return topk_logprobs(logits_BLV, K, self.mesh)  # without a mesh: ddtree.topk_logprobs

    def verify(self, params, caches, tokens_BT, positions_BT, lengths_B, tree_mask_BTT, capture=(),
               with_experts: bool = False):
        """T new tokens at cache slots lengths..lengths+T-1 (absorbed MLA). -> (logits [B,T,V] f32, caches, captured[, ids])."""
        out, state = self._apply(params, tokens_BT, positions_BT, caches, lengths_B, tree_mask_BTT,
                                 absorbed=True, capture_layers=tuple(capture), mutable=["intermediates"])
        h, caches, cap = out
        logits = self.head(params, h)
        if with_experts:
            return logits, caches, cap, expert_ids(state, self.cfg)
        return logits, caches, cap


def expert_ids(state, cfg: KimiConfig):
    """Routed expert ids per MoE layer from the sown intermediates -> int32 [n_moe, B, T, k]."""
    inter = state.get("intermediates", {})
    ids = [inter[f"layers_{i}"]["mlp"]["expert_ids"][0] for i in range(cfg.num_hidden_layers)
           if cfg.is_moe_layer(i) and f"layers_{i}" in inter]
    return jnp.stack(ids) if ids else jnp.zeros((0,), jnp.int32)


from pallas_kernels.moe_int4_mgpu import MGPU_KEYS  # noqa: E402 (the expert dict keys of each layout)
from pallas_kernels.moe_layout import _CKPT_KEYS, _PLANAR_KEYS  # noqa: E402

EXPERT_KEYS = {"checkpoint": _CKPT_KEYS, "kernel": _PLANAR_KEYS, "mgpu": MGPU_KEYS}
# The MoE implementations whose kernel has a layout of its own (moe_int4.IMPLS)
LAYOUT_OF_IMPL = {"pallas": "kernel", "interpret": "kernel", "mgpu": "mgpu", "mgpu_interpret": "mgpu"}


def _layout_ok(cfg: KimiConfig, layout: str, tp: int) -> bool:
    from pallas_kernels.moe_layout import kernel_layout_ok

    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    if not cfg.experts_int4:
        return False
    if layout == "kernel":  # 128-input superblocks, within an F shard
        return kernel_layout_ok(D, F, tp)
    return D % 64 == 0 and F % tp == 0 and (F // tp) % 64 == 0  # mgpu: [64, 32] tiles, within an F shard


def resolve_expert_layout(cfg: KimiConfig, moe_impl: str, mesh=None, want: str = "auto") -> str:
    """The routed-expert layout a target keeps: the layout of the MoE kernel that runs ("kernel" for the
    Triton kernel, "mgpu" for the Mosaic one) when D and F (per tensor shard) suit its tiles, else
    "checkpoint". An explicit layout the shapes or weights do not allow raises ValueError."""
    if want not in ("auto", *EXPERT_KEYS):
        raise ValueError(f"unknown expert layout {want!r}: choose auto, {', '.join(EXPERT_KEYS)}")
    if want == "checkpoint":
        return want
    tp = 1
    if mesh is not None:
        from sharding.mesh import mesh_sizes
        tp = mesh_sizes(mesh)["tensor"]
    layout = LAYOUT_OF_IMPL.get(moe_impl) if want == "auto" else want
    if layout is None:
        return "checkpoint"
    ok = _layout_ok(cfg, layout, tp)
    if want != "auto" and not ok:
        tile = 128 if layout == "kernel" else 64
        raise ValueError(f"the {layout} expert layout needs INT4 experts with hidden_size and moe_intermediate_size"
                         f"/{tp} divisible by {tile} (got int4={cfg.experts_int4}, D={cfg.hidden_size}, "
                         f"F={cfg.moe_intermediate_size})")
    return layout if ok else "checkpoint"


def _layer_layout(mlp) -> str | None:
    return next((name for name, keys in EXPERT_KEYS.items() if keys[0] in mlp), None)


def _moe_blocks(params):
    """(layer name, mlp dict) of every layer whose routed experts are INT4."""
    for name, layer in params.items():
        mlp = layer.get("mlp") if hasattr(layer, "get") else None
        if mlp is not None and _layer_layout(mlp) is not None:
            yield name, mlp


def params_expert_layout(params) -> str:
    for _, mlp in _moe_blocks(params):
        return _layer_layout(mlp)
    return "checkpoint"  # no INT4 experts: nothing to convert


def _relayout_fn(src: str, dst: str):
    """The expert-dict conversion src -> dst (through the checkpoint layout)."""
    from pallas_kernels.moe_int4_mgpu import from_mgpu_layout, to_mgpu_layout
    from pallas_kernels.moe_layout import relayout_for_kernel, relayout_to_checkpoint

    to_ckpt = {"checkpoint": lambda e: e, "kernel": relayout_to_checkpoint, "mgpu": from_mgpu_layout}[src]
    from_ckpt = {"checkpoint": lambda e: e, "kernel": relayout_for_kernel,
                 "mgpu": functools.partial(to_mgpu_layout, words=True)}[dst]
    return lambda experts: from_ckpt(to_ckpt(experts))


def convert_expert_layout(params, layout: str, mesh=None, donate: bool = False, progress: bool = False):
    """Params with every layer's INT4 routed experts in `layout` (a key of EXPERT_KEYS); other leaves are
    shared, not copied. One jitted conversion per layer, so the temporary is one layer's experts; donate=True
    (load time, when nothing else holds the params) frees each layer's old arrays as it goes. On a mesh the
    converted arrays get the shardings of the new layout's logical axes (the transposed scales swap theirs)."""
    import warnings

    if layout not in EXPERT_KEYS:
        raise ValueError(f"unknown expert layout {layout!r}: choose {', '.join(EXPERT_KEYS)}")
    out = dict(params)
    todo = [(name, mlp) for name, mlp in _moe_blocks(params) if _layer_layout(mlp) != layout]
    if not todo:
        return params
    converts = {}
    if progress:
        from tqdm.auto import tqdm
        todo = tqdm(todo, desc=f"experts -> {layout} layout", unit="layer")
    for name, mlp in todo:
        src = _layer_layout(mlp)
        experts = {k: mlp[k] for k in EXPERT_KEYS[src]}
        if src not in converts:
            fn = _relayout_fn(src, layout)
            out_sh = None
            if mesh is not None:
                from jax.sharding import NamedSharding
                from sharding.moe_ep import expert_specs
                shapes = jax.eval_shape(fn, experts)
                out_sh = {k: NamedSharding(mesh, p) for k, p in expert_specs(shapes, mesh).items()}
            converts[src] = jax.jit(fn, out_shardings=out_sh, donate_argnums=(0,) if donate else ())
        with warnings.catch_warnings():  # backends without donation say so once per call
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            new = converts[src](experts)
        out[name] = {**params[name], "mlp": {**{k: v for k, v in mlp.items() if k not in EXPERT_KEYS[src]}, **new}}
    return out


def random_kimi_params(cfg: KimiConfig, seed: int = 0):
    """Random weights (INT4 experts in the checkpoint layout) for tests and benchmarks."""
    from flax.core import meta

    module = Kimi(cfg)
    toks = jnp.zeros((1, 2), jnp.int32)
    params = jax.jit(lambda k: module.init(k, toks, method=Kimi.init_all))(jax.random.PRNGKey(seed))["params"]
    return meta.unbox(params)


def abstract_params(cfg: KimiConfig, expert_layout: str = "checkpoint"):
    """ShapeDtypeStructs with logical axis names (boxed), without allocating anything."""
    module = Kimi(cfg, expert_layout=expert_layout)
    toks = jnp.zeros((1, 2), jnp.int32)
    return jax.eval_shape(lambda k: module.init(k, toks, method=Kimi.init_all), jax.random.PRNGKey(0))["params"]
