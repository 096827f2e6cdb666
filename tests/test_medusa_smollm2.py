"""The Medusa heads shipped for SmolLM2-135M: greedy output equals plain decoding (fp32), trees and
chains, and the heads earn more than 1.3 tokens per target forward."""

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llm():
    from specdec.api import LLM
    from specdec.training.heads import SHIPPED

    try:
        return LLM("smollm2-135m", dtype="fp32", heads=str(SHIPPED / "smollm2-135m" / "medusa"))
    except Exception as e:  # noqa: BLE001 - no network and no cache: nothing to test against
        pytest.skip(f"smollm2-135m unavailable: {e}")


PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a Python function that returns the square of a number.",
           "Give me three tips for better sleep."]


def test_shipped_heads_keep_greedy_output_and_accept_more_than_one_token(llm):
    from specdec.drafters.medusa import build

    for tree, nodes in (("chain", 4), ("auto", 8)):
        llm._medusa = build(llm, llm.heads, tree, nodes)
        tokens = forwards = 0
        for p in PROMPTS:
            plain = llm.generate(p, max_new_tokens=48)
            spec = llm.generate(p, max_new_tokens=48, method="medusa", k=4)
            assert spec.token_ids == plain.token_ids, (tree, p)
            tokens, forwards = tokens + spec.new_tokens, forwards + spec.target_forwards
    assert tokens / forwards > 1.3  # the 8-node calibrated tree
