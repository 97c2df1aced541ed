#!/usr/bin/env python3
"""Build tiny random Kimi-K2 (DeepSeek-V3 architecture) test fixtures.

Each fixture is a directory in the *real Kimi checkpoint layout* plus the
outputs that HF ``transformers`` (4.57.x, torch CPU, float32, eager attention)
produces for it. The kimijax loader and forward pass are tested against them.

Fixtures written (one directory each under ``--out``):

``k26_int4``
    K2.5/K2.6 multimodal nesting: top-level ``config.json`` with
    ``model_type: kimi_k25`` and the text model in ``text_config`` (with a
    compressed-tensors ``quantization_config``). Weights are prefixed
    ``language_model.model.`` / ``language_model.lm_head.weight``; a few dummy
    ``vision_tower.*`` / ``mm_projector.*`` tensors are mixed in (a text
    loader must skip them). Routed experts are INT4 "pack-quantized"
    (``weight_packed`` I32, ``weight_scale`` BF16, ``weight_shape`` I64),
    produced by compressed-tensors' own quantize + pack path.
``k2_flat_bf16``
    K2/K2-Thinking-style flat text config (``model_type: kimi_k2``), BF16
    experts as plain ``.weight``, prefix ``model.``, YaRN factor 32 with
    beta_fast 1.0, rms_norm_eps 1e-6.
``k2_groups``
    Flat layout, BF16 experts, group-limited routing (16 experts, top-4,
    n_group 4, topk_group 2) with non-negative ``e_score_correction_bias``.

Every fixture directory holds ``config.json``, ``model.safetensors.index.json``,
two shards ``model-00001-of-000002.safetensors`` /
``model-00002-of-000002.safetensors`` (split inside layer 1, so one layer --
and in ``k26_int4`` one quantized module -- spans both shards) and
``expected.npz``:

* ``tokens``              int32   [2, 12]
* ``logits``              float32 [2, 12, V]
* ``hidden_states``       float32 [L+1, 2, 12, D]; index 0 = embeddings,
  index l+1 = output of decoder layer l (*before* the final norm; note HF
  4.57's own ``output_hidden_states[-1]`` is the *post*-norm state)
* ``final_hidden``        float32 [2, 12, D]  (after ``model.norm``)
* ``router_topk_idx``     int32   [L_moe, 2, 12, k]  selected experts, sorted
  ascending per token
* ``router_topk_weight``  float32 [L_moe, 2, 12, k]  combine weights (already
  normalized and multiplied by routed_scaling_factor), aligned with the idx

All stored weights are BF16 except ``mlp.gate.e_score_correction_bias`` (F32)
and the INT4 triples. The HF reference runs in float32 on exactly the saved
values (weights are rounded to bf16 first; INT4 experts use compressed-tensors'
dequantized bf16 values), so the reference is exact for the checkpoint.

The script is deterministic (fixed seeds, single-threaded torch, fixed zip
timestamps) and needs no network. After writing, it reloads every fixture from
disk through the index (with an independent INT4 unpacker), loads it into a
fresh HF model with ``strict=True`` and checks that the logits reproduce.

Usage::

    /work/venv311/bin/python scripts/make_fixtures.py --out tests/fixtures
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import zipfile
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # compressed-tensors progress bars
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

N_BATCH, N_SEQ = 2, 12
SHARD_NAMES = ("model-00001-of-000002.safetensors", "model-00002-of-000002.safetensors")

# Verbatim K2.5 text_config quantization block (reference doc section 1.3).
K25_QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


# --------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------


def base_text_config() -> dict:
    """Kimi-style text config (field set of the real K2.5 text_config)."""
    factor = 64.0
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "kv_lora_rank": 32,
        "max_position_embeddings": int(factor * 4096),
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "q_lora_rank": 48,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": factor,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 16,
        "vocab_size": 512,
    }


def variant_specs() -> dict:
    specs = {}

    # 1. K2.6: multimodal nesting, INT4 experts.
    tc = base_text_config()
    tc["quantization_config"] = copy.deepcopy(K25_QUANTIZATION_CONFIG)
    specs["k26_int4"] = dict(
        seed=2606,
        text_config=tc,
        nested=True,
        int4=True,
        prefix="language_model.model.",
        head_name="language_model.lm_head.weight",
        bias="normal",
    )

    # 2. K2 / K2-Thinking flat layout, bf16 experts, K2-style YaRN.
    tc = base_text_config()
    tc["rope_scaling"]["beta_fast"] = 1.0
    tc["rope_scaling"]["factor"] = 32.0
    tc["max_position_embeddings"] = 32 * 4096
    tc["rms_norm_eps"] = 1e-6
    specs["k2_flat_bf16"] = dict(
        seed=2002,
        text_config=tc,
        nested=False,
        int4=False,
        prefix="model.",
        head_name="lm_head.weight",
        bias="normal",
    )

    # 3. Flat layout, group-limited routing.
    tc = base_text_config()
    tc.update(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    specs["k2_groups"] = dict(
        seed=2004,
        text_config=tc,
        nested=False,
        int4=False,
        prefix="model.",
        head_name="lm_head.weight",
        bias="uniform_nonneg",
    )
    return specs


def top_level_config(spec: dict) -> dict:
    tc = spec["text_config"]
    if not spec["nested"]:
        return tc
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": tc["bos_token_id"],
        "eos_token_id": tc["eos_token_id"],
        "pad_token_id": tc["pad_token_id"],
        "media_placeholder_token_id": 3,
        "model_type": "kimi_k25",
        "text_config": tc,
        "tie_word_embeddings": False,
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": {
            "init_pos_emb_height": 4,
            "init_pos_emb_time": 2,
            "init_pos_emb_width": 4,
            "merge_kernel_size": [2, 2],
            "merge_type": "sd2_tpool",
            "mm_hidden_size": 16,
            "mm_projector_type": "patchmerger",
            "patch_size": 2,
            "pos_emb_type": "divided_fixed",
            "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-5,
            "text_hidden_size": tc["hidden_size"],
            "video_attn_type": "spatial_temporal",
            "vt_hidden_size": 16,
            "vt_intermediate_size": 32,
            "vt_num_attention_heads": 2,
            "vt_num_hidden_layers": 1,
        },
    }


def hf_config(text_config: dict):
    from transformers import DeepseekV3Config

    drop = {"architectures", "model_type", "quantization_config", "torch_dtype"}
    kw = {k: copy.deepcopy(v) for k, v in text_config.items() if k not in drop}
    cfg = DeepseekV3Config(**kw, attn_implementation="eager")
    assert cfg.rope_interleave is True  # HF default; Kimi checkpoints assume interleaved pairs
    assert cfg.num_key_value_heads == cfg.num_attention_heads
    return cfg


# --------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------


def bf16_round(t):
    import torch

    return t.to(torch.bfloat16).to(torch.float32)


def randomize_(model, spec: dict, gen) -> None:
    """Overwrite every parameter/buffer of the fp32 HF model, in model order.

    Linear weights: N(0, 1/fan_in) (unit-variance outputs); embeddings N(0, 1);
    RMSNorm weights 1 + 0.1 N(0, 1); router bias per ``spec['bias']``. All but
    the router bias are rounded to bf16 (the values saved to the checkpoint).
    """
    import torch

    cfg = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                v = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            elif name.endswith("embed_tokens.weight"):
                v = torch.randn(shape, generator=gen)
            elif len(shape) == 2:
                v = torch.randn(shape, generator=gen) / float(np.sqrt(shape[1]))
            else:
                raise AssertionError(f"unexpected parameter {name} {shape}")
            p.copy_(bf16_round(v))
        n_bias = 0
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                if spec["bias"] == "uniform_nonneg":
                    v = 0.5 * torch.rand(tuple(b.shape), generator=gen)
                else:
                    v = 0.1 * torch.randn(tuple(b.shape), generator=gen)
                b.copy_(v.to(torch.float32))  # stored F32, not rounded
                n_bias += 1
        assert n_bias == cfg.num_hidden_layers - cfg.first_k_dense_replace


EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj$")


def unpack_int4_numpy(packed: np.ndarray, scale_f32: np.ndarray, shape) -> tuple[np.ndarray, np.ndarray]:
    """Independent INT4 unpack: element c of a row is in bits 4*(c%8).. of word
    c//8, stored as q+8. Returns (q int8 [out,in], q*scale as float32 (exact))."""
    out_f, in_f = (int(s) for s in shape)
    assert packed.dtype == np.int32 and packed.shape == (out_f, in_f // 8)
    words = packed.view(np.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, None, :]
    nib = (words[:, :, None] >> shifts) & np.uint32(0xF)
    q = nib.reshape(out_f, in_f).astype(np.int8) - np.int8(8)
    assert scale_f32.shape == (out_f, in_f // 32)
    w = q.astype(np.float32) * np.repeat(scale_f32, 32, axis=1)  # exact in fp32
    return q, w


def quantize_experts_int4(model, quant_config: dict):
    """Quantize + pack every routed expert with compressed-tensors' own
    lifecycle (apply_quantization_config -> qparams -> ModelCompressor
    compress / decompress). Returns (compressed tensors by HF name,
    dequantized bf16 weights by HF module name)."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    # Worked example from the reference doc (section 3.3): nibble order + offset.
    ex = pack_to_int32(torch.tensor([[5, 5, 5, 6, -3, -5, -7, 5]], dtype=torch.int8), 4)
    assert ex.view(torch.uint32).item() == 0xD135EDDD, hex(ex.view(torch.uint32).item())
    assert np.array_equal(unpack_int4_numpy(np.tile(ex.numpy(), (1, 4)), np.ones((1, 1), np.float32), (1, 32))[0][0, :8],
                          [5, 5, 5, 6, -3, -5, -7, 5])

    qcfg = QuantizationConfig.model_validate(quant_config)
    mq = copy.deepcopy(model).to(torch.bfloat16)  # weights are already bf16 values
    init_cfg = copy.deepcopy(qcfg)
    init_cfg.quantization_status = QuantizationStatus.FROZEN
    apply_quantization_config(mq, init_cfg, show_progress=False)

    cfg = model.config
    qmods = {n: m for n, m in mq.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    # The ignore list must leave exactly the routed experts quantized.
    want = {
        f"model.layers.{i}.mlp.experts.{j}.{p}_proj"
        for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers)
        for j in range(cfg.n_routed_experts)
        for p in ("gate", "up", "down")
    }
    assert set(qmods) == want, sorted(set(qmods) ^ want)[:10]

    master = {}
    for n, m in qmods.items():
        # Per-group min/max -> symmetric scale = absmax / 7.5 (the "minmax"
        # observer math, via compressed-tensors' calculate_qparams).
        scale, zp = compute_dynamic_scales_and_zp(m.weight.data, m.quantization_scheme.weights, module=m)
        assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (m.out_features, m.in_features // 32)
        m.weight_scale.data.copy_(scale)
        m.weight_zero_point.data.copy_(zp)
        master[n] = m.weight.data.clone()

    compressor = ModelCompressor(quantization_config=qcfg)
    compressor.compress_model(mq)
    sd = mq.state_dict()
    compressed = {}
    for n in qmods:
        assert n + ".weight" not in sd
        assert n + ".weight_zero_point" not in sd  # symmetric: dropped
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            compressed[f"{n}.{suffix}"] = sd[f"{n}.{suffix}"].detach().clone()

    md = copy.deepcopy(mq)
    compressor.decompress_model(md)
    sd_d = md.state_dict()
    dequant = {}
    for n in qmods:
        w_ct = sd_d[n + ".weight"].detach().clone()
        assert w_ct.dtype == torch.bfloat16
        packed = compressed[n + ".weight_packed"]
        scale = compressed[n + ".weight_scale"]
        shape = compressed[n + ".weight_shape"]
        out_f, in_f = (int(s) for s in shape)
        assert packed.dtype == torch.int32 and tuple(packed.shape) == (out_f, in_f // 8)
        assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (out_f, in_f // 32)
        assert shape.dtype == torch.int64 and tuple(shape.tolist()) == tuple(master[n].shape)
        # Our own unpack must reproduce compressed-tensors' unpack + dequant.
        q_np, w_np = unpack_int4_numpy(packed.numpy(), scale.float().numpy(), shape.tolist())
        q_ct = unpack_from_int32(packed, 4, torch.Size(shape.tolist()))
        assert np.array_equal(q_np, q_ct.numpy()), n
        assert q_np.min() >= -8 and q_np.max() <= 7
        w_mine = torch.from_numpy(w_np).to(torch.bfloat16)  # CT multiplies in bf16
        assert torch.equal(w_mine, w_ct), n
        # Sanity: quantization error is about half a step. The bf16 scale
        # (absmax / 7.5, rounded) and CT's bf16 division W/scale add a few
        # 2^-8 relative errors, and +absmax clamps to q=7 (observed <= 0.534).
        err = (w_ct.float() - master[n].float()).abs()
        step = scale.float().repeat_interleave(32, dim=1)
        assert bool((err <= 0.55 * step).all()), (n, float((err / step).max()))
        dequant[n] = w_ct
    # At least some nibbles must use the full range (both -8 and 7 appear).
    all_q = np.concatenate(
        [unpack_int4_numpy(compressed[n + ".weight_packed"].numpy(), compressed[n + ".weight_scale"].float().numpy(),
                           compressed[n + ".weight_shape"].tolist())[0].ravel() for n in qmods])
    assert all_q.min() == -8 and all_q.max() == 7
    return compressed, dequant


def dummy_vision_tensors(gen) -> dict:
    import torch

    def r(*shape):
        return (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)

    return {
        "mm_projector.pre_norm.weight": (1.0 + r(16).float()).to(torch.bfloat16),
        "mm_projector.pre_norm.bias": r(16),
        "mm_projector.proj.0.weight": r(64, 64),
        "mm_projector.proj.0.bias": r(64),
        "mm_projector.proj.2.weight": r(64, 64),
        "mm_projector.proj.2.bias": r(64),
        "vision_tower.patch_embed.proj.weight": r(16, 3, 2, 2),
        "vision_tower.patch_embed.proj.bias": r(16),
        "vision_tower.encoder.blocks.0.wqkv.weight": r(48, 16),
        "vision_tower.encoder.blocks.0.wo.weight": r(16, 16),
        "vision_tower.encoder.blocks.0.mlp.fc0.weight": r(32, 16),
        "vision_tower.encoder.blocks.0.mlp.fc1.weight": r(16, 32),
    }


# --------------------------------------------------------------------------
# reference run
# --------------------------------------------------------------------------


def run_reference(model, tokens: np.ndarray) -> dict:
    """Run the fp32 HF model; capture embeddings, per-layer outputs (pre-norm),
    final hidden, logits, and router decisions with selection margins."""
    import torch

    cfg = model.config
    cap = {"layers": [], "routers": []}
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, a, o: cap.__setitem__("embed", o.detach().clone()))]
    for layer in model.model.layers:
        hooks.append(layer.register_forward_hook(lambda m, a, o: cap["layers"].append(
            (o[0] if isinstance(o, tuple) else o).detach().clone())))
        if hasattr(layer.mlp, "gate"):
            def router_hook(m, a, o):
                x = a[0].reshape(-1, cfg.hidden_size).float()
                cap["routers"].append((x.clone(), o[0].detach().clone(), o[1].detach().clone(), m))
            hooks.append(layer.mlp.gate.register_forward_hook(router_hook))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(tokens).long(), output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()

    L = cfg.num_hidden_layers
    assert len(cap["layers"]) == L
    hs = [cap["embed"]] + cap["layers"]
    # HF 4.57 hidden_states: [emb, layer0, ..., layer_{L-2}, norm(layer_{L-1})]
    assert len(out.hidden_states) == L + 1
    for i in range(L):
        assert torch.equal(out.hidden_states[i], hs[i]), i
    with torch.no_grad():
        final = model.model.norm(hs[-1])
    assert torch.equal(out.hidden_states[L], final)

    k = cfg.num_experts_per_tok
    idx_all, w_all, sel_margin, grp_margin = [], [], [], []
    bias_changes = 0
    for x, idx, w, m in cap["routers"]:
        with torch.no_grad():
            scores = torch.sigmoid(x @ m.weight.float().t())
            choice = scores + m.e_score_correction_bias[None]
            ng, E = cfg.n_group, cfg.n_routed_experts
            if ng > 1:
                gs = choice.view(-1, ng, E // ng).topk(2, dim=-1)[0].sum(-1)
                gsort = gs.sort(dim=-1, descending=True)[0]
                grp_margin.append(float((gsort[:, cfg.topk_group - 1] - gsort[:, cfg.topk_group]).min()))
                keep = torch.zeros_like(gs).scatter_(1, gs.topk(cfg.topk_group, dim=-1)[1], 1.0)
                mask = keep[:, :, None].expand(-1, ng, E // ng).reshape(-1, E).bool()
                choice = choice.masked_fill(~mask, float("-inf"))
            csort = choice.sort(dim=-1, descending=True)[0]
            sel_margin.append(float((csort[:, k - 1] - csort[:, k]).min()))
            # our -inf-masked recomputation must select the same set as HF
            mine = choice.topk(k, dim=-1)[1].sort(dim=-1)[0]
            order = idx.sort(dim=-1)
            assert torch.equal(mine, order[0])
            no_bias = scores.topk(k, dim=-1)[1].sort(dim=-1)[0]
            bias_changes += int((no_bias != order[0]).any(dim=-1).sum())
        idx_all.append(order[0].to(torch.int32).reshape(N_BATCH, N_SEQ, k))
        w_all.append(torch.gather(w, 1, order[1]).reshape(N_BATCH, N_SEQ, k))

    return {
        "logits": out.logits.float().numpy(),
        "hidden_states": torch.stack(hs).float().numpy(),
        "final_hidden": final.float().numpy(),
        "router_topk_idx": torch.stack(idx_all).numpy(),
        "router_topk_weight": torch.stack(w_all).float().numpy(),
        "_sel_margin": min(sel_margin),
        "_grp_margin": min(grp_margin) if grp_margin else None,
        "_bias_changes": bias_changes,
    }


# --------------------------------------------------------------------------
# writing / reloading
# --------------------------------------------------------------------------


def write_npz(path: Path, arrays: dict) -> None:
    """np.savez_compressed equivalent with fixed zip timestamps (byte-deterministic)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key, arr in arrays.items():
            zi = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            zi.compress_type = zipfile.ZIP_DEFLATED
            with zf.open(zi, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)


def checkpoint_tensors(model, spec: dict, compressed: dict | None, gen) -> list:
    """Ordered list of (checkpoint name, tensor) in the real layout/dtypes."""
    import torch

    sd = model.state_dict()
    out = []
    for name, t in sd.items():
        mod = name.rsplit(".", 1)[0]
        if compressed is not None and EXPERT_RE.match(mod):
            assert name.endswith(".weight")
            for suffix in ("weight_packed", "weight_scale", "weight_shape"):
                out.append((f"{mod}.{suffix}", compressed[f"{mod}.{suffix}"]))
            continue
        if name.endswith("e_score_correction_bias"):
            t = t.to(torch.float32)
        else:
            t = t.to(torch.bfloat16)
            assert torch.equal(t.float(), sd[name]), name  # exact bf16 values
        out.append((name, t))
    renamed = []
    for name, t in out:
        if name == "lm_head.weight":
            new = spec["head_name"]
        else:
            assert name.startswith("model."), name
            new = spec["prefix"] + name[len("model."):]
        renamed.append((new, t.contiguous()))
    if spec["nested"]:
        vis = list(dummy_vision_tensors(gen).items())
        mm = [kv for kv in vis if kv[0].startswith("mm_projector.")]
        vt = [kv for kv in vis if kv[0].startswith("vision_tower.")]
        renamed = mm + renamed + vt  # unrelated tensors in both shards
    return renamed


def shard_split(tensors: list, spec: dict, cfg) -> int:
    """Index after which shard 2 starts: right after the first tensor of
    layer-1 expert E/2's gate_proj (its weight_packed in the INT4 case), so
    layer 1 -- and for INT4 one quantized module -- spans both shards."""
    j = cfg.n_routed_experts // 2
    target = f"{spec['prefix']}layers.1.mlp.experts.{j}.gate_proj." + ("weight_packed" if spec["int4"] else "weight")
    names = [n for n, _ in tensors]
    return names.index(target) + 1


def save_fixture(d: Path, spec: dict, tensors: list, cut: int, arrays: dict) -> None:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("model-*.safetensors"):
        old.unlink()
    (d / "config.json").write_text(json.dumps(top_level_config(spec), indent=2) + "\n")
    weight_map, total = {}, 0
    for shard, part in zip(SHARD_NAMES, (tensors[:cut], tensors[cut:])):
        td = {}
        for n, t in part:
            assert n not in weight_map, n
            weight_map[n] = shard
            td[n] = t
            total += t.numel() * t.element_size()
        save_file(td, str(d / shard), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_npz(d / "expected.npz", arrays)


def reload_and_check(d: Path, spec: dict, expected: dict) -> None:
    """Load the fixture from disk (index -> shards), convert back to HF names
    with the independent unpacker, load strictly into a fresh HF model and
    check the logits."""
    import torch
    from safetensors import safe_open
    from transformers import DeepseekV3ForCausalLM

    top = json.loads((d / "config.json").read_text())
    tc = top["text_config"] if top.get("model_type") == "kimi_k25" else top
    index = json.loads((d / "model.safetensors.index.json").read_text())
    raw = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(d / shard), framework="pt") as f:
            for n in f.keys():
                assert index["weight_map"][n] == shard
                raw[n] = f.get_tensor(n)
    assert set(raw) == set(index["weight_map"])
    total = sum(t.numel() * t.element_size() for t in raw.values())
    assert total == index["metadata"]["total_size"]

    sd = {}
    for n, t in raw.items():
        if n == spec["head_name"]:
            sd["lm_head.weight"] = t
        elif n.startswith(spec["prefix"]):
            sd["model." + n[len(spec["prefix"]):]] = t
        else:
            assert spec["nested"] and n.split(".")[0] in ("vision_tower", "mm_projector"), n
    for n in list(sd):
        if n.endswith(".weight_packed"):
            mod = n[: -len(".weight_packed")]
            shape = sd.pop(mod + ".weight_shape").tolist()
            scale = sd.pop(mod + ".weight_scale")
            _, w = unpack_int4_numpy(sd.pop(n).numpy(), scale.float().numpy(), shape)
            sd[mod + ".weight"] = torch.from_numpy(w).to(torch.bfloat16)
    for n, t in sd.items():
        want = torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16
        assert t.dtype == want, (n, t.dtype)
    fresh = DeepseekV3ForCausalLM(hf_config(tc)).eval()
    missing, unexpected = fresh.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    assert not missing and not unexpected
    with torch.no_grad():
        logits = fresh(input_ids=torch.from_numpy(expected["tokens"]).long(), use_cache=False).logits
    assert np.array_equal(logits.float().numpy(), expected["logits"]), "reloaded fixture does not reproduce logits"


def check_shapes(tensors: list, spec: dict, cfg) -> None:
    """Shapes against the reference doc section 3.1 (scaled down)."""
    t = dict(tensors)
    p = spec["prefix"]
    H, D = cfg.num_attention_heads, cfg.hidden_size
    dqk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    exp = {
        "embed_tokens.weight": [cfg.vocab_size, D],
        "norm.weight": [D],
        "layers.0.self_attn.q_a_proj.weight": [cfg.q_lora_rank, D],
        "layers.0.self_attn.q_a_layernorm.weight": [cfg.q_lora_rank],
        "layers.0.self_attn.q_b_proj.weight": [H * dqk, cfg.q_lora_rank],
        "layers.0.self_attn.kv_a_proj_with_mqa.weight": [cfg.kv_lora_rank + cfg.qk_rope_head_dim, D],
        "layers.0.self_attn.kv_a_layernorm.weight": [cfg.kv_lora_rank],
        "layers.0.self_attn.kv_b_proj.weight": [H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank],
        "layers.0.self_attn.o_proj.weight": [D, H * cfg.v_head_dim],
        "layers.0.mlp.gate_proj.weight": [cfg.intermediate_size, D],
        "layers.0.mlp.down_proj.weight": [D, cfg.intermediate_size],
        "layers.1.mlp.gate.weight": [cfg.n_routed_experts, D],
        "layers.1.mlp.gate.e_score_correction_bias": [cfg.n_routed_experts],
        "layers.1.mlp.shared_experts.gate_proj.weight": [cfg.moe_intermediate_size * cfg.n_shared_experts, D],
        "layers.1.mlp.shared_experts.down_proj.weight": [D, cfg.moe_intermediate_size * cfg.n_shared_experts],
    }
    I = cfg.moe_intermediate_size
    if spec["int4"]:
        exp.update({
            "layers.1.mlp.experts.0.gate_proj.weight_packed": [I, D // 8],
            "layers.1.mlp.experts.0.gate_proj.weight_scale": [I, D // 32],
            "layers.1.mlp.experts.0.gate_proj.weight_shape": [2],
            "layers.1.mlp.experts.0.down_proj.weight_packed": [D, I // 8],
            "layers.1.mlp.experts.0.down_proj.weight_scale": [D, I // 32],
        })
        assert f"{p}layers.1.mlp.experts.0.gate_proj.weight" not in t
    else:
        exp.update({
            "layers.1.mlp.experts.0.gate_proj.weight": [I, D],
            "layers.1.mlp.experts.0.down_proj.weight": [D, I],
        })
    for k, s in exp.items():
        assert list(t[p + k].shape) == s, (k, list(t[p + k].shape), s)
    assert list(t[spec["head_name"]].shape) == [cfg.vocab_size, D]
    assert not any(".layers.0.mlp.experts" in n or ".layers.0.mlp.gate." in n for n in t)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def build(name: str, spec: dict, out_dir: Path) -> dict:
    import torch
    from transformers import DeepseekV3ForCausalLM

    cfg = hf_config(spec["text_config"])
    torch.manual_seed(spec["seed"])
    model = DeepseekV3ForCausalLM(cfg).eval()
    assert model.config._attn_implementation == "eager"
    gen = torch.Generator().manual_seed(spec["seed"])
    randomize_(model, spec, gen)

    compressed = None
    if spec["int4"]:
        compressed, dequant = quantize_experts_int4(model, spec["text_config"]["quantization_config"])
        with torch.no_grad():
            mods = dict(model.named_modules())
            for n, w in dequant.items():
                mods[n].weight.copy_(w.float())

    # Tokens: resample (deterministically) until no routing near-tie, so the
    # expert choice is robust to fp32 rounding differences in other engines.
    rng = np.random.default_rng(spec["seed"])
    for attempt in range(20):
        tokens = rng.integers(0, cfg.vocab_size, size=(N_BATCH, N_SEQ)).astype(np.int32)
        ref = run_reference(model, tokens)
        ok = ref["_sel_margin"] > 1e-3 and (ref["_grp_margin"] is None or ref["_grp_margin"] > 1e-3)
        if ok:
            break
    else:
        raise RuntimeError(f"{name}: could not find tokens without routing near-ties")

    tensors = checkpoint_tensors(model, spec, compressed, gen)
    check_shapes(tensors, spec, cfg)
    cut = shard_split(tensors, spec, cfg)
    arrays = {"tokens": tokens}
    arrays.update({k: v for k, v in ref.items() if not k.startswith("_")})
    assert arrays["logits"].shape == (N_BATCH, N_SEQ, cfg.vocab_size) and arrays["logits"].dtype == np.float32
    assert arrays["hidden_states"].shape == (cfg.num_hidden_layers + 1, N_BATCH, N_SEQ, cfg.hidden_size)
    d = out_dir / name
    save_fixture(d, spec, tensors, cut, arrays)
    reload_and_check(d, spec, arrays)

    return {
        "name": name,
        "files": {p.name: p.stat().st_size for p in sorted(d.iterdir())},
        "max_abs_logit": float(np.abs(arrays["logits"]).max()),
        "logit_std": float(arrays["logits"].std()),
        "distinct_experts": [int(len(np.unique(x))) for x in arrays["router_topk_idx"]],
        "n_experts": cfg.n_routed_experts,
        "sel_margin": ref["_sel_margin"],
        "grp_margin": ref["_grp_margin"],
        "bias_changes": ref["_bias_changes"],
        "token_attempts": attempt + 1,
        "split_after": tensors[cut - 1][0],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Fixtures: " + ", ".join(variant_specs()))
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures"), help="output directory (default tests/fixtures)")
    ap.add_argument("--only", nargs="*", default=None, metavar="NAME", help="build only these fixtures")
    args = ap.parse_args(argv)

    import compressed_tensors
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}  transformers {transformers.__version__}  "
          f"compressed-tensors {compressed_tensors.__version__}  numpy {np.__version__}")
    if transformers.__version__ != "4.57.6":
        print("WARNING: fixtures were specified against transformers 4.57.6", file=sys.stderr)

    specs = variant_specs()
    names = args.only or list(specs)
    args.out.mkdir(parents=True, exist_ok=True)
    summaries = [build(n, specs[n], args.out) for n in names]

    grand = 0
    for s in summaries:
        size = sum(s["files"].values())
        grand += size
        print(f"\n== {s['name']}  ({size / 1024:.1f} KiB)")
        for f, b in s["files"].items():
            print(f"   {f:40s} {b:>9d} B")
        print(f"   max|logit| {s['max_abs_logit']:.3f}  (logit std {s['logit_std']:.3f})")
        print(f"   distinct experts selected per MoE layer: {s['distinct_experts']} of {s['n_experts']}")
        print(f"   tokens whose top-k the bias changes: {s['bias_changes']}  "
              f"min selection margin {s['sel_margin']:.4f}"
              + (f"  min group margin {s['grp_margin']:.4f}" if s["grp_margin"] is not None else "")
              + f"  (token draws: {s['token_attempts']})")
        print(f"   shard 1 ends after {s['split_after']}")
    print(f"\ntotal fixture size: {grand / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
