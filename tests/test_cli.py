"""`specdec generate` and `specdec probe` as a user runs them, on a tiny model folder; bad input gives one
line and a non-zero exit, never a traceback."""

import json
import os
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
    for key in ("text", "token_ids", "prompt_tokens", "new_tokens", "seconds", "tokens_per_s", "target_forwards",
                "mean_accepted", "acceptance_rate", "accepted_per_position", "draft_seconds", "target_seconds"):
        assert key in out
    assert 1 <= out["new_tokens"] <= 12 and out["mean_accepted"] >= 1.0
    assert out["model"] == folder and out["method"] == "prompt-lookup"


def test_generate_json_rounds_add_up_to_the_totals(folder, capsys):
    """drafted_per_round counts a tree's every node and accepted_per_round the accepted draft tokens, as the totals."""
    assert main(["generate", "hello hello hello", "--model", folder, "--max-new-tokens", "24", "--json", "--no-chat",
                 "--method", "recycling", "--tree-nodes", "4", "--k", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["drafted"] > 0 and len(out["drafted_per_round"]) == out["target_forwards"]
    assert sum(out["drafted_per_round"]) == out["drafted"] and sum(out["accepted_per_round"]) == out["accepted"]


def test_generate_passes_its_kv_dtype_to_the_model(folder, capsys, monkeypatch):
    from specdec import api

    seen, load = [], api.load_transformer
    monkeypatch.setattr(api, "load_transformer", lambda *a: seen.append(a[3]) or load(*a))
    assert main(["generate", "hi", "--model", folder, "--kv-dtype", "fp16", "--max-new-tokens", "2"]) == 0
    assert seen == ["fp16"]


def test_generate_streams_text(folder, capsys):
    assert main(["generate", "abc", "--model", folder, "--max-new-tokens", "5", "--no-chat",
                 "--temperature", "0.8", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert "tokens/s" in captured.err and "acceptance" not in captured.err  # plain decoding drafts nothing
    assert main(["generate", "abc abc abc", "--model", folder, "--max-new-tokens", "5", "--no-chat",
                 "--method", "prompt-lookup", "--k", "2"]) == 0
    assert "acceptance" in capsys.readouterr().err


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_keeps_what_generate_wrote(folder, capsys, monkeypatch, as_json):
    """Ctrl-C after two chunks: the streamed text ends its line (or --json prints it), exit 130."""
    from specdec.api import LLM
    from specdec.decode import Chunk

    def chunks(self, prompt, **kw):
        yield Chunk("Hel", [5, 6])
        yield Chunk("lo", [7])
        raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "chunks", chunks)
    assert main(["generate", "hi", "--model", folder] + (["--json"] if as_json else [])) == 130
    out, err = capsys.readouterr()
    if as_json:
        got = json.loads(out)
        assert got["text"] == "Hello" and got["token_ids"] == [5, 6, 7] and got["finish_reason"] == "interrupted"
        assert got["seconds"] >= 0 and got["dtype"] and "tokens_per_s" in got  # the keys a full run has, where known
        assert got["new_tokens"] == 3 and got["model"] == folder and got["method"] == "plain"  # tokens, not chunks
        assert got["tokens_per_s"] == pytest.approx(3 / got["seconds"])
    else:
        assert out == "Hello\n" and "interrupted after 3 tokens" in err


@pytest.mark.parametrize("args, message", [
    (["--top-p", "0"], "--top-p must"),
    (["--top-p", "1.5"], "--top-p must"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "-1"], "temperature"),
    (["--min-p", "2"], "--min-p"),
    (["--max-new-tokens", "100000"], "context"),
    (["--method", "draft"], "--draft"),
])
def test_bad_input_is_one_line(folder, capsys, args, message):
    assert main(["generate", "hi", "--model", folder] + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("k", ["1001", "-1", "x", "2.5"])
def test_k_outside_0_to_1000_is_refused_by_the_parser(capsys, k):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--k", k])
    assert e.value.code == 2 and f"k must be an integer 0..1000 or 'auto', got '{k}'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--method", "recycling", "--tree-nodes", "3"],
    ["--method", "hybrid", "--sources", "prompt-lookup,medusa", "--tree", "chain", "--heads", "/tmp"],
    ["--method", "hybrid", "--sources", "lookahead,retrieval", "--no-pool", "--datastore", "/x"],
    ["--method", "early-exit", "--exit-layer", "2"], ["--method", "plain"],
])
def test_flags_a_method_reads_are_taken(argv):
    from specdec.cli import build_parser
    from specdec.commands.generate import check_flags_read

    args = build_parser().parse_args(["generate", "hi"] + argv)
    check_flags_read(args, [args.method])


def test_bench_takes_draft_for_hf_assisted_and_trees_after_at(folder, tmp_path, capsys, no_loading):
    base = ["bench", "--model", folder, "--prompts", "humanevalfix", "--out", str(tmp_path / "b")]
    assert main(base + ["--methods", "plain,prompt-lookup", "--draft", "x"]) == 2
    assert "--draft is read only by draft" in capsys.readouterr().err
    assert main(base + ["--methods", "recycling", "--tree", "chain"]) == 2
    assert "--tree is read only" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="loaded before"):  # the checks pass: it goes on to load
        main(base + ["--methods", "plain", "--draft", folder, "--compare-hf"])


def test_api_errors_are_told_in_the_commands_words():
    """The API's parameter names become the command's flags; other words stay."""
    from specdec.cli import build_parser, in_cli_words

    gen = build_parser().commands["generate"]
    assert in_cli_words("top_p must be in (0, 1]", gen) == "--top-p must be in (0, 1]"
    assert in_cli_words("seed must be an integer", gen) == "--seed must be an integer"
    assert in_cli_words("tree 'x': no such file", gen) == "--tree 'x': no such file"
    assert in_cli_words("needs posterior_threshold and posterior_alpha", gen) == \
        "needs --posterior-threshold and --posterior-alpha"
    assert in_cli_words("stop strings must be non-empty", gen) == "stop strings must be non-empty"  # --stop: 2nd word
    assert in_cli_words("seed", gen) == "seed" and in_cli_words("the seed must", gen) == "the seed must"
    assert in_cli_words("no_such_name must be", gen) == "no_such_name must be"
    assert in_cli_words("top_p must", build_parser().commands["calc"]) == "top_p must"  # calc has no --top-p


@pytest.mark.parametrize("error, shown", [
    ("OptionError", "--top-p must be in (0, 1]"),  # the API's own option checks are told in flags
    ("SpecdecError", "top_p must be in (0, 1]"),  # anything else as it was said (a server's 400 body, a file's text)
])
def test_only_option_errors_are_retold(monkeypatch, capsys, error, shown):
    from specdec import errors, options
    from specdec.commands import generate

    def run(args):
        raise getattr(options if error == "OptionError" else errors, error)("top_p must be in (0, 1]")

    monkeypatch.setattr(generate, "run", run)
    assert main(["generate", "hi"]) == 2
    assert capsys.readouterr().err.strip() == f"specdec generate: error: {shown}"


def test_unknown_model_lists_known_names(capsys):
    assert main(["generate", "hi", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "smollm2-135m" in err and "qwen2.5-coder-1.5b" in err


def test_no_traceback_from_the_real_command(folder):
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "hi", "--model", folder, "--top-p", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--top-p" in r.stderr


def test_probe_json(folder, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    for bad in ("0", "101"):  # a billion repeats ran for days: refused before the model loads
        assert main(["probe", "--model", "no-such-model", "--repeats", bad]) == 2
        assert "--repeats must be from 1 to 100" in capsys.readouterr().err
    assert main(["probe", "--model", folder, "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["seconds"]) == {str(n) for n in SIZES}
    assert out["budget"] >= 1 and out["relative"]["1"] == 1.0 and out["bound_seconds"] > 0
    assert list(tmp_path.glob("probe/*.json"))  # cached for adaptive k
    assert out["prefill_tokens_per_s"] > 0 and out["matmul"] and out["threads"] >= 1 and out["cpu"]


def test_probe_measures_every_bf16_path(folder, capsys, tmp_path, monkeypatch):
    """bf16: the curve, budget and prefill of the runtime's path and of every other one this CPU has."""
    from specdec.runtime import kernels

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert main(["probe", "--model", folder, "--dtype", "bf16", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    used = kernels.matmul_path()
    assert f"matmul path {used} (the runtime's)" in text and f"{used}: budget" in text and "(used)" in text
    have = [p for p in kernels.PATHS if p == "torch" or not kernels.unavailable(p)]
    for p in have:
        assert f"{p}: budget" in text and "prefill" in text, p


# --- input checked before the model loads (issue 15) ----------------------------------------------

def run_cli(args, stdin=b""):
    """The real command in a subprocess (argv may hold bytes that are not UTF-8)."""
    return subprocess.run([sys.executable, "-m", "specdec.cli"] + args, input=stdin, capture_output=True)


@pytest.mark.parametrize("prompt, stdin", [(b"abc\xff\xfe", b""), (b"-", b"abc\xff")])
def test_invalid_utf8_prompt_is_one_line(folder, prompt, stdin):
    r = run_cli([b"generate", prompt, b"--model", folder.encode()], stdin)
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "UTF-8" in err and "\n" not in err and "Traceback" not in err


@pytest.fixture
def no_loading(monkeypatch):
    """Fail any test that loads a model: options must be refused before."""
    from specdec import api

    def load(*a, **k):
        raise AssertionError("the model loaded before the options were checked")

    monkeypatch.setattr(api, "load_transformer", load)


@pytest.mark.parametrize("args, message", [
    (["", "--no-chat"], "empty"), ([""], "empty"), (["  \n"], "empty"),
    (["hi", "--seed", "18446744073709551616"], "2**64-1"), (["hi", "--seed", "-1"], "seed"),
    (["hi", "--top-p", "0"], "--top-p"), (["hi", "--temperature", "nan"], "temperature"),
    (["hi", "--stop", ""], "stop"), (["hi", "--method", "draft"], "--draft"),
    (["hi", "--method", "hybrid", "--sources", "prompt-lookup,nosuch"], "nosuch"),
    (["hi", "--method", "early-exit", "--exit-layer", "x"], "exit layer"),
    (["hi", "--method", "lookahead", "--ngram", "1"], "ngram"),
    (["hi", "--method", "medusa", "--temperature", "0.7", "--acceptance", "typical", "--posterior-threshold", "-1"],
     "--posterior-threshold (epsilon)"),
    (["hi", "--method", "medusa", "--acceptance", "typical", "--posterior-alpha", "nan"], "--posterior-alpha (delta)"),
    (["hi", "--method", "medusa", "--tree-nodes", "0"], "--tree-nodes must"),
    (["hi", "--model", "/etc/hostname"], "is a file but not a model"),
    (["hi", "--tree", "dynamic"], "--tree is read only by eagle and medusa"),  # was silently a plain run
    (["hi", "--method", "recycling", "--tree", "chain"], "--tree is read only by eagle and medusa"),
    (["hi", "--datastore", "/nonexist"], "--datastore is read only by retrieval"),
    (["hi", "--method", "prompt-lookup", "--draft", "x"], "--draft is read only by draft"),
    (["hi", "--method", "hybrid", "--sources", "prompt-lookup", "--window", "4"], "--window is read only"),
    (["hi", "--no-pool"], "--no-pool"), (["hi", "--exit-layer", "2"], "--exit-layer"),
    (["hi", "--sources", "prompt-lookup"], "--sources is read only by hybrid"),
    (["hi", "--method", "lookahead", "--heads", "/tmp"], "--heads is read only by eagle and medusa"),
    (["hi", "--acceptance", "typical", "--temperature", "0.7"], "plain decoding drafts none"),  # was ignored
    (["hi", "--k", "4"], "--k sets the draft length, and plain decoding drafts none"),  # was ignored
    (["hi", "--method", "lookahead", "--window", "65"], "lookahead window must be an integer 0..64"),  # refused after loading
    (["hi", "--method", "medusa", "--posterior-threshold", "0.2"], "--posterior-threshold is read only by --acceptance"),
])
def test_bad_input_refused_before_loading(folder, capsys, no_loading, args, message):
    assert main(["generate"] + args[:1] + ["--model", folder] + args[1:]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_reader_that_goes_away_ends_generate_quietly(folder):
    """`specdec generate ... | head -c 5`: no BrokenPipeError traceback."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(f"{sys.executable} -m specdec.cli generate 'hello hello' --model {folder} --no-chat "
                       "--max-new-tokens 200 --temperature 1 | head -c 1", shell=True, capture_output=True, env=env)
    assert len(r.stdout) == 1 and b"Traceback" not in r.stderr and b"BrokenPipe" not in r.stderr


def test_empty_stdin_is_refused(folder):
    r = run_cli(["generate", "-", "--model", folder], b" \n")
    assert r.returncode == 2 and b"empty" in r.stderr


def test_exit_layer_beyond_the_model(folder, capsys):
    assert main(["generate", "hi", "--model", folder, "--method", "early-exit", "--exit-layer", "4"]) == 2
    assert "1..3" in capsys.readouterr().err


def test_tiny_temperature_samples_the_argmax(folder, capsys):
    base = ["generate", "hello", "--model", folder, "--no-chat", "--max-new-tokens", "8", "--json"]
    assert main(base) == 0
    greedy = json.loads(capsys.readouterr().out)["text"]
    assert main(base + ["--temperature", "1e-40", "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == greedy
