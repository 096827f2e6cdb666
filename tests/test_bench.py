"""specdec bench: prompt sets, method parsing, report arithmetic, and one end-to-end run on a tiny model."""

import json
from pathlib import Path

import pytest

from specdec.bench import prompts as P
from specdec.bench import report
from specdec.bench.runner import chat_ids, first_difference, parse_methods
from specdec.cli import main
from specdec.errors import SpecdecError
from tests.tiny import save_tiny


# --- prompts ----------------------------------------------------------------------------------
def test_spec_bench_shortcut_and_multi_turn():
    ps = P.load_prompts("spec-bench")
    assert len(ps) == 240 and ps[0] == P.BenchPrompt("writing", "82", ps[0].turns)
    assert len(ps[0].turns) == 2 and ps[0].turns[0].startswith("Draft a professional email")
    by_cat = {c: [p for p in ps if p.category == c] for c in P.categories_of(ps)}
    assert all(len(p.turns) == 2 for p in by_cat["writing"]) and all(len(p.turns) == 1 for p in by_cat["qa"])
    assert len(by_cat["summarization"]) == 40


def test_humanevalfix_prompt_is_instruction_declaration_buggy_solution():
    ps = P.load_prompts("humanevalfix")
    first = json.loads(P.SHORTCUTS["humanevalfix"].read_text().splitlines()[0])
    assert len(ps) == 82 and {p.category for p in ps} == {"code_edit"}
    assert ps[0].id == "Python/0" and ps[0].turns == (
        first["instruction"] + "\n\n" + first["declaration"] + first["buggy_solution"],)


def test_limit_and_categories_keep_file_order():
    ps = P.load_prompts("spec-bench", limit=2)
    cats = P.categories_of(P.read_prompts("spec-bench"))
    assert len(ps) == 2 * len(cats) and [p.id for p in ps[:2]] == ["82", "84"]
    qa = P.load_prompts("spec-bench", categories=["qa", "rag"], limit=3)
    assert [p.category for p in qa] == ["qa"] * 3 + ["rag"] * 3
    all_qa = [p for p in P.read_prompts("spec-bench") if p.category == "qa"]
    assert [p.id for p in qa[:3]] == [p.id for p in all_qa[:3]]
    with pytest.raises(SpecdecError, match="unknown category 'nope'.*qa"):
        P.load_prompts("spec-bench", categories=["nope"])
    with pytest.raises(SpecdecError, match="--limit"):
        P.load_prompts("spec-bench", limit=0)


def test_any_path_both_formats_and_errors(tmp_path):
    f = tmp_path / "mixed.jsonl"
    f.write_text(json.dumps({"question_id": 1, "category": "chat", "turns": ["a", "b"]}) + "\n\n"
                 + json.dumps({"task_id": "T/1", "instruction": "Fix it.", "declaration": "def f():\n",
                               "buggy_solution": "    return 1\n"}) + "\n")
    ps = P.load_prompts(str(f))
    assert ps == [P.BenchPrompt("chat", "1", ("a", "b")),
                  P.BenchPrompt("code_edit", "T/1", ("Fix it.\n\ndef f():\n    return 1\n",))]
    with pytest.raises(SpecdecError, match="no such prompts file"):
        P.load_prompts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"foo": 1}\n')
    with pytest.raises(SpecdecError, match="bad.jsonl:1"):
        P.load_prompts(str(tmp_path / "bad.jsonl"))
    cases = [({"instruction": 5, "buggy_solution": "x"}, "'instruction' must be text, got int"),  # was a TypeError
             ({"instruction": "Fix.", "declaration": None, "buggy_solution": ["a"]}, "'declaration', 'buggy_solution'"),
             ({"turns": ["   "]}, "none empty or only spaces"),  # generate refuses it; bench ran it
             ({"turns": ["hi"], "category": None}, "'category' must be a non-empty string"),  # was "None"
             ({"turns": ["hi"], "category": "all"}, "other than 'all'")]  # its rows took the summary's place
    for line, said in cases:
        (tmp_path / "bad.jsonl").write_text(json.dumps(line) + "\n")
        with pytest.raises(SpecdecError, match=said):
            P.load_prompts(str(tmp_path / "bad.jsonl"))
    (tmp_path / "twice.jsonl").write_text('{"question_id": 1, "turns": ["a"]}\n{"question_id": 1, "turns": ["b"]}\n')
    with pytest.raises(SpecdecError, match="twice.jsonl:2: id '1' was used at line 1"):  # plain's times were paired
        P.load_prompts(str(tmp_path / "twice.jsonl"))                                     # with the wrong prompt


def test_parse_methods_adds_plain_and_rejects_unknown():
    assert parse_methods("prompt-lookup") == ["plain", "prompt-lookup"]
    assert parse_methods("prompt-lookup,plain,prompt-lookup") == ["plain", "prompt-lookup"]
    with pytest.raises(SpecdecError, match="unknown method 'nope': choose from plain"):
        parse_methods("plain,nope")
    assert parse_methods("eagle@chain,eagle,medusa@chain") == ["plain", "eagle@chain", "eagle", "medusa@chain"]
    with pytest.raises(SpecdecError, match="eagle trees are auto, dynamic, static, chain"):
        parse_methods("eagle@wide")
    with pytest.raises(SpecdecError, match="only medusa and eagle take '@TREE'"):
        parse_methods("prompt-lookup@chain")
    with pytest.raises(SpecdecError, match="'eagle@': eagle trees are"):  # it ran as a row named 'eagle@'
        parse_methods("eagle@")
    with pytest.raises(SpecdecError, match="paths file: --tree FILE"):
        parse_methods("medusa@paths.json")
    for nothing in ("", ",,", " , "):  # they ran plain decoding alone
        with pytest.raises(SpecdecError, match="names no method"):
            parse_methods(nothing)


def test_tree_variants_share_the_model_with_their_own_drafter():
    from types import SimpleNamespace

    from specdec.bench.runner import BenchSettings, OurMethod

    calls = []

    class FakeLLM:
        tree, _medusa, _eagle = "auto", "medusa drafter", "eagle drafter"
        model = object()

        def generate(self, ids, **kw):
            calls.append((self.tree, self._eagle, kw["method"]))
            return SimpleNamespace(token_ids=[1], text="", target_forwards=1, mean_accepted=1.0, acceptance_rate=0,
                                   drafted=0, accepted=0, accepted_per_position=[], draft_seconds=0,
                                   target_seconds=0, finish_reason="length", seconds=0.1)

    llm = FakeLLM()
    chain, dynamic = OurMethod(llm, "eagle@chain", BenchSettings()), OurMethod(llm, "eagle", BenchSettings())
    assert chain.generate([1])["method"] == "eagle@chain" and dynamic.generate([1])["method"] == "eagle"
    assert calls == [("chain", None, "eagle"), ("auto", "eagle drafter", "eagle")]
    assert chain.llm.model is llm.model and llm.tree == "auto"


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


# --- report -----------------------------------------------------------------------------------
def rec(method, cat, seconds, tokens=10, forwards=None, drafted=None, accepted=None, mismatch=None, i=0):
    return dict(method=method, category=cat, id=str(i), turn=1, new_tokens=tokens, seconds=seconds,
                tokens_per_s=tokens / seconds, target_forwards=forwards, drafted=drafted, accepted=accepted,
                mismatch=mismatch)


def fake_records():
    out = []
    for i, (plain_s, pl_s, hf_s) in enumerate([(2.0, 1.0, 4.0), (4.0, 1.0, 4.0)]):
        out += [rec("plain", "a", plain_s, forwards=10, drafted=0, accepted=0, i=i),
                rec("prompt-lookup", "a", pl_s, forwards=4, drafted=12, accepted=6, i=i),
                rec("hf-plain", "a", hf_s, forwards=10, i=i)]
    out += [rec("plain", "b", 1.0, forwards=10, drafted=0, accepted=0),
            rec("prompt-lookup", "b", 2.0, forwards=10, drafted=4, accepted=0,
                mismatch=dict(position=3, margin=0.1, near_tie=True)),
            rec("hf-plain", "b", 1.0, forwards=10)]
    return out


def test_summary_arithmetic():
    rows = {(r["category"], r["method"]): r for r in report.summarize(fake_records())}
    a = rows["a", "prompt-lookup"]
    assert a["speedup_vs_plain"] == pytest.approx(6.0 / 2.0)        # total time ratio, not mean of ratios
    assert a["speedup_vs_hf_plain"] == pytest.approx(8.0 / 2.0)
    assert a["speedup_vs_plain_median"] == pytest.approx(3.0)            # median of 2/1 and 4/1
    assert rows["a", "hf-plain"]["speedup_vs_plain_median"] == pytest.approx(0.75)  # median of 2/4 and 4/4
    assert a["tokens_per_s_median"] == pytest.approx(10.0) and a["tokens_per_s_total"] == pytest.approx(10.0)
    assert a["mean_accepted"] == pytest.approx(20 / 8) and a["acceptance_rate"] == pytest.approx(12 / 24)
    assert rows["a", "plain"]["speedup_vs_plain"] == 1.0 and rows["a", "plain"]["acceptance_rate"] is None
    assert rows["a", "plain"]["tokens_per_s_median"] == pytest.approx((5.0 + 2.5) / 2)
    assert rows["a", "hf-plain"]["speedup_vs_plain"] == pytest.approx(6.0 / 8.0)
    assert rows["b", "prompt-lookup"]["mismatches"] == 1 and rows["b", "prompt-lookup"]["near_ties"] == 1
    al = rows["all", "prompt-lookup"]
    assert al["generations"] == 3 and al["speedup_vs_plain"] == pytest.approx(7.0 / 4.0)
    assert al["speedup_vs_hf_plain"] == pytest.approx(9.0 / 4.0)
    assert [r["category"] for r in report.summarize(fake_records())][-1] == "all"


def test_markdown_table_and_outputs(tmp_path):
    rows = report.summarize(fake_records())
    table = report.markdown_table(rows)
    lines = table.splitlines()
    assert lines[0].startswith("| category | method |") and "× hf-plain" in lines[0]
    assert len(lines) == 2 + len(rows)
    assert "| a | prompt-lookup | 2 | 20 | 10.0 | 10.0 | 3.00× | 3.00× | 4.00× | – | 2.50 | 0.50 | ok |" in table
    assert "**1 MISMATCH** (1 near-tie)" in table and "| ref |" in table
    assert "**all**" in table
    meta = dict(command="specdec bench --x", date=report.now(), machine=report.machine_info(), model="m",
                draft=None, dtype="float32", matmul="avx512bf16", prompts="p.jsonl", n_prompts=3, n_turns=3,
                settings=dict(temperature=0.0, top_p=1.0, seed=0, max_new_tokens=10, k="auto", limit=2),
                mismatches=["GREEDY MISMATCH x"])
    paths = report.write_outputs(tmp_path / "out", fake_records(), rows, meta)
    md = paths["md"].read_text()
    assert "specdec bench --x" in md and "torch" in md and "GREEDY MISMATCH x" in md and table in md
    flags = meta["machine"]["cpu_flags"]  # every figure names the CPU features that chose its matmul paths
    assert set(flags) <= set(report.MATMUL_FLAGS) and (" ".join(flags) or "no AVX2") in md
    assert "dtype: float32, matmul path avx512bf16; prompts: p.jsonl (3 prompts, 3 turns, limit 2" in md
    assert json.loads(paths["json"].read_text())["summary"][0]["method"] == "plain"
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


# --- end to end on a tiny model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("bench-llama"))


def test_chat_ids_multi_turn(tiny_llama):
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer(tiny_llama)
    ids = chat_ids(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                         {"role": "user", "content": "ok"}])
    assert tok.decode(ids) == "<user>hi<assistant>yo<user>ok<assistant>"
    assert 1 not in ids  # no BOS added on top of the template


def test_bench_end_to_end(tiny_llama, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(d) for d in [
        {"question_id": 1, "category": "chat", "turns": ["Say hi.", "Again?"]},
        {"question_id": 2, "category": "chat", "turns": ["Not this one."]},
        {"task_id": "T/0", "instruction": "Fix:", "declaration": "def f(a):\n", "buggy_solution": "  return a\n"},
    ]) + "\n")
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(tiny_llama), "--methods", "prompt-lookup", "--prompts", str(prompts),
               "--limit", "1", "--max-new-tokens", "8", "--compare-hf", "--dtype", "fp32", "--no-progress",
               "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "MISMATCH" not in captured.err
    for name in ("results.md", "results.json", "speedup.png"):
        assert (out / name).stat().st_size > 0
    data = json.loads((out / "results.json").read_text())
    recs = data["records"]
    methods = ["plain", "prompt-lookup", "hf-plain", "hf-prompt-lookup"]
    assert data["meta"]["methods"] == methods
    assert len(recs) == 3 * len(methods)                   # 2 turns of prompt 1 + 1 code_edit turn, per method
    for (cat, pid, turn) in {(r["category"], r["id"], r["turn"]) for r in recs}:
        group = [r for r in recs if (r["category"], r["id"], r["turn"]) == (cat, pid, turn)]
        assert [r["method"] for r in group] == methods     # interleaved per prompt turn
        assert all(r["token_ids"] == group[0]["token_ids"] and r["mismatch"] is None for r in group)
        assert all(0 < r["new_tokens"] <= 8 for r in group)
    t1, t2 = (next(r for r in recs if r["id"] == "1" and r["turn"] == t and r["method"] == "plain") for t in (1, 2))
    assert t2["prompt_tokens"] > t1["prompt_tokens"] + len(t1["token_ids"]) - 1  # turn 2 holds turn 1 and its answer
    assert {r["category"] for r in recs} == {"chat", "code_edit"}
    assert captured.out.splitlines()[0].startswith("| category | method |")
    for m in methods:
        assert f"| {m} |" in captured.out
    assert "specdec bench --model" in (out / "results.md").read_text()
    assert "memory read bandwidth" in (out / "results.md").read_text()
    assert all(g > 0 for g in data["meta"]["machine"]["memory_gbs"])  # before and after the run


def test_plain_in_other_dtypes_races_in_the_same_run(tiny_llama, tmp_path, capsys):
    """--plain-dtypes: plain decoding of each other dtype as its own row, interleaved per turn, measured
    against our plain and not held to its tokens; the benchmark's own dtype is refused."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "chat", "turns": ["Say hi."]}) + "\n")
    base = ["bench", "--model", str(tiny_llama), "--methods", "plain", "--prompts", str(prompts), "--max-new-tokens",
            "4", "--dtype", "fp32", "--no-progress"]
    assert main(base + ["--plain-dtypes", "bf16", "--out", str(tmp_path / "o")]) == 0
    data = json.loads((tmp_path / "o" / "results.json").read_text())
    assert data["meta"]["methods"] == ["plain", "plain-bf16"] and "--plain-dtypes bf16" in data["meta"]["command"]
    rec = next(r for r in data["records"] if r["method"] == "plain-bf16")
    assert rec["checked"] is False and rec["mismatch"] is None and rec["new_tokens"] > 0
    row = next(r for r in data["summary"] if r["method"] == "plain-bf16")
    assert row["speedup_vs_plain"] > 0 and row["checked"] is False
    capsys.readouterr()
    assert main(base + ["--plain-dtypes", "fp32", "--out", str(tmp_path / "p")]) == 2
    assert "--plain-dtypes fp32: that is the benchmark's own dtype" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--methods", "plain,warp"], "unknown method 'warp'"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--categories", "qa,nope"], "unknown category 'nope'"),
    (["--prompts", "/no/such.jsonl"], "no such prompts file"),
    (["--model", "no-such-model", "--limit", "1"], "unknown model 'no-such-model'"),
    (["--llamacpp-gguf", "/no/such.gguf"], "--llamacpp-gguf is llama.cpp's file for --compare-llamacpp"),  # ignored
])
def test_cli_errors_one_line_exit_2(argv, message, tmp_path, capsys):
    args = ["bench", "--prompts", "spec-bench", "--out", str(tmp_path)]
    rc = main(args + argv)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def no_loading(monkeypatch):
    from specdec import api

    def load(*a, **k):
        raise AssertionError("the model loaded before --out and the options were checked")

    monkeypatch.setattr(api, "load_transformer", load)


def test_bad_out_and_options_refused_before_running(tiny_llama, tmp_path, capsys, no_loading):
    (tmp_path / "file").write_text("results of last week")
    (tmp_path / "dir" / "results.json").mkdir(parents=True)
    base = ["bench", "--model", str(tiny_llama), "--prompts", "humanevalfix", "--limit", "1"]
    for argv, message in [(["--out", str(tmp_path / "file")], "is a file"),
                          (["--out", str(tmp_path / "file" / "sub")], "is a file"),
                          (["--out", str(tmp_path / "dir")], "is a folder"),
                          (["--out", str(tmp_path / "o"), "--seed", str(2**64)], "2**64-1"),
                          (["--out", str(tmp_path / "o"), "--temperature", "-1"], "temperature"),
                          (["--out", str(tmp_path / "o"), "--methods", "draft"], "--draft"),
                          (["--out", str(tmp_path / "o"), "--plain-dtypes", "bf16,fp16"], "--plain-dtypes fp16")]:
        assert main(base + argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert (tmp_path / "file").read_text() == "results of last week"


def test_each_method_is_checked_with_its_own_tree_and_the_heads(tmp_path, capsys):
    """medusa@chain beside EAGLE's --tree dynamic is fine (each method with its @tree), and a missing --heads
    folder is refused before running: here only the --out that is a file is left to refuse."""
    (tmp_path / "file").write_text("x")
    base = ["bench", "--prompts", "spec-bench", "--out", str(tmp_path / "file")]
    assert main(base + ["--methods", "medusa@chain,eagle", "--tree", "dynamic"]) == 2
    assert "is a file" in capsys.readouterr().err
    assert main(base + ["--methods", "medusa", "--heads", str(tmp_path / "nothing")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_transformers_runs_on_the_device_of_our_model(tiny_llama, monkeypatch):
    """--compare-hf with --device cuda: transformers' model, its assistant and the prompt's ids go to our model's
    device (the meta device stands in for a GPU)."""
    from types import SimpleNamespace

    import torch

    from specdec.bench import runner

    assert next(runner.load_hf_model(tiny_llama, torch.float32, "meta").parameters()).device.type == "meta"
    meta, seen = torch.device("meta"), []

    def generate(x, **kw):
        seen.append(x.device)
        return torch.tensor([[1, 2, 3, 4, 5, 2]])

    monkeypatch.setattr(runner, "load_hf_model", lambda folder, dtype, device="cpu": seen.append(torch.device(device))
                        or SimpleNamespace(device=torch.device(device), generate=generate))
    llm = SimpleNamespace(folder=tiny_llama, dtype=torch.float32, device=meta,
                          tokenizer=SimpleNamespace(eos_ids={2}, decode=lambda ids: ""))
    methods = runner.hf_methods(llm, runner.BenchSettings(), draft=str(tiny_llama))
    assert [m.name for m in methods] == ["hf-plain", "hf-assisted", "hf-prompt-lookup"] and seen == [meta, meta]
    assert methods[0].generate([1, 2, 3, 4])["finish_reason"] == "stop" and seen[-1] == meta


def test_prompts_file_not_utf8_is_named(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"question_id": 1, "turns": ["caf\xe9"]}\n')  # Latin-1
    with pytest.raises(SpecdecError, match=f"prompts file {bad} is not UTF-8 .*byte 0xe9.*convert it to UTF-8"):
        P.load_prompts(str(bad))


def test_out_is_tried_before_the_run(tmp_path):
    """os.access says yes to root on a read-only mount or under /proc: --out is written to before the run."""
    with pytest.raises(SpecdecError, match="cannot write there"):
        report.check_out("/proc/specdec-no-such-folder")
    assert report.check_out(tmp_path / "new" / "out") == tmp_path / "new" / "out"
    assert not (tmp_path / "new").exists()  # nothing left behind when a later failure ends the run
    (tmp_path / "kept").mkdir()
    assert report.check_out(tmp_path / "kept") == tmp_path / "kept" and not list((tmp_path / "kept").iterdir())


def test_bench_draft_model_hf_assisted_and_sampling(tiny_llama, tmp_path, capsys):
    draft = save_tiny("llama", tmp_path / "draft", seed=1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "chat", "turns": ["Say hi."]}) + "\n")
    base = ["bench", "--model", str(tiny_llama), "--draft", str(draft), "--methods", "draft", "--prompts",
            str(prompts), "--max-new-tokens", "6", "--k", "3", "--compare-hf", "--dtype", "fp32", "--no-progress"]
    assert main(base + ["--out", str(tmp_path / "greedy")]) == 0
    recs = json.loads((tmp_path / "greedy" / "results.json").read_text())["records"]
    assert [r["method"] for r in recs] == ["plain", "draft", "hf-plain", "hf-assisted", "hf-prompt-lookup"]
    assert all(r["token_ids"] == recs[0]["token_ids"] and r["mismatch"] is None for r in recs)
    assert recs[1]["drafted"] > 0
    base[base.index("draft", base.index("--methods"))] = "draft,prompt-lookup"
    assert main(base + ["--temperature", "1.0", "--top-p", "0.9", "--top-k", "50", "--min-p", "0.01",
                        "--out", str(tmp_path / "sampled")]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "sampled" / "results.json").read_text())
    recs = {r["method"]: r for r in data["records"]}
    assert all(r["mismatch"] is None and 0 < r["new_tokens"] <= 6 for r in recs.values())
    # seeded sampling: a deterministic draft (prompt lookup) is held to plain's tokens, a draft model's own q is not
    assert recs["prompt-lookup"].get("checked", True) and recs["prompt-lookup"]["token_ids"] == recs["plain"]["token_ids"]
    assert recs["draft"]["checked"] is False and recs["hf-plain"]["checked"] is False
    table = out.split("| category |")[-1]
    assert "| prompt-lookup |" in table and table.count("| ok |") == 1 and "| ref |" in table
    assert "top-k 50, min-p 0.01" in (tmp_path / "sampled" / "results.md").read_text()


# --- llama.cpp comparison (the runner is tested with a stand-in; llama-cpp-python is an optional extra) ------
def test_outside_runner_is_not_held_to_plain_tokens(tiny_llama):
    from specdec.api import LLM
    from specdec.bench.runner import BenchSettings, our_methods, run_bench

    class Outside:  # another engine at another precision: its tokens differ and that is no mismatch
        name, hf, checked = "llamacpp-plain", True, False

        def generate(self, ids, max_new_tokens=None):
            from specdec.bench.runner import _record
            return _record(self.name, ids, [5, 6], 0.5, "xy", target_forwards=2, mean_accepted=1.0)

    llm = LLM(str(tiny_llama), dtype="fp32")
    settings = BenchSettings(max_new_tokens=4)
    prompts = [P.BenchPrompt(category="chat", id="1", turns=["hi"])]
    recs = run_bench(llm, prompts, our_methods(llm, ["plain"], settings) + [Outside()], settings, progress=False)
    outside = recs[1]
    assert outside["mismatch"] is None and outside["checked"] is False and outside["token_ids"] != recs[0]["token_ids"]
    rows = report.summarize(recs)
    row = next(r for r in rows if r["method"] == "llamacpp-plain")
    assert report.greedy_cell(row, True) == "–"
    assert row["speedup_vs_llamacpp_plain"] == pytest.approx(1.0)
    ours = next(r for r in rows if r["method"] == "plain")  # a tokens/s ratio: the engines stop at other tokens
    assert ours["speedup_vs_llamacpp_plain"] == pytest.approx(ours["new_tokens"] / ours["seconds"] / (2 / 0.5))
    assert "× llama.cpp" in report.markdown_table(rows)


def test_llamacpp_errors(tiny_llama, tmp_path, monkeypatch, capsys):
    from specdec.bench.llamacpp import gguf_for

    with pytest.raises(SpecdecError, match="--llamacpp-gguf FILE"):
        gguf_for(tiny_llama)  # a Hugging Face folder: no GGUF behind it
    with pytest.raises(SpecdecError, match="no such file"):
        gguf_for(tiny_llama, str(tmp_path / "none.gguf"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert gguf_for(tiny_llama, str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # not installed
    args = ["bench", "--model", str(tiny_llama), "--prompts", "spec-bench", "--limit", "1", "--dtype", "fp32",
            "--compare-llamacpp", "--llamacpp-gguf", str(tmp_path / "m.gguf"), "--no-progress", "--out",
            str(tmp_path / "o")]
    assert main(args) == 2
    assert "pip install -e '.[compare]'" in capsys.readouterr().err
    assert main(args + ["--temperature", "0.7"]) == 2
    assert "greedy only" in capsys.readouterr().err


def test_a_llamacpp_that_dies_of_sigill_is_a_clear_error(tmp_path, monkeypatch):
    """On an AMX CPU llama.cpp is tried in a child process first; a SIGILL there (its AMX kernels, seen with
    llama-cpp-python 0.3.36) becomes an error naming the rebuild, not a crash of the whole benchmark."""
    import signal
    import subprocess

    from specdec.bench import llamacpp
    from specdec.runtime import kernels

    calls = []
    died = lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, -signal.SIGILL, b"", b"")
    monkeypatch.setattr(llamacpp.subprocess, "run", died)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "amx_tile", "amx_bf16"}))
    with pytest.raises(SpecdecError, match="(?s)SIGILL.*-mno-amx-tile"):
        llamacpp.check_runs(tmp_path / "m.gguf")
    assert calls and calls[0][-1] == str(tmp_path / "m.gguf")
    ran = lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, b"", b"")
    monkeypatch.setattr(llamacpp.subprocess, "run", ran)
    llamacpp.check_runs(tmp_path / "m.gguf")  # a build that runs: nothing to say
    monkeypatch.setattr(llamacpp.subprocess, "run", died)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2"}))
    llamacpp.check_runs(tmp_path / "m.gguf")  # no AMX: not even tried


def test_llamacpp_runner_times_a_fresh_prefill(monkeypatch):
    """llama-cpp-python's generate(reset=True) keeps the previous generation's KV prefix: the runner must
    reset first, or a prompt seen in the warm-up is timed without its prefill."""
    import types

    from specdec.bench.llamacpp import LlamaCppMethod
    from specdec.bench.runner import BenchSettings

    evaluated: list[int] = []

    class FakeLlama:  # llama-cpp-python's prefix reuse, reduced to what the runner relies on
        def __init__(self, **kw):
            self.n_tokens, self.ids = 0, []

        def reset(self):
            self.n_tokens = 0

        def generate(self, tokens, reset=True, **kw):
            keep = 0
            if reset and self.n_tokens:
                while keep < min(len(self.ids), len(tokens)) and self.ids[keep] == tokens[keep]:
                    keep += 1
            evaluated.append(len(tokens) - keep)
            self.ids, self.n_tokens = list(tokens), len(tokens)
            while True:
                yield 7

    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    tok = types.SimpleNamespace(eos_ids={0}, decode=lambda ids: "x" * len(ids))
    method = LlamaCppMethod("llamacpp-plain", Path("m.gguf"), tok, BenchSettings(max_new_tokens=2), 1, 64)
    method.generate([1, 2, 3, 4])  # the warm-up
    method.generate([1, 2, 3, 4])  # the timed run of the same prompt
    assert evaluated == [4, 4]


# --- mutation audit: the published figures pinned with hand-worked numbers ---------------------------------
def test_summary_medians_per_turn_and_the_table_columns():
    """Three turns of one prompt: medians (not means) per turn keyed by turn, each table column its own figure."""
    recs = []
    for t, (plain_s, x_s, tokens) in enumerate([(1.0, 0.5, 10), (2.0, 2.0, 10), (4.0, 0.8, 16)], 1):
        recs += [dict(rec("plain", "a", plain_s, tokens=tokens, i=1), turn=t),
                 dict(rec("x", "a", x_s, tokens=tokens, i=1), turn=t,
                      mismatch=dict(position=0, margin=0.1, near_tie=t == 1) if t < 3 else None)]
    recs.append(dict(rec("y", "a", 1.0, i=1), turn=1, checked=False))
    recs.append(dict(rec("y", "a", 1.0, i=1), turn=2))
    rows = report.summarize(recs)
    assert [r["category"] for r in rows] == ["a"] * 3  # one category: no "all" row
    x = rows[1]
    assert x["speedup_vs_plain_median"] == pytest.approx(2.0)        # median of 2, 1, 5 (mean 2.67)
    assert x["speedup_vs_plain"] == pytest.approx(7.0 / 3.3)
    assert x["tokens_per_s_median"] == pytest.approx(20.0)           # median of 20, 5, 20 (mean 15)
    assert x["tokens_per_s_total"] == pytest.approx(36 / 3.3)
    assert (x["mismatches"], x["near_ties"]) == (2, 1) and rows[2]["checked"] is False
    assert "| a | x | 3 | 36 | 20.0 | 10.9 | 2.12× | 2.00× | – | – | – | – | **2 MISMATCH** (1 near-tie) |" in \
        report.markdown_table(rows)


def test_run_bench_warms_up_holds_plains_answers_and_reports_every_mismatch(tiny_llama):
    """One untimed warm-up per runner, turn 2's chat holds plain's answer, every greedy mismatch recorded and said."""
    from specdec.api import LLM
    from specdec.bench.runner import BenchSettings, _record, run_bench

    calls = []

    class Fake:
        def __init__(self, name, tokens, text, hf=False, checked=True):
            self.name, self.tokens, self.text, self.hf, self.checked = name, tokens, text, hf, checked

        def plain_tokens(self):
            return True

        def generate(self, ids, max_new_tokens=None):
            calls.append((self.name, list(ids), max_new_tokens))
            return _record(self.name, ids, self.tokens, 0.25, self.text)

    llm = LLM(str(tiny_llama), dtype="fp32")
    runners = [Fake("plain", [5, 6], "PLAIN"), Fake("ours", [5, 7], "OURS"), Fake("hf-plain", [5, 6, 8], "HF", hf=True),
               Fake("llamacpp-plain", [9], "OTHER", hf=True, checked=False)]
    said = []
    recs = run_bench(llm, [P.BenchPrompt("chat", "1", ("Q1", "Q2"))], runners, BenchSettings(max_new_tokens=4, warmup_tokens=2),
                     progress=False, report=said.append)
    assert [(c[0], c[2]) for c in calls[:4]] == [(r.name, 2) for r in runners] and len(calls) == 4 + 2 * 4
    assert all(c[2] is None for c in calls[4:])
    assert llm.tokenizer.decode(calls[-1][1]) == "<user>Q1<assistant>PLAIN<user>Q2<assistant>"
    by = {(r["method"], r["turn"]): r for r in recs}
    assert by["plain", 1]["tokens_per_s"] == pytest.approx(2 / 0.25) and by["plain", 1]["seconds"] == 0.25
    for t in (1, 2):
        assert by["ours", t]["mismatch"]["position"] == 1 and by["hf-plain", t]["mismatch"]["position"] == 2
        assert by["llamacpp-plain", t]["mismatch"] is None and by["llamacpp-plain", t]["checked"] is False
    assert len(said) == 4 and all("GREEDY MISMATCH" in s for s in said)


def test_our_runner_times_the_whole_call_and_passes_the_warm_up_length():
    """`seconds` is wall time around generate (prefill included), not the result's decode time."""
    import time
    from types import SimpleNamespace

    from specdec.bench.runner import BenchSettings, OurMethod

    asked = []

    class FakeLLM:
        def generate(self, ids, **kw):
            asked.append(kw["max_new_tokens"])
            time.sleep(0.05)
            return SimpleNamespace(token_ids=[1], text="", target_forwards=1, mean_accepted=1.0, acceptance_rate=0,
                                   drafted=0, accepted=0, accepted_per_position=[], draft_seconds=0,
                                   target_seconds=0, finish_reason="length", seconds=0.001)

    m = OurMethod(FakeLLM(), "plain", BenchSettings(max_new_tokens=9))
    r = m.generate([1])
    assert r["seconds"] >= 0.05 and r["decode_seconds"] == 0.001
    m.generate([1], max_new_tokens=2)
    assert asked == [9, 2]


def test_explain_mismatch_margin_context_and_near_tie():
    """The margin is plain's logit minus the other's, after prompt + plain's tokens before the difference;
    a near-tie is |margin| <= the dtype's NEAR_TIE."""
    from types import SimpleNamespace

    import torch

    from specdec.bench.runner import explain_mismatch

    seen = []

    def forward(x, cache, last_only):
        seen.append(x[0].tolist())
        logits = torch.zeros(1, 1, 16)
        logits[0, -1, 3], logits[0, -1, 4] = 1.0, 0.5
        return SimpleNamespace(logits=logits)

    forward.new_cache = lambda n: None
    llm = SimpleNamespace(model=forward, dtype=torch.bfloat16, tokenizer=SimpleNamespace(decode=lambda ids: f"<{ids[0]}>"))
    info = explain_mismatch(llm, [1, 2], [9, 3, 5], [9, 4])
    assert (info["position"], info["margin"], info["near_tie"]) == (1, 0.5, True) and seen == [[1, 2, 9]]
    llm.dtype = torch.float32
    assert explain_mismatch(llm, [1, 2], [9, 3, 5], [9, 4])["near_tie"] is False


def test_prompt_lines_that_only_look_right_are_refused(tmp_path):
    """A string for 'turns' would run each character as a turn; an instruction without its buggy_solution is no
    HumanEvalFix line; a missing file names the shortcuts."""
    for line, said in [({"turns": "Hi."}, "'turns' must be a non-empty list"),
                       ({"task_id": "T/1", "instruction": "Fix it."}, "neither a Spec-Bench line"),
                       ({"task_id": "T/1", "buggy_solution": "  return 1\n"}, "neither a Spec-Bench line")]:
        (tmp_path / "bad.jsonl").write_text(json.dumps(line) + "\n")
        with pytest.raises(SpecdecError, match=said):
            P.load_prompts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(SpecdecError, match=r"missing.jsonl \(shortcuts: spec-bench, humanevalfix\)"):
        P.load_prompts(str(tmp_path / "missing.jsonl"))


# --- mutation audit 2: sub-second figures, the Markdown and JSON written, the chart ----------------------------
def _rec0(method, cat, seconds, tokens=8, i=0):
    """A record as the runner makes it (tok/s 0 for a zero time)."""
    from specdec.bench.runner import _record

    return dict(_record(method, [1], list(range(tokens)), seconds, ""), category=cat, id=str(i), turn=1)


def test_sub_second_totals_are_figures_and_a_zero_time_or_a_missing_plain_is_a_dash():
    """Tiny models and short runs finish in under a second: tok/s and every ratio still count. A zero time never
    divides (tok/s 0, ratios –), and neither does a method absent from a category or records without plain."""
    recs = [_rec0("plain", "a", 0.4), _rec0("x", "a", 0.2), _rec0("hf-plain", "a", 0.5),
            _rec0("llamacpp-plain", "a", 0.25), _rec0("y", "a", 0.8),
            _rec0("plain", "z", 0.5), _rec0("x", "z", 0.0), _rec0("hf-plain", "z", 0.0),
            _rec0("llamacpp-plain", "z", 0.25)]
    rows = {(r["category"], r["method"]): r for r in report.summarize(recs)}
    x = rows["a", "x"]
    assert x["tokens_per_s_total"] == pytest.approx(40.0) and x["speedup_vs_plain"] == pytest.approx(2.0)
    assert x["speedup_vs_hf_plain"] == pytest.approx(2.5) and x["speedup_vs_llamacpp_plain"] == pytest.approx(40 / 32)
    assert rows["a", "hf-plain"]["speedup_vs_hf_plain"] == pytest.approx(1.0)
    assert _rec0("x", "z", 0.0)["tokens_per_s"] == 0.0
    zx, zplain = rows["z", "x"], rows["z", "plain"]
    assert (zx["tokens_per_s_total"], zx["speedup_vs_plain"], zx["speedup_vs_plain_median"]) == (0.0, None, None)
    assert zx["speedup_vs_hf_plain"] is None and zx["speedup_vs_llamacpp_plain"] is None
    assert zplain["speedup_vs_hf_plain"] is None  # transformers took no time: no ratio, not 0.00×
    assert ("z", "y") not in rows                   # absent from the category: no row, no division
    alone = {r["method"]: r for r in report.summarize([_rec0("x", "a", 0.5), _rec0("y", "a", 0.0),
                                                         _rec0("hf-plain", "a", 0.5)])}  # no plain at all
    assert alone["x"]["speedup_vs_plain"] is None and alone["x"]["speedup_vs_plain_median"] is None
    assert alone["y"]["speedup_vs_hf_plain"] is None and alone["y"]["tokens_per_s_total"] == 0.0


def test_the_table_is_valid_markdown_and_the_all_row_keeps_its_columns():
    """GitHub renders a table only when the delimiter row has one cell per column; the bold "all" row keeps all 13."""
    table = report.markdown_table(report.summarize(fake_records()))
    lines = table.splitlines()
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
    assert cells(lines[1]) == ["---", "---"] + ["--:"] * 10 + [":-:"] and len(cells(lines[0])) == 13
    assert all(len(cells(line)) == 13 for line in lines[2:])
    assert cells(next(line for line in lines if "**all**" in line))[:4] == ["**all**", "**plain**", "3", "30"]


def _meta(**settings):
    return dict(command="specdec bench --x", date="today", model="m", draft=None, dtype="float32", prompts="p.jsonl",
                n_prompts=1, n_turns=1, machine=dict(cpu="cpu", cpu_count=2, torch_threads=1, torch="t",
                                                      transformers="tf", python="3"),
                settings=dict(dict(temperature=0.0, top_p=1.0, seed=0, max_new_tokens=10, k="auto", limit=None),
                              **settings))


def test_results_md_says_greedy_at_temperature_0_and_which_runs_are_held_to_plain():
    rows = report.summarize(fake_records())
    assert "- decoding: greedy, max new tokens 10, k auto" in report.results_markdown(rows, _meta())
    assert "| ok |" in report.results_markdown(rows, _meta(seed=None))  # greedy: held to plain's tokens, seed or not
    seeded = report.results_markdown(rows, _meta(temperature=0.7, seed=0))
    assert "temperature 0.7, top-p 1.0, top-k 0, min-p 0.0, seed 0" in seeded and "| ok |" in seeded
    unseeded = report.results_markdown(rows, _meta(temperature=0.7, seed=None))
    assert "| ok |" not in unseeded and "| ref |" not in unseeded and "MISMATCH" not in unseeded


def test_outputs_go_to_a_new_nested_folder_and_a_rerun_overwrites_them(tmp_path):
    """--out results/run1 with no results/ yet, then the same --out again: both write, and results.json holds the
    summary's figures and every record as they are."""
    recs = fake_records()
    rows = report.summarize(recs)
    out = tmp_path / "results" / "run1"
    report.write_outputs(out, recs, rows, _meta())
    paths = report.write_outputs(out, recs, rows[:1], _meta())
    data = json.loads(paths["json"].read_text())
    assert data["summary"] == rows[:1] and data["records"] == recs and data["meta"]["model"] == "m"
    assert paths["md"].read_text().count("| plain |") == 1


def test_the_chart_draws_each_speedup_at_its_category(tmp_path, monkeypatch):
    """Bars: one group per category, one bar per method but plain, at its speedup, labelled; the y axis from 0
    holds the tallest bar; the dashed line at 1.0 is our plain decoding; other engines hatched."""
    import matplotlib.pyplot as plt

    close, figs = plt.close, []
    monkeypatch.setattr(plt, "close", figs.append)
    rows = [dict(category=c, method=m, speedup_vs_plain=s) for c, m, s in [
        ("a", "plain", 1.0), ("a", "x", 2.5), ("a", "hf-plain", None), ("b", "plain", 1.0), ("b", "hf-plain", 0.5),
        ("all", "plain", 1.0), ("all", "x", 3.0), ("all", "hf-plain", 0.75)]]
    report.plot_speedup(rows, tmp_path / "s.png", title="m float32")
    report.plot_speedup([dict(category="a", method="plain", speedup_vs_plain=1.0)], tmp_path / "p.png")
    try:
        ax, alone = figs[0].axes[0], figs[1].axes[0]
        bars = {c.get_label(): [(round(p.get_x() + p.get_width() / 2, 6), p.get_height(), round(p.get_width(), 6))
                                for p in c] for c in ax.containers}
        assert bars == {"x": [(-0.2, 2.5, 0.4), (1.8, 3.0, 0.4)], "hf-plain": [(1.2, 0.5, 0.4), (2.2, 0.75, 0.4)]}
        assert {c.get_label(): {p.get_hatch() for p in c} for c in ax.containers} == {"x": {None}, "hf-plain": {"//"}}
        assert sorted((round(t.get_position()[0], 6), t.get_text()) for t in ax.texts) == [
            (-0.2, "2.50"), (1.2, "0.50"), (1.8, "3.00"), (2.2, "0.75")]
        line = ax.lines[0]
        assert list(line.get_ydata()) == [1.0, 1.0] and line.get_label() == "our plain"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "all"] and list(ax.get_xticks()) == [0, 1, 2]
        low, high = ax.get_ylim()
        assert low == 0 and 3.0 < high <= 1.5 * 3.0
        assert ax.get_title() == "m float32" and alone.get_title() == "specdec bench"
        assert [(c.get_label(), [p.get_height() for p in c]) for c in alone.containers] == [("plain", [1.0])]
    finally:
        for f in figs:
            close(f)


def test_cpu_name_and_load_average(monkeypatch):
    from types import SimpleNamespace

    cpuinfo = "processor\t: 0\nmodel name\t: Acme CPU: 9 @ 2.00GHz\n"
    monkeypatch.setattr(report, "Path", lambda p: SimpleNamespace(read_text=lambda: cpuinfo))
    assert report.cpu_model() == "Acme CPU: 9 @ 2.00GHz"

    def unreadable():
        raise OSError

    monkeypatch.setattr(report, "Path", lambda p: SimpleNamespace(read_text=unreadable))
    monkeypatch.setattr(report.platform, "processor", lambda: "")
    monkeypatch.setattr(report.platform, "machine", lambda: "x86_64")
    assert report.cpu_model() == "x86_64"
    monkeypatch.setattr(report.os, "getloadavg", lambda: (1.23456, 0.5, 0.0049))
    assert report.machine_info()["load_avg"] == [1.23, 0.5, 0.0]


def test_chat_ids_add_no_second_bos_and_join_turns_without_a_template():
    """The chat template holds the special tokens: encoding its text must not add a BOS on top (Llama's tokenizers
    would). A model without a template gets the contents joined by blank lines, encoded as plain text."""
    from types import SimpleNamespace

    asked = []

    class HF:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and not tokenize
            return "|".join(m["content"] for m in messages) + "|>"

        def encode(self, text, **kw):
            asked.append((text, kw))
            return [7]

    tok, chat = SimpleNamespace(hf=HF()), [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat_ids(tok, chat)
    tok.hf.chat_template = None
    chat_ids(tok, chat)
    assert asked == [("a|b|>", {"add_special_tokens": False}), ("a\n\nb", {})]


def test_our_runner_wall_time_and_which_methods_are_held_to_plain():
    import time
    from types import SimpleNamespace

    from specdec.bench.runner import BenchSettings, OurMethod

    class FakeLLM:
        def generate(self, ids, **kw):
            time.sleep(0.02)
            return SimpleNamespace(token_ids=[1], text="", target_forwards=1, mean_accepted=1.0, acceptance_rate=0,
                                   drafted=0, accepted=0, accepted_per_position=[], draft_seconds=0,
                                   target_seconds=0, finish_reason="length", seconds=0.001)

        def drafter(self, method):
            return SimpleNamespace(deterministic=method == "prompt-lookup")

    t0 = time.perf_counter()
    r = OurMethod(FakeLLM(), "plain", BenchSettings()).generate([1])
    assert 0.02 <= r["seconds"] <= time.perf_counter() - t0
    seeded = BenchSettings(temperature=0.7, seed=1)
    held = lambda method, checked=True, s=seeded: OurMethod(FakeLLM(), method, s, checked=checked).plain_tokens()
    assert held("prompt-lookup") and not held("draft") and held("draft", s=BenchSettings())
    assert not held("prompt-lookup", checked=False) and not held("plain", checked=False, s=BenchSettings())


def test_transformers_runner_samples_as_asked_times_the_call_and_cuts_at_the_first_eos():
    import time
    from types import SimpleNamespace

    import torch

    from specdec.bench.runner import BenchSettings, HFMethod

    seen, outs = [], []

    class Model:
        device = torch.device("cpu")

        def generate(self, x, **kw):
            seen.append(dict(kw, seed=torch.initial_seed()))
            time.sleep(0.02)
            return torch.tensor([x[0].tolist() + outs.pop(0)])

    tok = SimpleNamespace(eos_ids={3, 2}, decode=lambda ids: " ".join(map(str, ids)))
    greedy = HFMethod("hf-plain", Model(), tok, BenchSettings(max_new_tokens=5))
    outs += [[5, 6, 2, 2, 2], [5, 6, 7, 8, 9]]
    t0 = time.perf_counter()
    r = greedy.generate([1, 1])
    assert 0.02 <= r["seconds"] <= time.perf_counter() - t0
    assert (r["token_ids"], r["new_tokens"], r["text"], r["finish_reason"]) == ([5, 6, 2], 3, "5 6 2", "stop")
    assert (r["target_forwards"], r["mean_accepted"]) == (3, 1.0)  # transformers' plain: one forward a token
    r = greedy.generate([1, 1])
    assert (r["token_ids"], r["finish_reason"]) == ([5, 6, 7, 8, 9], "length")
    kw = seen[0]
    assert (kw["do_sample"], kw["max_new_tokens"], kw["eos_token_id"], kw["pad_token_id"]) == (False, 5, [2, 3], 2)
    sampled = HFMethod("hf-assisted", Model(), tok, BenchSettings(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
                                                                  seed=3), assistant_model="draft")
    outs += [[5, 3]]
    torch.manual_seed(12345)
    r = sampled.generate([1])
    assert r["target_forwards"] is None and r["mean_accepted"] is None and r["finish_reason"] == "stop"
    kw = seen[-1]
    assert (kw["do_sample"], kw["temperature"], kw["top_p"], kw["top_k"], kw["min_p"], kw["seed"],
            kw["assistant_model"]) == (True, 0.7, 0.9, 5, 0.05, 3, "draft")
    outs += [[5, 6]]
    HFMethod("hf-plain", Model(), tok, BenchSettings(temperature=0.7, seed=None)).generate([1])
    assert seen[-1]["min_p"] is None and seen[-1]["do_sample"] is True


def test_transformers_prompt_lookup_takes_10_tokens_and_the_draft_is_fetched(monkeypatch):
    from types import SimpleNamespace

    import torch

    from specdec import store
    from specdec.bench import runner

    pulled = []
    monkeypatch.setattr(runner, "load_hf_model", lambda folder, dtype, device="cpu": SimpleNamespace(folder=folder))
    monkeypatch.setattr(store, "resolve", lambda name, pull=False: pulled.append((name, pull)) or f"/models/{name}")
    llm = SimpleNamespace(folder="/models/t", dtype=torch.float32, device="cpu", tokenizer=SimpleNamespace(eos_ids={2}))
    plain, assisted, lookup = runner.hf_methods(llm, runner.BenchSettings(), draft="d")
    assert lookup.extra == {"prompt_lookup_num_tokens": 10} and plain.extra == {}  # the documented setting
    assert assisted.extra["assistant_model"].folder == "/models/d" and pulled == [("d", True)]


def _logits_llm(dtype, margin, seen):
    from types import SimpleNamespace

    import torch

    def forward(x, cache, last_only):
        seen.append(x[0].tolist())
        logits = torch.zeros(1, 1, 8, dtype=torch.float64)
        logits[0, -1, 3] = margin
        return SimpleNamespace(logits=logits)

    forward.new_cache = lambda n: None
    return SimpleNamespace(model=forward, dtype=dtype, tokenizer=SimpleNamespace(decode=lambda ids: f"<{ids[0]}>"))


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-3), ("bfloat16", 0.5), ("float16", 0.05), ("q8", 1e-3)])
def test_a_near_tie_is_a_margin_within_the_dtypes_bound(dtype, bound):
    import torch

    from specdec.bench.runner import explain_mismatch

    dtype = getattr(torch, dtype, dtype)  # q8: our quantized weights, no torch dtype
    for margin, near in [(bound, True), (-bound, True), (1.2 * bound, False)]:
        assert explain_mismatch(_logits_llm(dtype, margin, []), [1], [3], [4])["near_tie"] is near, margin


def test_a_shorter_answer_and_a_seeded_mismatch_are_explained_without_a_margin():
    """A method that stops before plain: no token to compare, no forward, never a near-tie (a bug). Under a seed:
    the pieces, no margin (the draw, not the logits, picked them)."""
    import torch

    from specdec.bench.runner import describe_mismatch, explain_mismatch

    seen = []
    llm = _logits_llm(torch.float32, 0.0, seen)
    info = explain_mismatch(llm, [1], [9, 3], [9])
    assert info == dict(position=1, plain_token=3, token=None, margin=None, near_tie=False, sampled=False)
    rec = dict(method="x", category="c", id="1", turn=1, mismatch=info)
    assert "GREEDY MISMATCH x vs plain on c/1 turn 1: lengths differ from new token 1" in describe_mismatch(rec)
    info = explain_mismatch(llm, [1], [9, 3], [9, 4], greedy=False)
    assert (info["margin"], info["sampled"], info["plain_piece"], info["piece"]) == (None, True, "<3>", "<4>")
    assert describe_mismatch(dict(rec, mismatch=info)).startswith("SEEDED MISMATCH x vs plain on c/1 turn 1")
    assert not seen
    shorter = explain_mismatch(llm, [1], [9, 3], [9], greedy=False)  # under a seed too: not called greedy
    said = describe_mismatch(dict(rec, mismatch=shorter))
    assert said.startswith("SEEDED MISMATCH x vs plain on c/1 turn 1: lengths")


def test_run_bench_wants_plain_first_and_holds_runners_without_a_checked_flag(tiny_llama, capsys):
    """transformers' runners have no `checked`: they are held to plain's tokens under greedy. A first runner other
    than plain is refused (its answers would build the turns and be the reference). --no-progress prints nothing."""
    from specdec.api import LLM
    from specdec.bench.runner import BenchSettings, _record, run_bench

    calls = []

    class Fake:  # like HFMethod: no `checked`
        def __init__(self, name, tokens, hf=True):
            self.name, self.tokens, self.hf = name, tokens, hf

        def generate(self, ids, max_new_tokens=None):
            calls.append((self.name, max_new_tokens))
            return _record(self.name, ids, self.tokens, 0.25, "t")

    llm = LLM(str(tiny_llama), dtype="fp32")
    prompts = [P.BenchPrompt("chat", "1", ("Q1",))]
    for runners in ([], [Fake("hf-plain", [5]), Fake("plain", [5])]):
        with pytest.raises(ValueError, match="the first runner must be our plain"):
            run_bench(llm, prompts, runners, BenchSettings(), progress=False)
    said = []
    recs = run_bench(llm, prompts, [Fake("plain", [5], hf=False), Fake("hf-plain", [6])],
                     BenchSettings(max_new_tokens=1), progress=False, report=said.append)
    assert calls == [("plain", 1), ("hf-plain", 1), ("plain", None), ("hf-plain", None)]  # a 1-token warm-up
    assert recs[1]["mismatch"]["position"] == 0 and recs[1].get("checked", True) and len(said) == 1
    assert capsys.readouterr().err == ""
