"""CLI: the embedded default runs end to end through the HF-layout loader; bad input exits 2 with one line."""
import json

from kimijax.decode import main


def test_embedded_default_json(capsys):
    assert main(["--json", "--chat", "--prompt", "Hello there", "--max-new-tokens", "6"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["random_weights"] is True and out["method"] == "ddtree"
    assert out["mean_acceptance_length"] >= 1.0
    assert out["new_tokens"] >= 1 and out["device"].startswith("cpu")
    assert isinstance(out["text"], str)


def test_text_output_says_random(capsys):
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
