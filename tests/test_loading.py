"""Loader: real HF layout round trip, orbax restart, and one clear error per kind of bad checkpoint."""
import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kimijax
from kimijax.config import TINY
from kimijax.loading import CheckpointError, save_hf_checkpoint
from kimijax.target import random_kimi_params


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    params = random_kimi_params(TINY, seed=4)
    save_hf_checkpoint(TINY, params, d, shard_bytes=120_000)
    return d, params


def _copy(ckpt, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(ckpt[0], d)
    return d


def _same(a, b):
    return all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda x, y: x.dtype == y.dtype and bool((np.asarray(x) == np.asarray(y)).all()), a, b)))


def test_roundtrip_nested_and_flat(ckpt, tmp_path):
    d, params = ckpt
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) > 1
    assert all("-of-00000" in f for f in idx["weight_map"].values())
    assert any(k.endswith(".weight_packed") for k in idx["weight_map"])
    t = kimijax.load_target(d, progress=False)
    assert t.cfg.weight_prefix == "language_model." and _same(params, t.params)
    flat = save_hf_checkpoint(TINY, params, tmp_path / "flat", nested=False)
    t2 = kimijax.load_target(flat, progress=False)
    assert t2.cfg.weight_prefix == "" and _same(params, t2.params)


def test_vision_and_mtp_tensors_are_skipped(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    save_file({"vision_tower.patch_embed.proj.weight": np.ones((2, 2), np.float32),
               "language_model.model.layers.3.eh_proj.weight": np.ones((2, 2), np.float32)},
              str(d / "extra.safetensors"))
    idx["weight_map"].update({"vision_tower.patch_embed.proj.weight": "extra.safetensors",
                              "language_model.model.layers.3.eh_proj.weight": "extra.safetensors"})
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert _same(ckpt[1], kimijax.load_target(d, progress=False).params)


def test_orbax_restart(ckpt, tmp_path):
    t = kimijax.load_target(ckpt[0], progress=False)
    kimijax.save_params(t, tmp_path / "orbax")
    t2 = kimijax.load_target(tmp_path / "orbax")
    assert t2.cfg == t.cfg and _same(t.params, t2.params)


def _edit_tensor(d, name, fn):
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    f = d / idx["weight_map"][name]
    tensors = load_file(str(f))
    out = fn(tensors)
    save_file(out, str(f))
    if name not in out:
        idx["weight_map"].pop(name)
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))


NAME = "language_model.model.layers.1.self_attn.kv_b_proj.weight"
EXPERT = "language_model.model.layers.2.mlp.experts.3.up_proj.weight_packed"


def test_missing_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    _edit_tensor(d, NAME, lambda t: {k: v for k, v in t.items() if k != NAME})
    with pytest.raises(CheckpointError, match="missing tensor.*kv_b_proj"):
        kimijax.load_target(d, progress=False)


def test_extra_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    f = idx["weight_map"][NAME]
    _edit_tensor(d, NAME, lambda t: {**t, "language_model.model.layers.1.self_attn.bogus.weight": np.zeros(3, np.float32)})
    idx["weight_map"]["language_model.model.layers.1.self_attn.bogus.weight"] = f
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="unexpected tensor.*bogus"):
        kimijax.load_target(d, progress=False)


def test_misshaped_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    _edit_tensor(d, NAME, lambda t: {**t, NAME: t[NAME][:-1]})
    with pytest.raises(CheckpointError, match="kv_b_proj.*shape"):
        kimijax.load_target(d, progress=False)


def test_mistyped_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    _edit_tensor(d, EXPERT, lambda t: {**t, EXPERT: t[EXPERT].astype(np.float32)})
    with pytest.raises(CheckpointError, match="up_proj.weight_packed.*dtype F32"):
        kimijax.load_target(d, progress=False)


def test_wrong_weight_shape_record(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    n = EXPERT.replace("weight_packed", "weight_shape")
    _edit_tensor(d, n, lambda t: {**t, n: np.array([7, 7], np.int64)})
    with pytest.raises(CheckpointError, match="weight_shape"):
        kimijax.load_target(d, progress=False)


def test_corrupt_and_truncated_and_missing_shard(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / idx["weight_map"][NAME]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated|past the end"):
        kimijax.load_target(d, progress=False)
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + data[24:])
    with pytest.raises(CheckpointError, match="corrupt"):
        kimijax.load_target(d, progress=False)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        kimijax.load_target(d, progress=False)


def test_bad_paths_and_presets(tmp_path):
    with pytest.raises(CheckpointError, match="neither"):
        kimijax.load_target(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no weights"):
        kimijax.load_target("kimi-k2.6")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        kimijax.load_target(tmp_path)
