"""Self-distillation data (`specdec.training.regenerate`) and the batched hidden cache, on a tiny random
target: a left-padded batch gives each prompt the greedy continuation it gets alone (stop tokens and the
length limit included), prompts are each conversation's first user turn, and a cache built in batches of
right-padded documents holds what one-document forwards give."""

import json

import numpy as np
import torch

from specdec.runtime.loader import load_transformer
from specdec.tokenizer import Tokenizer
from specdec.training import hidden_cache
from specdec.training.regenerate import first_turn_prompts, greedy_batch, regenerate
from tests.tiny import save_tiny


def alone(model, prompt, max_len, stop):
    """Greedy decoding of one prompt with no padding: the reference."""
    ids = list(prompt)
    cache = model.new_cache(max_len)
    out = model(torch.tensor([ids]), cache)
    while len(ids) < max_len:
        t = int(out.logits[0, -1].argmax())
        ids.append(t)
        if t in stop:
            break
        out = model(torch.tensor([[t]]), cache)
    return ids


def test_left_padded_batch_gives_each_prompt_its_own_greedy_answer(tmp_path):
    model = load_transformer(save_tiny("llama", tmp_path, seed=3))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (1, 7, 3, 12, 5)]
    want = [alone(model, p, 24, set()) for p in prompts]
    assert [len(w) for w in want] == [24] * 5
    stop = {want[1][9]}  # a token one row emits mid-answer: that row ends there, the others may too
    got = greedy_batch(model, prompts, 24, stop)
    assert got == [alone(model, p, 24, stop) for p in prompts]
    assert len(got[1]) <= 10 and got[1][-1] in stop
    # a stop never emitted: every row runs to the limit, equal to the unstopped reference
    assert greedy_batch(model, prompts, 24, {10**6}) == want


def test_first_turn_prompts_and_regenerate(tmp_path):
    folder = save_tiny("llama", tmp_path, seed=3)
    model, tok = load_transformer(folder), Tokenizer(folder)
    conv = [[{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": "ignored"}]
            for i in range(5)]
    docs = conv + ["plain text has no turn to answer", [{"role": "assistant", "content": "no user"}]]
    prompts = list(first_turn_prompts(docs, tok, 200))
    assert len(prompts) == 5
    text = tok.hf.decode(prompts[0])
    assert "hello 0" in text and "ignored" not in text
    out = list(regenerate(model, iter(prompts), 40, set(tok.eos_ids), batch=2, max_tokens=10**6, progress=False))
    assert sorted(map(tuple, out)) == sorted(tuple(alone(model, p, 40, set(tok.eos_ids))) for p in prompts)
    few = list(regenerate(model, iter(prompts), 40, set(tok.eos_ids), batch=2, max_tokens=1, progress=False))
    assert len(few) == 2  # stops after the first batch that reaches max_tokens


def test_batched_cache_equals_one_document_forwards(tmp_path):
    model = load_transformer(save_tiny("llama", tmp_path, seed=1))
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (9, 4, 15, 6, 11)]
    one = hidden_cache.build(model, iter(docs), tmp_path / "one", 40, {"b": 1}, progress=False, layers=(0, 1))
    four = hidden_cache.build(model, iter(docs), tmp_path / "four", 40, {"b": 4}, progress=False, layers=(0, 1),
                              batch=4)
    assert len(one) == len(four) == 40  # the last document cut to fit
    for a in ("tokens", "labels", "doc"):
        assert np.array_equal(one.__dict__[a], four.__dict__[a]), a
    np.testing.assert_allclose(np.asarray(one.features, np.float32), np.asarray(four.features, np.float32),
                               atol=2e-3, rtol=2e-3)
    assert json.loads((tmp_path / "four" / "meta.json").read_text())["documents"] == 5


def test_jsonl_lines_split_on_newlines_only(tmp_path):
    """A JSON string may hold U+2028 / U+0085 (ShareGPT does): str.splitlines would cut the line there."""
    import gzip

    from specdec.training.corpus import file_documents

    rows = [{"messages": [{"role": "user", "content": "a\u2028b\x85c"}]}, {"text": "plain"}]
    text = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n"
    (tmp_path / "c.jsonl").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(text)
    for name in ("c.jsonl", "c.jsonl.gz"):
        assert list(file_documents([tmp_path / name])) == [[{"role": "user", "content": "a\u2028b\x85c"}], "plain"]


def test_file_documents_keep_turns_with_a_known_role_and_text(tmp_path):
    """What a .jsonl line teaches: ShareGPT's from/value turns and chat messages with a known role and non-empty text
    (a tool turn, an empty or non-text content are dropped), else a non-empty "text"; a line with neither (an id
    only, an empty or non-string text) is skipped, as is an empty plain file (found by mutating corpus.py:
    `and` -> `or` in these checks let tool turns, empty answers and `{"text": 5}` through, or raised KeyError)."""
    from specdec.training.corpus import file_documents

    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                          {"role": "tool", "content": "dropped"}, {"role": "assistant", "content": ""},
                          {"role": "assistant", "content": ["not", "text"]}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "narrator", "content": "no known role"}], "text": "the text instead"},
            {"id": 7}, {"text": ""}, {"text": 5}, {"messages": []}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "d.txt").write_text("plain document")
    got = list(file_documents([tmp_path / "c.jsonl", tmp_path / "empty.txt", tmp_path / "d.txt"]))
    assert got == [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                   [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"}],
                   "the text instead", "plain document"]


def test_a_bad_jsonl_line_is_named_by_its_line_number(tmp_path):
    """Lines count from 1, blank lines included (found by mutating corpus.py: counting from 2 passed)."""
    import pytest

    from specdec.errors import SpecdecError
    from specdec.training.corpus import file_documents

    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\nnot json\n')
    with pytest.raises(SpecdecError, match=r"bad\.jsonl:3: not a JSON line"):
        list(file_documents([tmp_path / "bad.jsonl"]))
    with pytest.raises(SpecdecError, match="no such file"):
        list(file_documents([tmp_path / "missing.jsonl"]))


def bos_tokenizer(folder):
    """The tiny tokenizer made to put <s> (id 1) before what it encodes with special tokens, as Llama's does: text
    that went through a chat template must be encoded without them (the template writes its own)."""
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer(folder)
    tok.hf.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok.hf.encode("ab") == [1] + tok.hf.encode("ab", add_special_tokens=False)
    return tok


def test_token_documents_encode_conversations_as_the_chat_template_writes_them(tmp_path):
    """A conversation is the chat template's text with no tokenizer-added <s>, a plain document is encoded with
    it, both cut to max_len; without a template the turns are joined by blank lines (found by mutating corpus.py:
    `tokenize=False` -> `True` and `add_special_tokens=False` -> `True` passed: no test sent a conversation)."""
    from types import SimpleNamespace

    from specdec.training.corpus import token_documents

    tok = bos_tokenizer(save_tiny("llama", tmp_path, seed=3))
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = tok.hf.apply_chat_template(conv, tokenize=False)
    assert text.startswith("<user>hi<assistant>hello")
    want = tok.hf.encode(text, add_special_tokens=False)
    assert list(token_documents([conv, "plain text"], tok, max_len=100)) == [
        want, [1] + tok.hf.encode("plain text", add_special_tokens=False)]
    assert list(token_documents([conv], tok, max_len=5)) == [want[:5]]
    plain = SimpleNamespace(hf=tok.hf, has_chat_template=False)
    assert list(token_documents([conv], plain, max_len=100)) == [tok.hf.encode("hi\n\nhello",
                                                                               add_special_tokens=False)]


def test_first_turn_prompts_are_the_turns_before_the_first_answer_up_to_max_prompt(tmp_path):
    """The prompt is every turn before the first assistant turn (a system turn included, later user turns not)
    with the template's generation prompt and no tokenizer-added <s>; a prompt of exactly `max_prompt` tokens is
    kept, one longer skipped; without a chat template the turns are joined by blank lines and end with one (found
    by mutating regenerate.py: `add_generation_prompt=True` -> `False`, `add_special_tokens=False` -> `True` and
    `<=` -> `<` at max_prompt passed, and the template-free branch ran in no test)."""
    from types import SimpleNamespace

    tok = bos_tokenizer(save_tiny("llama", tmp_path, seed=3))
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "later"}]
    no_user = [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]
    text = tok.hf.apply_chat_template(conv[:2], tokenize=False, add_generation_prompt=True)
    assert text == "<system>be brief<user>hi<assistant>"
    want = tok.hf.encode(text, add_special_tokens=False)
    assert list(first_turn_prompts([conv, no_user, "plain"], tok, 200)) == [want]
    assert list(first_turn_prompts([conv], tok, len(want))) == [want]
    assert list(first_turn_prompts([conv], tok, len(want) - 1)) == []
    plain = SimpleNamespace(hf=tok.hf, has_chat_template=False)
    assert list(first_turn_prompts([conv, no_user], plain, 200)) == [tok.hf.encode("be brief\n\nhi\n\n",
                                                                                   add_special_tokens=False)]


def test_a_batch_stops_its_forwards_once_every_row_is_done(tmp_path):
    """The cost of regenerating, not its output: a row is done at a stop token or at its own length limit, and the
    batch stops forwarding when every row is. Prompts of 2 and 10 tokens, max_len 12: with no stop, the prefill and
    9 one-token forwards; with a stop the short row emits as its 2nd token, the long row done at its limit of 2
    new tokens: the prefill and 1 forward (found by mutating regenerate.py: `or` -> `and` in the exit test, `>=`
    -> `>` and `+` -> `-` in the limit kept forwarding with the same output)."""
    model = load_transformer(save_tiny("llama", tmp_path, seed=3))
    calls = []

    class Counting:  # the target, recording each forward's width
        device = model.device
        new_cache = model.new_cache

        def __call__(self, tokens, *a, **kw):
            calls.append(tokens.shape[1])
            return model(tokens, *a, **kw)

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (2, 10)]
    free = [alone(model, p, 12, set()) for p in prompts]
    assert greedy_batch(Counting(), prompts, 12, set()) == free and calls == [10] + [1] * 9
    stop = {free[0][3]}
    assert free[0][2] not in stop and not stop & set(free[1][10:])
    calls.clear()
    assert greedy_batch(Counting(), prompts, 12, stop) == [free[0][:4], free[1]] and calls == [10, 1]


def test_regenerate_stops_at_the_batch_that_reaches_max_tokens(tmp_path):
    """Documents come a batch at a time until `max_tokens` are written: a budget met exactly by the first documents
    ends there (found by mutating regenerate.py: `>=` -> `>` and `<` -> `<=` on the budget passed)."""
    folder = save_tiny("llama", tmp_path, seed=3)
    model, tok = load_transformer(folder), Tokenizer(folder)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (3, 4, 5, 6, 7, 8, 9, 10, 11, 12)]
    every = list(regenerate(model, iter(prompts), 16, set(), batch=1, max_tokens=10**6, progress=False))
    assert [len(d) for d in every] == [16] * 10  # no stop token: each document runs to max_len
    first8 = sum(len(d) for d in every[:8])
    for budget, n in ((16, 1), (17, 2), (first8, 8), (first8 + 1, 9)):
        got = list(regenerate(model, iter(prompts), 16, set(), batch=1, max_tokens=budget, progress=False))
        assert got == every[:n], budget


def test_a_resumed_regenerate_build_does_not_answer_the_cached_documents_again(tmp_path, monkeypatch):
    """An interrupted `train --regenerate` resumed by generating every answer again and then dropping the cached
    ones (the target's answers are the costly part: hours on a CPU). `regenerate(skip=n)` yields the first n
    documents as None, in the same order, generating only batches that hold a document past them (whole: each row
    rounds as it did), and `hidden_cache.build` skips them: the resumed cache equals an uninterrupted one."""
    import specdec.training.regenerate as R

    folder = save_tiny("llama", tmp_path / "m", seed=3)
    model, tok = load_transformer(folder), Tokenizer(folder)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (3, 9, 5, 4, 8, 6, 7)]
    stop = set(tok.eos_ids)
    every = list(regenerate(model, iter(prompts), 16, stop, batch=2, max_tokens=10**6, progress=False))
    rows, real = [], R.greedy_batch
    monkeypatch.setattr(R, "greedy_batch", lambda m, group, *a: rows.append(len(group)) or real(m, group, *a))
    got = list(regenerate(model, iter(prompts), 16, stop, batch=2, max_tokens=10**6, progress=False, skip=3))
    assert got == [None] * 3 + every[3:] and rows == [2, 2, 1]  # the batch of documents 0 and 1 is not run again

    settings = {"regenerate": True}
    whole = hidden_cache.build(model, iter(every), tmp_path / "whole", 10**4, settings, progress=False)

    def interrupted(docs, after):
        for i, d in enumerate(docs):
            if i == after:
                raise KeyboardInterrupt
            yield d

    where = tmp_path / "resumed"
    try:
        hidden_cache.build(model, interrupted(every, 4), where, 10**4, settings, progress=False, save_every=0)
    except KeyboardInterrupt:
        pass
    assert hidden_cache.cached_documents(where) == 4 and hidden_cache.cached_documents(tmp_path / "whole") == 0
    rows.clear()
    docs = regenerate(model, iter(prompts), 16, stop, batch=2, max_tokens=10**6, progress=False,
                      skip=hidden_cache.cached_documents(where))
    resumed = hidden_cache.build(model, docs, where, 10**4, settings, progress=False)
    assert rows == [2, 1]  # documents 4 to 6 only
    for a in ("hidden", "tokens", "labels", "doc"):
        assert np.array_equal(whole.__dict__[a], resumed.__dict__[a]), a
