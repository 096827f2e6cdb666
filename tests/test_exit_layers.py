"""`specdec exit-layers` and `specdec quality` without a model where none is needed: the candidate layers, the prompts
file's records, and the inputs refused before anything loads (QA session: malformed jsonl records were tracebacks,
`--layers ,` measured the default layers in silence, `quality.measure(tasks=0)` divided by zero)."""

from types import SimpleNamespace

import pytest

from specdec.cli import main
from specdec.exit_layers import default_layers, measure_exit_layers


def test_default_layers_never_include_the_last_one():
    """The whole model as its own draft is a reference row, never a candidate: a 2-layer model has one candidate."""
    assert default_layers(2) == [1] and default_layers(1) == []
    assert default_layers(8) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("record, said", [
    ('"some text"', "not a JSON object"),
    ('{"turns": []}', "not a non-empty string"),
    ('{"prompt": 5}', "not a non-empty string"),
    ('{"prompt": ""}', "not a non-empty string"),
    ('{"buggy_solution": "x"}', "needs an instruction"),
    ('{"other": 1}', "no turns, buggy_solution, prompt or text field"),
])
def test_a_malformed_jsonl_record_is_one_error_naming_its_line(tmp_path, capsys, record, said):
    """Refused while reading the file (before the model resolves: an unknown model here), naming file:line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + record + "\n")
    assert main(["exit-layers", "--model", "no-such-model", "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert f"{prompts}:2: " in err and said in err and "Traceback" not in err and "unknown model" not in err


def test_layers_that_name_none_are_refused(capsys):
    """`--layers ,` is an error before the model loads, and `layers=[]` one in the API: never the defaults instead."""
    for layers in (",", "", " , "):
        assert main(["exit-layers", "--model", "no-such-model", "--layers", layers]) == 2
        err = capsys.readouterr().err
        assert "--layers names no exit layer" in err and "unknown model" not in err
    llm = SimpleNamespace(model=SimpleNamespace(cfg=SimpleNamespace(num_layers=3)), tokenizer=None, name="x")
    with pytest.raises(ValueError, match="exit layers must be in 1..3.*got \\[\\]"):
        measure_exit_layers(llm, layers=[])


def test_quality_of_no_task_is_refused():
    from specdec.quality import measure

    for tasks in (0, -1):
        with pytest.raises(ValueError, match="tasks must be at least 1"):
            measure("x", "/no/such/folder", ["q8"], "fp32", tasks=tasks)


class ClockedModel:
    """A model whose forwards advance a fake clock: base cost (exit layer L of 10: L / 5; the full step 2, its n
    positions 2 (1 + (n - 1) / 2)) plus 1.0 on each variant's first call (a first-touch cost the warm-up round must
    absorb). Its cache checks each forward is rewound to the prefilled context."""

    cfg = SimpleNamespace(vocab_size=10)

    def __init__(self):
        self.now, self.seen = 0.0, set()

    def new_cache(self, size):
        model = self

        class Cache:
            length = 0

            def rewind(self, n):
                self.length -= n

        model.cache, model.size = Cache(), size
        return model.cache

    def __call__(self, tokens, cache, exit_layer=None):
        n = tokens.shape[1]
        cache.length += n
        assert cache.length <= self.size
        key = (n, exit_layer)
        self.now += (exit_layer or 10) / 5 * (1 + (n - 1) / 2) + (key not in self.seen)
        self.seen.add(key)


def test_measure_costs_are_ratios_of_medians_after_the_warm_up(monkeypatch):
    """tau(L) = t(L layers) / t(full step) and verify = t(n positions) / t(one), each over the timed rounds only:
    a first-touch cost in the warm-up round never reaches them, and every forward is rewound to the context."""
    from specdec import exit_layers

    model = ClockedModel()
    monkeypatch.setattr(exit_layers, "time", SimpleNamespace(perf_counter=lambda: model.now))
    tau, verify = exit_layers.measure_costs(model, [2, 5], verify_positions=3, context=4, repeats=1)
    assert tau == pytest.approx({2: 0.2, 5: 0.5}) and verify == pytest.approx(2.0)
    assert model.cache.length == 4


def test_invalid_counts_and_layers_are_refused_by_the_api():
    llm = SimpleNamespace(model=SimpleNamespace(cfg=SimpleNamespace(num_layers=3)), tokenizer=None, name="x")
    for kwargs, said in ((dict(layers=[0, 1]), "exit layers must be in 1..3"), (dict(k=0), "k must be >= 1"),
                         (dict(max_new_tokens=1), "max_new_tokens >= 2"), (dict(prompts=[]), "no prompts")):
        with pytest.raises(ValueError, match=said):
            measure_exit_layers(llm, **kwargs)


def test_alpha_counts_the_positions_reached():
    """A draft position is reached when every earlier one was accepted: a round of 3 accepting 1 reached 2."""
    from specdec.exit_layers import _alpha

    rounds = [dict(accepted=0, drafted=2), dict(accepted=2, drafted=2), dict(accepted=1, drafted=3)]
    assert _alpha(rounds) == (3, 7, 1 + 2 + 2)


def test_the_report_follows_its_formulas(tiny_folder, monkeypatch):
    """Each row from the decodes it ran (recorded here) and fixed costs: alpha = accepted / reached, tau never below
    L/N, the lesson's and the measured-verify predictions, tokens/s over plain's, the reuses of its own prompts, and
    the best L the largest measured-verify prediction below the last layer."""
    import torch

    import specdec.decode
    from specdec import exit_layers, theory
    from specdec.runtime.loader import load_transformer
    from specdec.tokenizer import Tokenizer

    model, tok = load_transformer(tiny_folder, torch.float32), Tokenizer(tiny_folder)
    llm = SimpleNamespace(name="tiny", model=model, tokenizer=tok)
    costs, verify = {1: 0.05, 2: 0.9, 3: 1.2}, 1.5  # L = 1 timed below its floor of 1/3
    monkeypatch.setattr(exit_layers, "measure_costs",
                        lambda m, layers, n, repeats: ({L: costs[L] for L in layers}, verify))
    runs, reused, decode = {}, {}, specdec.decode.decode

    def recorded(model, tok, ids, request, drafter, policy):
        name = drafter.exit_layer if drafter else "plain"
        before = drafter.reused if drafter else 0
        chunks = list(decode(model, tok, ids, request, drafter, policy))
        if request.max_new_tokens == 12:  # not the warm-up's 8
            runs.setdefault(name, []).append(chunks[-1].result)
            reused[name] = reused.get(name, 0) + (drafter.reused - before if drafter else 0)
        yield from chunks

    monkeypatch.setattr(specdec.decode, "decode", recorded)
    k = 2
    report = measure_exit_layers(llm, ["abcabcabc", "the cat sat on the mat. the cat"], [1, 2, 3], k=k,
                                 max_new_tokens=12)
    plain = runs["plain"]
    plain_tps = sum(r.new_tokens for r in plain) / sum(r.seconds for r in plain)
    plain_step = sum(r.target_seconds for r in plain) / sum(r.target_forwards for r in plain)
    assert report.plain_tokens_per_s == pytest.approx(plain_tps) and report.verify_cost == verify
    for row in report.rows:
        L, rs = row.exit_layer, runs[row.exit_layer]
        rounds = [x for r in rs for x in r.rounds if x["drafted"]]
        acc, drafted = sum(x["accepted"] for x in rounds), sum(x["drafted"] for x in rounds)
        alpha = acc / sum(min(x["drafted"], x["accepted"] + 1) for x in rounds)
        tau = max(costs[L], L / 3)
        tps = sum(r.new_tokens for r in rs) / sum(r.seconds for r in rs)
        assert (row.alpha, row.acceptance_rate, row.tau) == pytest.approx((alpha, acc / drafted, tau))
        assert row.mean_accepted == pytest.approx(sum(r.new_tokens for r in rs) / sum(r.target_forwards for r in rs))
        assert row.tau_loop == pytest.approx(sum(x["draft_s"] for x in rounds) / drafted / plain_step)
        assert row.predicted == pytest.approx(theory.speedup(alpha, k, tau))
        assert row.predicted_measured == pytest.approx(theory.expected_tokens(alpha, k) / (verify + k * tau))
        assert row.best_k == theory.best_k(alpha, tau) and row.reused == reused[L]
        assert (row.tokens_per_s, row.speedup) == pytest.approx((tps, tps / plain_tps))
    assert report.rows[0].alpha > report.rows[0].acceptance_rate  # a rejection before the last position: they differ
    assert report.row(3).alpha == 1.0 and report.row(3).reused > 0 and report.row(2).reused > 0
    assert report.best == max(report.rows[:2], key=lambda r: (r.predicted_measured, -r.exit_layer)).exit_layer
    assert (report.k, report.prompts, report.num_layers) == (k, 2, 3)


def test_the_best_row_is_the_largest_prediction_below_the_last_layer_shallowest_on_a_tie():
    from specdec.exit_layers import ExitLayerRow, best_row

    def row(L, predicted_measured, predicted=0.5):
        return ExitLayerRow(L, 0.5, 0.5, 1.0, 0.5, 0.5, predicted, predicted_measured, 1, 10.0, 1.0)

    rows = [row(2, 0.8, predicted=0.9), row(4, 0.9, predicted=0.1), row(6, 0.9), row(8, 2.0)]
    assert best_row(rows, 8).exit_layer == 4  # not 8 (the last layer), not 6 (a tie, deeper), not 2 (by predicted)


def fake_llm(name="m"):
    import torch

    model = SimpleNamespace(dtype=torch.float32, kv_choice=None, device=torch.device("cpu"),
                            cfg=SimpleNamespace(num_layers=8))
    return SimpleNamespace(name=name, model=model, tokenizer=None)


def test_best_exit_layer_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    """No cache: measure=False is a LookupError naming the command; measure=True measures (48 tokens unless told),
    saves, and the next call reads that report back without measuring."""
    from specdec import exit_layers
    from specdec.exit_layers import ExitLayerReport, ExitLayerRow, best_exit_layer, load_cached

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    llm, calls = fake_llm(), []
    assert load_cached("m", "float32") is None
    with pytest.raises(LookupError, match="specdec exit-layers --model m"):
        best_exit_layer(llm, measure=False)

    def measured(llm, progress=None, **kwargs):
        calls.append(kwargs)
        rows = [ExitLayerRow(3, 0.5, 0.4, 1.5, 0.4, 0.4, 1.1, 1.2, 2, 10.0, 1.1)]
        return ExitLayerReport("m", "float32", 8, 4, 48, 3, 1, True, 1.2, 9.0, rows, best=3)

    monkeypatch.setattr(exit_layers, "measure_exit_layers", measured)
    best, report = best_exit_layer(llm, k=2)
    assert best == 3 and calls == [dict(k=2, max_new_tokens=48)]
    again, cached = best_exit_layer(llm, measure=False)
    assert again == 3 and cached == report and len(calls) == 1


@pytest.mark.parametrize("text", ['{"rows": [{"exit_layer": 1}]}', "[1, 2]", "{not json", '{"model": "m"}'])
def test_a_damaged_cache_reads_as_none(tmp_path, monkeypatch, text):
    """An older or damaged measurement is measured again, never a traceback."""
    from specdec.exit_layers import load_cached
    from specdec.store import measurement_path

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    path = measurement_path("exit_layers", "m", "float32")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert load_cached("m", "float32") is None


def test_no_reuse_measures_drafters_that_reuse_nothing(tiny_folder, monkeypatch):
    """reuse=False (`--no-reuse`): every verification runs the plain forward, and the report says so."""
    import torch

    from specdec import exit_layers
    from specdec.runtime.loader import load_transformer
    from specdec.tokenizer import Tokenizer

    model, tok = load_transformer(tiny_folder, torch.float32), Tokenizer(tiny_folder)
    llm = SimpleNamespace(name="tiny", model=model, tokenizer=tok)
    monkeypatch.setattr(exit_layers, "measure_costs", lambda m, layers, n, repeats: ({L: 0.5 for L in layers}, 1.0))
    report = measure_exit_layers(llm, ["abcabcabc"], [2, 3], k=2, max_new_tokens=8, reuse=False)
    assert report.reuse is False and [r.reused for r in report.rows] == [0, 0] and report.row(3).alpha == 1.0


def test_read_prompts_takes_each_format_s_prompt(tmp_path):
    """Spec-Bench's first turn, HumanEvalFix's instruction + declaration + buggy code, "prompt" before "text"; blank
    lines skipped, at most `limit` prompts, and a file of none an error."""
    from specdec.commands.exit_layers import read_prompts
    from specdec.errors import SpecdecError

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"turns": ["first", "second"]}\n\n'
                     '{"instruction": "Fix it.", "declaration": "def f():\\n", "buggy_solution": "  return 1"}\n'
                     '{"prompt": "p", "text": "t"}\n{"text": "t"}\n')
    assert read_prompts(str(jsonl), None) == ["first", "Fix it.\n\ndef f():\n  return 1", "p", "t"]
    assert read_prompts(str(jsonl), 2) == ["first", "Fix it.\n\ndef f():\n  return 1"]
    text = tmp_path / "p.txt"
    text.write_text("one\n\n  \ntwo\nthree\n")
    assert read_prompts(str(text), None) == ["one", "two", "three"] and read_prompts(str(text), 1) == ["one"]
    text.write_text("\n \n")
    with pytest.raises(SpecdecError, match="no prompts"):
        read_prompts(str(text), None)


def test_the_command_passes_its_options_and_marks_the_best(tmp_path, monkeypatch, capsys):
    """--limit cuts the built-in prompts, --no-reuse, --layers, --k and --max-new-tokens reach the measurement; the best
    row is marked, and a best below 1x is said to lose to plain decoding (above 1x it is not); --limit 0 is refused."""
    import specdec.api
    from specdec.commands import exit_layers as command
    from specdec.exit_layers import DEFAULT_PROMPTS, ExitLayerReport, ExitLayerRow

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr(specdec.api, "LLM", lambda model, **kwargs: SimpleNamespace(name=model))
    seen = []

    def measured(llm, prompts, layers, predicted=0.9, **kwargs):
        seen.append(dict(prompts=prompts, layers=layers, **kwargs))
        rows = [ExitLayerRow(L, 0.5, 0.4, 1.5, 0.4, 0.4, 1.0, p, 2, 10.0, 1.0) for L, p in ((2, 0.8), (4, predicted))]
        return ExitLayerReport("m", "float32", 8, 3, 5, len(prompts), 1, kwargs["reuse"], 1.2, 9.0, rows, best=4)

    monkeypatch.setattr(command, "measure_exit_layers", measured)
    args = ["exit-layers", "--model", "m", "--limit", "2", "--no-reuse", "--layers", "2,4", "--k", "3",
            "--max-new-tokens", "5"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert seen[0]["prompts"] == list(DEFAULT_PROMPTS[:2]) and seen[0]["layers"] == [2, 4]
    assert (seen[0]["reuse"], seen[0]["k"], seen[0]["max_new_tokens"]) == (False, 3, 5)
    marked = [line.split()[0] for line in out if line.endswith("<- best")]
    assert marked == ["4"] and any(line.startswith("no exit layer is predicted to beat") for line in out)
    monkeypatch.setattr(command, "measure_exit_layers", lambda *a, **kw: measured(*a, predicted=1.3, **kw))
    assert main(args) == 0
    assert "no exit layer is predicted" not in capsys.readouterr().out
    assert main(["exit-layers", "--model", "m", "--limit", "0"]) == 2
    assert "--limit must be at least 1" in capsys.readouterr().err


class NextModel:
    """A model over `vocab` tokens that gives probability 1/2 to (token + 1) % vocab after each token ((token + odd)
    % vocab after an odd one), the rest shared evenly."""

    def __init__(self, vocab, odd=1):
        self.vocab, self.odd = vocab, odd

    def new_cache(self, size):
        return None

    def __call__(self, tokens, cache):
        import torch

        probs = torch.full((*tokens.shape, self.vocab), 0.5 / (self.vocab - 1))
        shift = torch.where(tokens % 2 == 1, self.odd, 1)
        probs.scatter_(-1, ((tokens + shift) % self.vocab)[..., None], 0.5)
        return SimpleNamespace(logits=probs.log())


def test_score_sums_the_nll_of_the_answer_tokens_from_the_positions_before_them():
    """Tokens 0 1 2 | 3 4 0 2 (answer from 3) over 5 tokens: each answer token is scored from the logits one position
    before it: 3, 4, 0 were predicted (1/2), 2 was not (1/8); argmaxes 3 4 0 1."""
    import math

    from specdec.quality import score

    top, nll, count = score(NextModel(5), [([0, 1, 2, 3, 4, 0, 2], 3)])
    assert count == 4 and nll == pytest.approx(-3 * math.log(0.5) - math.log(0.125))
    assert [t.tolist() for t in top] == [[3, 4, 0, 1]]


def test_quality_measures_the_reference_first_and_agreement_against_it(tiny_folder):
    """Perplexity exp(mean NLL) over the first `tasks` answers (the declaration and solution after the chat prompt),
    the reference scored once and first, and top-1 agreement the share of positions whose argmax is the reference's."""
    import json
    import math

    from specdec.bench.prompts import resolve_prompts
    from specdec.bench.runner import chat_ids
    from specdec.quality import held_in, measure, score
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer(tiny_folder)
    texts = held_in(tok, 2)
    vocab = max(max(ids) for ids, _ in texts) + 1
    t = json.loads(resolve_prompts("humanevalfix").read_text().splitlines()[1])
    user = t["instruction"] + "\n\n" + t["declaration"] + t["buggy_solution"]
    prompt = chat_ids(tok, [{"role": "user", "content": user}])
    answer = tok.hf.encode(t["declaration"] + t["canonical_solution"], add_special_tokens=False)
    assert len(texts) == 2 and texts[1] == (prompt + answer, len(prompt))
    loaded = []

    def load(folder, dtype):
        loaded.append(dtype)
        return NextModel(vocab, odd=1 if dtype == "ref" else 2)

    results = measure("m", tiny_folder, ["other", "ref"], "ref", tasks=2, load=load)
    assert loaded == ["ref", "other"] and [r.dtype for r in results] == ["ref", "other"]
    (ref_top, nll, count), (other_top, _, _) = score(NextModel(vocab), texts), score(NextModel(vocab, odd=2), texts)
    agree = sum(int((a == b).sum()) for a, b in zip(ref_top, other_top)) / count
    assert count == sum(len(ids) - start for ids, start in texts) == results[0].tokens == results[1].tokens
    assert results[0].perplexity == pytest.approx(math.exp(nll / count)) and results[0].agreement == 1.0
    assert results[1].agreement == pytest.approx(agree) and 0 < agree < 1


def test_quality_saves_each_result_under_its_dtype_and_kv_dtype(tiny_folder, tmp_path, monkeypatch, capsys):
    """Results land in quality/MODEL-DTYPE.json, DTYPE+kv-KV under a --kv-dtype other than auto; --tasks of exactly the
    set is not "more"; the table prints perplexity then agreement; --tasks 0 and --ref auto are refused before the
    model resolves."""
    import json

    import specdec.quality
    from specdec.quality import QualityResult
    from specdec.store import measurement_path

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    fake = lambda name, folder, dtypes, ref, tasks, load: [QualityResult(name, d, "fp32", 9, 1.5, 1.0)  # noqa: E731
                                                         for d in ("fp32", "q4")]
    monkeypatch.setattr(specdec.quality, "measure", fake)
    model = str(tiny_folder)
    assert main(["quality", "--model", model, "--dtype", "q4", "--ref", "fp32", "--tasks", "1", "--json"]) == 0
    assert main(["quality", "--model", model, "--dtype", "q4", "--ref", "fp32", "--kv-dtype", "fp32", "--json"]) == 0
    for name in ("fp32", "q4", "fp32+kv-fp32", "q4+kv-fp32"):
        assert json.loads(measurement_path("quality", model, name).read_text())["perplexity"] == 1.5
    capsys.readouterr()
    available = len(specdec.quality.resolve_prompts("humanevalfix").read_text().splitlines())
    assert main(["quality", "--model", model, "--dtype", "q4", "--ref", "fp32", "--tasks", str(available)]) == 0
    out = capsys.readouterr().out
    assert f"of {available} HumanEvalFix dev tasks, KV" in out and "asked for more" not in out  # all, not more
    assert " fp32      1.5000        100.00%" in out  # perplexity, then the agreement
    table = out.splitlines()[1:]  # --dtype's names, not torch's ("bfloat16" overran its column), aligned
    assert table[0].split() == ["dtype", "perplexity", "top-1", "vs", "fp32"] and len({len(t) for t in table}) == 1
    for bad, said in ((["--tasks", "0"], "--tasks must be at least 1"), (["--ref", "auto"], "not 'auto'")):
        assert main(["quality", "--model", "no-such-model", *bad]) == 2
        err = capsys.readouterr().err
        assert said in err and "unknown model" not in err
