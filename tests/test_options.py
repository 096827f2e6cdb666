"""Options and prompts are checked in one place (specdec.options) with one error type, and `specdec.LLM`
applies them: a stop string is one string, bools are not counts, bytes and bad token ids are refused."""

import pytest

from specdec.errors import SpecdecError
from specdec.options import (GenerationOptions, LookaheadConfig, OptionError, check_exit_layer, check_k, check_prompt,
                             check_setup, check_sources, check_tree)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from specdec import LLM
    from tests.tiny import save_tiny

    return LLM(str(save_tiny("llama", tmp_path_factory.mktemp("options"))), dtype="fp32")


def test_one_error_type_for_users():
    assert issubclass(OptionError, SpecdecError) and issubclass(OptionError, ValueError)


def test_stop_is_one_string_and_none_is_no_stop():
    assert GenerationOptions(stop="END").stop == ("END",)
    assert GenerationOptions(stop=None).stop == ()
    assert GenerationOptions(stop=["a", "bc"]).request.stop == ("a", "bc")
    assert GenerationOptions(stop="\n\n").stop == ("\n\n",)  # whitespace is a fine stop string
    for bad in ([""], [3], 3, ["a\udcff"]):
        with pytest.raises(OptionError, match="stop"):
            GenerationOptions(stop=bad)


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_new_tokens=True), "max_new_tokens"), (dict(k=True), "k must"), (dict(k=-1), "k must"),
    (dict(top_k=False), "top_k"), (dict(seed=2**64), "2\\*\\*64-1"), (dict(seed=-1), "seed"),
    (dict(seed=True), "seed"), (dict(method="telepathy"), "unknown method"), (dict(chat="yes"), "chat"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=0), "top_p"),
    (dict(k=4), "method 'plain' drafts nothing"), (dict(acceptance="typical"), "method 'plain' drafts nothing"),
    (dict(method="medusa", posterior_alpha=0.3), "posterior_alpha tunes typical acceptance"),
    *[(dict(method="medusa", acceptance="typical", **bad), "posterior_threshold \\(epsilon\\) in \\(0, 1\\]")
      for bad in (dict(posterior_threshold=0), dict(posterior_threshold=1.01), dict(posterior_threshold=True),
                  dict(posterior_alpha=0), dict(posterior_alpha=float("inf")), dict(posterior_alpha=True))],
])
def test_bad_options(kwargs, words):
    with pytest.raises(OptionError, match=words):
        GenerationOptions(**kwargs)


def test_numpy_numbers_are_numbers():
    """A seed or a length read from an array is numpy's scalar: taken as Python's number (bools still refused)."""
    np = pytest.importorskip("numpy")
    o = GenerationOptions(max_new_tokens=np.int64(5), seed=np.uint64(2**64 - 1), top_k=np.int32(3),
                          temperature=np.float32(0.5), top_p=np.float16(0.5), method="prompt-lookup", k=np.int8(4))
    assert (o.max_new_tokens, o.seed, o.top_k, o.k, o.temperature, o.top_p) == (5, 2**64 - 1, 3, 4, 0.5, 0.5)
    assert [type(v) for v in (o.max_new_tokens, o.seed, o.k, o.temperature)] == [int, int, int, float]
    with pytest.raises(OptionError, match="max_new_tokens"):
        GenerationOptions(max_new_tokens=np.bool_(True))
    with pytest.raises(OptionError, match="temperature"):
        GenerationOptions(temperature=np.float32("nan"))


def test_typical_acceptance_edges():
    o = GenerationOptions(method="medusa", acceptance="typical", posterior_threshold=1, posterior_alpha=1e-9)
    assert (o.request.posterior_threshold, o.request.posterior_alpha) == (1, 1e-9)


def test_seed_range_edges():
    GenerationOptions(seed=0)
    GenerationOptions(seed=2**64 - 1)


@pytest.mark.parametrize("prompt, words", [
    ("", "empty"), (" \n\t", "empty"), ("a\udcffb", "UTF-8"), (b"hi", "bytes"), ([], "empty"),
    ([1, True], "bools"), ([1.5], "integer token ids"), (None, "text or a sequence"),
])
def test_bad_prompts(prompt, words):
    with pytest.raises(OptionError, match=words):
        check_prompt(prompt)


def test_token_ids_inside_the_vocabulary():
    assert check_prompt((1, 2, 95), vocab_size=96) == [1, 2, 95]
    for ids in ([96], [-1]):
        with pytest.raises(OptionError, match="outside the model's vocabulary"):
            check_prompt(ids, vocab_size=96)


def test_k_is_auto_or_0_to_1000():
    assert [check_k(k) for k in ("auto", 0, 1000)] == ["auto", 0, 1000]
    for bad in (-1, 1001, 10**6, 2.0, True, "4", None):
        with pytest.raises(OptionError, match=r"k must be an integer 0\.\.1000 or 'auto'"):
            check_k(bad)


def test_setup_checks():
    assert check_sources("prompt-lookup, draft") == ["prompt-lookup", "draft"]
    with pytest.raises(OptionError, match="unknown hybrid source 'nosuch'"):
        check_sources("prompt-lookup,nosuch")
    with pytest.raises(OptionError, match="unknown hybrid source 'plain'"):
        check_sources(["plain"])
    assert check_exit_layer("3") == 3 and check_exit_layer("auto") == "auto"
    for bad in ("x", 0, True, "-1"):
        with pytest.raises(OptionError, match="exit layer"):
            check_exit_layer(bad)
    with pytest.raises(OptionError, match="1..3"):
        check_exit_layer(4, layers=3)
    with pytest.raises(OptionError, match="--draft"):
        check_setup(method="draft")
    with pytest.raises(OptionError, match="include draft, which needs a draft model: pass --draft NAME .* or sources "
                                          "without it, e.g. --sources prompt-lookup,recycling"):
        check_setup(method="hybrid")  # the default sources use a draft model
    check_setup(method="hybrid", sources="prompt-lookup,lookahead")


def test_tree_and_heads_are_checked_before_anything_loads(tmp_path, capsys):
    """A missing tree file or heads folder, a paths file for EAGLE or an EAGLE-only tree name for Medusa: one line
    before the model loads (they were found only when the drafter was built, after loading)."""
    from specdec.cli import main

    paths = tmp_path / "tree.json"
    paths.write_text("[[0], [0, 0]]")
    (tmp_path / "config.json").write_text("{}")  # a heads folder as far as the early check looks
    check_setup(method="medusa", tree=str(paths), heads=str(tmp_path))
    for tree in ("auto", "chain", "dynamic", "static"):
        check_setup(method="eagle", tree=tree)
    with pytest.raises(OptionError, match="no such file"):
        check_setup(method="medusa", tree=str(tmp_path / "nothing.json"))
    with pytest.raises(OptionError, match="EAGLE drafts an auto, dynamic, static or chain tree"):
        check_setup(method="eagle", tree=str(paths))
    for tree in ("dynamic", "static"):
        with pytest.raises(OptionError, match="Medusa drafts an auto"):
            check_setup(method="medusa", tree=tree)
    with pytest.raises(OptionError, match="no such folder"):
        check_setup(heads=str(tmp_path / "nothing"))
    with pytest.raises(OptionError, match="no such file"):  # the builders compare names as given: so does the check
        check_setup(method="medusa", tree=" chain ")
    with pytest.raises(OptionError, match="Medusa drafts an auto"):  # a hybrid's source: also before loading
        check_setup(method="hybrid", sources="prompt-lookup,medusa", tree="static")
    with pytest.raises(OptionError, match="EAGLE drafts"):
        check_setup(method="hybrid", sources="eagle,prompt-lookup", tree=str(paths))
    for heads in (123, ""):
        with pytest.raises(OptionError, match="no such folder"):
            check_setup(heads=heads)
    assert check_tree(paths) == str(paths)  # a Path is a file name
    assert main(["bench", "--prompts", "spec-bench", "--out", ""]) == 2
    assert "--out is empty" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "no-such-model", "--method", "medusa", "--tree", "x.json"]) == 2
    assert "tree 'x.json': no such file" in capsys.readouterr().err  # before the unknown model is looked up
    assert main(["bench", "--prompts", "spec-bench", "--methods", "medusa@static", "--out", str(tmp_path / "b")]) == 2
    assert "medusa trees are auto, chain" in capsys.readouterr().err


def test_tree_and_heads_paths_are_of_the_right_kind_and_bind_only_their_method(tmp_path):
    """A folder is no paths file and a file is no heads folder. A tree name or paths file binds only the method it
    is for: `bench --methods eagle --tree dynamic` (or `medusa --tree paths.json`) also checks plain with it."""
    paths = tmp_path / "tree.json"
    paths.write_text("[[0], [0, 0]]")
    with pytest.raises(OptionError, match="no such file"):
        check_setup(method="medusa", tree=str(tmp_path))
    with pytest.raises(OptionError, match="a file, not a folder"):  # was "no such folder" for a file that is there
        check_setup(method="medusa", heads=str(paths))
    (tmp_path / "empty").mkdir()  # a folder without a config.json: refused now, not after the model has loaded
    with pytest.raises(OptionError, match="no config.json in it, so no heads"):
        check_setup(method="eagle", heads=str(tmp_path / "empty"))
    for method in (None, "plain", "prompt-lookup"):
        for tree in ("dynamic", "static", str(paths)):
            check_setup(method=method, tree=tree)


def test_lookahead_config():
    import specdec

    assert specdec.LookaheadConfig is LookaheadConfig
    assert LookaheadConfig.of("auto") == LookaheadConfig() and LookaheadConfig().auto
    assert LookaheadConfig.of((3, 4, 3)) == LookaheadConfig(3, 4, 3, True)
    assert not LookaheadConfig.of((3, 4, 3, False)).pool and not LookaheadConfig(3, 4, 3).auto
    for bad in (dict(window=-1), dict(ngram=1), dict(guesses=0), dict(window=True), dict(pool="no")):
        with pytest.raises(OptionError, match="lookahead"):
            LookaheadConfig(**bad)
    with pytest.raises(OptionError, match="LookaheadConfig"):
        LookaheadConfig.of([3, 4, 3])


# --- the API -------------------------------------------------------------------------------------

def test_api_stop_string_is_not_its_characters(llm):
    free = llm.generate("hello", chat=False, max_new_tokens=16)
    char = free.text.strip()[0]
    # "c" + text the model never writes: split into characters it would stop at once
    r = llm.generate("hello", chat=False, max_new_tokens=16, stop=char + "\x7f\x7f")
    assert r.text == free.text and r.token_ids == free.token_ids
    assert llm.generate("hello", chat=False, max_new_tokens=16, stop=char).text == free.text[:free.text.index(char)]
    assert llm.generate("hello", chat=False, max_new_tokens=16, stop=None).text == free.text


@pytest.mark.parametrize("prompt, kwargs, words", [
    ("a\udcffb", {}, "UTF-8"), (b"hi", {}, "bytes"), ([5, 10**6], {}, "vocabulary"), ([5, -3], {}, "vocabulary"),
    ("hi", dict(max_new_tokens=True), "max_new_tokens"), ("hi", dict(k=True, method="prompt-lookup"), "k must"),
    ("   ", {}, "empty"), ("hi", dict(stop=[""]), "stop"),
])
def test_api_refuses_with_one_error(llm, prompt, kwargs, words):
    with pytest.raises(OptionError, match=words):
        llm.generate(prompt, **kwargs)
    with pytest.raises(OptionError, match=words):
        llm.stream(prompt, **kwargs)  # at the call, before the first item is asked for


def test_a_prompt_past_the_context_is_refused_at_the_call(llm):
    """stream() too: code that sends a header before iterating learns of it first."""
    n = llm.model.cfg.max_position_embeddings
    for call in (llm.generate, llm.stream, llm.chunks):
        with pytest.raises(SpecdecError, match=r"exceed the model's context .* lower max_new_tokens"):
            call("hi", chat=False, max_new_tokens=n)
        with pytest.raises(SpecdecError, match="the prompt is empty"):
            call([], max_new_tokens=2)
    llm.chunks([5, 6], max_new_tokens=n - 2)  # exactly the context: fits (nothing runs until iterated)


def test_api_lookahead_config_and_tuple(llm, tmp_path_factory):
    from specdec import LLM

    plain = llm.generate("abcabcabc", chat=False, max_new_tokens=12)
    for config in (LookaheadConfig(2, 3, 2), (2, 3, 2), (2, 3, 2, False)):
        other = LLM(str(llm.folder), dtype="fp32", lookahead=config)
        r = other.generate("abcabcabc", chat=False, max_new_tokens=12, method="lookahead")
        assert r.token_ids == plain.token_ids
    with pytest.raises(OptionError, match="lookahead ngram"):
        LLM(str(llm.folder), lookahead=(2, 1, 2))


def test_threads_asking_a_fresh_llm_at_once_probe_and_build_once(tmp_path, monkeypatch):
    """Eight threads' first requests on one LLM: one forward-cost probe (each had run its own, under the others'
    load, and the last one's curve was cached) and one recycling table."""
    import threading
    import time

    from specdec import LLM
    from specdec import probe as probe_mod
    from tests.tiny import save_tiny

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    llm = LLM(str(save_tiny("llama", tmp_path / "m")), dtype="fp32")
    calls, real = [], probe_mod.probe

    def slow_probe(*a, **k):
        calls.append(1)
        time.sleep(0.2)  # long enough for every thread to arrive while it runs
        return real(*a, **k)

    monkeypatch.setattr(probe_mod, "probe", slow_probe)
    got = []
    threads = [threading.Thread(target=lambda: got.append(llm.drafter("recycling"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 8 and llm._recycling is not None


def test_api_checks_settings_before_loading(monkeypatch, llm):
    from specdec import LLM, api

    def load(*a, **k):
        raise AssertionError("loaded before checking")

    monkeypatch.setattr(api, "load_transformer", load)
    for kwargs in (dict(sources="nosuch"), dict(exit_layer="x"), dict(lookahead=(1, 1, 1)),
                   dict(sources=["prompt-lookup", 5]), dict(sources=5), dict(sources=None), dict(sources=[["a"]]),
                   dict(datastore=5), dict(datastore=""), dict(datastore=str(llm.folder / "no-such-store"))):
        with pytest.raises(OptionError):  # was: AttributeError / TypeError, or a datastore unread until generate
            LLM(str(llm.folder), **kwargs)


def test_unknown_keyword_is_an_option_error(llm):
    """`except ValueError` catches every bad option, an unknown name too (it was a TypeError)."""
    for call in (llm.generate, llm.stream, llm.chunks):
        with pytest.raises(OptionError, match="unknown option 'n': the options are max_new_tokens, "):
            call("hi", n=2)  # at the call, stream too
    with pytest.raises(OptionError, match="unknown options 'bogus', 'logprobs'"):
        llm.generate("hi", logprobs=1, bogus=True)


def test_the_api_checks_a_tree_against_its_method_before_the_heads_load(tmp_path):
    """`LLM(tree=...)` cannot know the method; `generate(method=...)` checks it first (an OptionError, not the
    heads' loader failing to read 'dynamic' as a paths file), for a hybrid's sources too."""
    from specdec.api import LLM
    from tests.tiny import save_tiny

    llm = LLM(str(save_tiny("qwen2", tmp_path / "m")), dtype="fp32", tree="dynamic",
              sources="prompt-lookup,medusa")
    for method in ("medusa", "hybrid"):
        with pytest.raises(OptionError, match="Medusa drafts an auto"):
            llm.generate([1, 2, 3], method=method, max_new_tokens=2)
    with pytest.raises(OptionError, match="unknown device"):
        LLM(str(tmp_path / "m"), device=0)


def test_setup_edges():
    """The last layer is a valid exit layer, hybrid is no source of itself, tree_nodes 0 and a blank draft are refused."""
    assert check_exit_layer(3, layers=3) == 3 and check_exit_layer(" 2 ") == 2
    with pytest.raises(OptionError, match="unknown hybrid source 'hybrid'"):
        check_sources(["hybrid", "prompt-lookup"])
    with pytest.raises(OptionError, match="tree_nodes must be an integer >= 1"):
        check_setup(tree_nodes=0)
    check_setup(tree_nodes=1)
    with pytest.raises(OptionError, match="draft must be a model name or path"):
        check_setup(draft="  ", method="draft")


def test_an_exit_layer_of_other_digits_is_an_option_error():
    """`--exit-layer ²` is an OptionError naming the exit layer ("²".isdigit() held and int() raised its own error)."""
    with pytest.raises(OptionError, match="exit layer"):
        check_exit_layer("²")
    assert check_exit_layer("٣") == 3  # decimal digits of any script are what int() reads


# --- QA: mutation audit of the API (each test kills a mutant of specdec/api.py) -----------------------------

@pytest.fixture(scope="module")
def twin(llm):
    """The tiny model with itself as its draft model, exit layer 1 and a 3-node recycling tree: every drafter
    builds without a probe."""
    from specdec import LLM

    return LLM(str(llm.folder), dtype="fp32", draft=str(llm.folder), exit_layer=1, tree_nodes=3,
               sources="prompt-lookup,recycling")


@pytest.mark.parametrize("method", ["recycling", "early-exit", "draft"])
def test_each_request_drafts_with_its_own_drafter(twin, method):
    """What is slow to build is built once, but each request gets its own copy (its caches, its context)."""
    first, second = twin.drafter(method), twin.drafter(method)
    assert first is not second and type(first) is type(second)


def test_a_draft_model_is_priced_by_its_share_of_the_weights(twin):
    """A draft model as large as the target starts adaptive k with tau = 1 (a draft token costs a target step)."""
    assert twin.drafter("draft").tau_prior == pytest.approx(1.0)


def test_method_draft_without_a_draft_model_is_an_option_error(llm):
    with pytest.raises(OptionError, match="needs a draft model"):
        llm.generate("hi", method="draft", max_new_tokens=2)


def test_the_recycling_tree_is_the_budget_less_the_root(llm, monkeypatch):
    from specdec import LLM

    other = LLM(str(llm.folder), dtype="fp32")
    monkeypatch.setattr(other, "budget", lambda: 7)
    assert other.drafter("recycling").n == 6


def test_the_budget_is_the_most_positions_within_10_percent_of_one(llm, monkeypatch):
    monkeypatch.setattr(llm, "cost_curve", lambda measure=False: (lambda n: 1.1 if n <= 64 else 9.0))
    assert llm.budget() == 64
    monkeypatch.setattr(llm, "cost_curve", lambda measure=False: (lambda n: 1.0 if n <= 5 else 1.2))
    assert llm.budget() == 5


def test_given_lookahead_sizes_stay_and_the_budget_fits_the_rest(llm, monkeypatch):
    from specdec import LLM
    from specdec.drafters.lookahead import auto_config

    other = LLM(str(llm.folder), dtype="fp32", lookahead=LookaheadConfig(window=9))
    monkeypatch.setattr(other, "budget", lambda: 16)
    _, ngram, guesses = auto_config(16)
    assert other.lookahead_config() == (9, ngram, guesses)


def test_auto_k_policies_by_drafter(twin):
    """Lookahead with a window or a tree: its n-gram length, fixed; a bare chain and the other drafters: adaptive,
    the first round plain (it prices the prefill); a hybrid: one adaptive policy per source."""
    from specdec.adaptive import AdaptiveK, FixedK
    from specdec.drafters.lookahead import Lookahead

    assert twin.policy("auto", Lookahead(window=2, ngram=4, guesses=1)) == FixedK(3)
    assert twin.policy("auto", Lookahead(window=0, ngram=4, guesses=3)) == FixedK(3)
    chain = twin.policy("auto", Lookahead(window=0, ngram=4, guesses=1))
    assert isinstance(chain, AdaptiveK) and chain.k_max == 3 and chain.plain_first
    lookup = twin.policy("auto", twin.drafter("prompt-lookup"))
    assert isinstance(lookup, AdaptiveK) and lookup.plain_first
    assert twin.policy(2, twin.drafter("prompt-lookup")) == FixedK(2) and twin.policy("auto", None) is None
    hybrid = twin.drafter("hybrid")
    assert twin.policy("auto", hybrid) == FixedK(AdaptiveK.k_max)
    assert len(hybrid.policies) == 2 and all(isinstance(p, AdaptiveK) for p in hybrid.policies)


def test_a_curve_measured_when_asked_replaces_the_default(llm, monkeypatch):
    """None cached: cost_curve() is the mild default, measuring nothing; cost_curve(measure=True) then measures
    once, and keeps the measured curve."""
    from types import SimpleNamespace

    from specdec import LLM, probe
    from specdec.adaptive import CostCurve

    other = LLM(str(llm.folder), dtype="fp32")
    measured = SimpleNamespace(implausible=lambda: False, relative={1: 1.0, 64: 1.5})
    monkeypatch.setattr(probe, "load_cached", lambda *a: None)
    monkeypatch.setattr(probe, "probe", lambda *a: measured)
    monkeypatch.setattr(probe, "save", lambda result: None)
    assert other.cost_curve().points == CostCurve().points
    assert other.cost_curve(measure=True).points == measured.relative
    monkeypatch.setattr(probe, "probe", lambda *a: pytest.fail("measured twice"))
    assert other.cost_curve(measure=True).points == measured.relative


def test_chat_decides_the_prompts_tokens(llm):
    """chat=True wraps the prompt in the model's template, chat=False does not."""
    raw = llm.generate("hello", chat=False, max_new_tokens=1)
    chat = llm.generate("hello", chat=True, max_new_tokens=1)
    assert raw.prompt_tokens == len(llm.tokenizer.encode("hello", chat=False)) < chat.prompt_tokens


def test_stream_yields_no_empty_pieces(llm):
    """A long stop string holds text back, so some chunks carry none: stream skips them."""
    stop = "\x7f" * 6
    pieces = list(llm.stream("hello", chat=False, max_new_tokens=8, stop=stop))
    assert pieces and all(pieces)
    assert "".join(pieces) == llm.generate("hello", chat=False, max_new_tokens=8, stop=stop).text


def test_the_api_takes_lookahead_pool_and_eos_to_its_drafter(llm):
    from specdec import LLM

    other = LLM(str(llm.folder), dtype="fp32", lookahead=LookaheadConfig(2, 3, 2, pool=False))
    d = other.drafter("lookahead")
    assert (d.window, d.ngram, d.guesses, d.use_pool) == (2, 3, 2, False)
    assert d.eos_ids == set(other.tokenizer.eos_ids) and d.eos_ids  # no window column past a guessed EOS


def test_an_exit_layer_beyond_the_model_is_refused_when_it_loads(llm):
    from specdec import LLM

    with pytest.raises(OptionError, match=r"exit layer must be 'auto' or 1\.\.3, got 4"):
        LLM(str(llm.folder), dtype="fp32", exit_layer=4)


def test_lookahead_sizes_past_their_bounds_are_refused_before_loading():
    """W > 64, N > 16 or G > 64 was refused by the drafter, after the model loaded (and a probe ran)."""
    for bad in (dict(window=65), dict(ngram=17), dict(guesses=65)):
        with pytest.raises(OptionError, match=f"lookahead {next(iter(bad))} must be an integer"):
            LookaheadConfig(**bad)
    LookaheadConfig(window=64, ngram=16, guesses=64)


def test_pull_must_be_a_bool(llm, monkeypatch):
    """pull="no" is truthy: it would have pulled."""
    from specdec import LLM, store

    monkeypatch.setattr(store, "resolve", lambda *a, **k: pytest.fail("resolved before the check"))
    with pytest.raises(OptionError, match="pull must be True or False, got 'no'"):
        LLM(str(llm.folder), pull="no")


def test_llm_releases_its_threads_openmp_pool_after_loading_and_after_each_generation(tmp_path, monkeypatch):
    """Load in one thread, decode in another (a web app's workers): the loading thread's idle OpenMP pool made
    libgomp throttle the decoding thread's workers (0.76-0.85x the speed on 2 vCPUs), unless the user called
    `release_threads()` by hand. `LLM` now releases the pool of the thread that loaded it, and of the thread that
    decoded once a generation ends, however it ends (a stream left early included)."""
    import threading

    import specdec.api
    from specdec import LLM
    from tests.tiny import save_tiny

    calls = []
    monkeypatch.setattr(specdec.api, "release_threads", lambda: calls.append(threading.get_ident()) or 1)
    llm = LLM(str(save_tiny("llama", tmp_path / "m")), dtype="fp32")
    assert calls == [threading.get_ident()]
    worker = threading.Thread(target=lambda: llm.generate([1, 2, 3], max_new_tokens=4, method="prompt-lookup"))
    worker.start()
    worker.join()
    assert len(calls) == 2 and calls[1] == worker.ident
    stream = llm.stream([1, 2, 3], max_new_tokens=8)
    next(stream)
    assert len(calls) == 2  # still decoding
    stream.close()  # left early
    assert len(calls) == 3
    list(llm.stream([1, 2, 3], max_new_tokens=3))
    assert len(calls) == 4
