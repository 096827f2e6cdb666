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
