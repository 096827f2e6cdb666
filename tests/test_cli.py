"""`specdec generate` and `specdec probe` as a user runs them, on a tiny model folder; bad input gives one
line and a non-zero exit, never a traceback."""

import json
import subprocess
import sys

import pytest

from specdec.cli import main
from specdec.probe import SIZES


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.tiny import save_tiny

    return str(save_tiny("llama", tmp_path_factory.mktemp("cli")))


def test_generate_json(folder, capsys):
    assert main(["generate", "hello hello", "--model", folder, "--max-new-tokens", "12", "--json",
                 "--method", "prompt-lookup", "--k", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("text", "prompt_tokens", "new_tokens", "seconds", "tokens_per_s", "target_forwards",
                "mean_accepted", "acceptance_rate", "accepted_per_position", "draft_seconds", "target_seconds"):
        assert key in out
    assert 1 <= out["new_tokens"] <= 12 and out["mean_accepted"] >= 1.0


def test_generate_streams_text(folder, capsys):
    assert main(["generate", "abc", "--model", folder, "--max-new-tokens", "5", "--no-chat",
                 "--temperature", "0.8", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert "tokens/s" in captured.err


@pytest.mark.parametrize("args, message", [
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "-1"], "temperature"),
    (["--min-p", "2"], "min_p"),
    (["--max-new-tokens", "100000"], "context"),
    (["--method", "draft"], "--draft"),
])
def test_bad_input_is_one_line(folder, capsys, args, message):
    assert main(["generate", "hi", "--model", folder] + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_unknown_model_lists_known_names(capsys):
    assert main(["generate", "hi", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "smollm2-135m" in err and "qwen2.5-coder-1.5b" in err


def test_no_traceback_from_the_real_command(folder):
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "hi", "--model", folder, "--top-p", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "top_p" in r.stderr


def test_probe_json(folder, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert main(["probe", "--model", folder, "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["seconds"]) == {str(n) for n in SIZES}
    assert out["budget"] >= 1 and out["relative"]["1"] == 1.0 and out["bound_seconds"] > 0
    assert list(tmp_path.glob("probe/*.json"))  # cached for adaptive k
