"""The embedded default model that `python -m kimijax.decode` runs without --model.

Until the real small model lands this is a tiny Kimi-architecture checkpoint with RANDOM weights, written
once by this code in the real HF layout (config.json, index, odd-named shards, INT4 experts) with a tiny
Kimi-style tiktoken tokenizer, so the CLI exercises the same loader path as the real 590 GB checkpoint.
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


def embedded_default_dir() -> Path:
    """Write (once) and return the embedded tiny random-weight checkpoint directory."""
    from kimijax.loading import save_hf_checkpoint
    from kimijax.models.drafter import random_drafter, save_drafter
    from kimijax.target import random_kimi_params
    from kimijax.tokenizer import write_tiny_tokenizer

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
