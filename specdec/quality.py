"""Quality of a weight format: perplexity on a held-in text and top-1 agreement with a reference dtype.

The text: the first `tasks` HumanEvalFix dev tasks (data/code_edit, MIT), each scored as a chat: the user
turn is the bench prompt (instruction, declaration and buggy code), the assistant turn the fixed function
(declaration + canonical solution). Only the assistant's tokens are scored: the code-editing answers the
engine is built for.

- perplexity: exp of the mean next-token negative log-likelihood over the scored tokens;
- top-1 agreement: the fraction of scored positions where the format's most likely next token is the
  reference's (what greedy decoding would pick, given the same context).

Example (illustrative): bf16 ppl 1.30; q8 ppl 1.30, agreement 99.5%; q4 ppl 1.35, agreement 96%.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch

from specdec.bench.prompts import resolve_prompts
from specdec.bench.runner import chat_ids


@dataclass
class QualityResult:
    model: str
    dtype: str
    ref: str
    tokens: int            # scored tokens
    perplexity: float
    agreement: float       # top-1 agreement with the reference dtype (1.0 for the reference itself)

    def to_dict(self) -> dict:
        return asdict(self)


def held_in(tokenizer, tasks: int = 8) -> list[tuple[list[int], int]]:
    """(ids, start) per task: the chat's ids and where the scored assistant answer starts."""
    lines = resolve_prompts("humanevalfix").read_text().splitlines()[:tasks]
    out = []
    for line in lines:
        t = json.loads(line)
        prompt = chat_ids(tokenizer, [{"role": "user", "content": t["instruction"] + "\n\n" + t["declaration"]
                                       + t["buggy_solution"]}])
        answer = tokenizer.hf.encode(t["declaration"] + t["canonical_solution"], add_special_tokens=False)
        out.append((prompt + answer, len(prompt)))
    return out


@torch.inference_mode()
def score(model, texts: list[tuple[list[int], int]]) -> tuple[list[torch.Tensor], float, int]:
    """Per text the argmax next token at each scored position, the summed NLL, and the number of tokens."""
    argmaxes, nll, count = [], 0.0, 0
    for ids, start in texts:
        logits = model(torch.tensor([ids]), model.new_cache(len(ids))).logits[0, start - 1:-1].double()
        target = torch.tensor(ids[start:])
        nll -= torch.log_softmax(logits, -1).gather(1, target[:, None]).sum().item()
        argmaxes.append(logits.argmax(-1))
        count += len(target)
    return argmaxes, nll, count


def measure(name: str, folder, dtypes: list, ref, tasks: int = 8, load=None) -> list[QualityResult]:
    """Quality of each dtype (and of the reference, first), loading one model at a time."""
    from specdec.runtime.loader import load_transformer
    from specdec.tokenizer import Tokenizer

    if tasks < 1:  # no scored token: the perplexity would divide by zero
        raise ValueError(f"tasks must be at least 1, got {tasks}")
    load = load or load_transformer
    texts = held_in(Tokenizer(folder), tasks)
    label = lambda d: {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(d, str(d))  # --dtype's names
    ref_top, results = None, []
    for d in [ref] + [d for d in dtypes if label(d) != label(ref)]:
        top, nll, count = score(load(folder, d), texts)
        if ref_top is None:
            ref_top = top
        agree = sum(int((a == b).sum()) for a, b in zip(top, ref_top)) / count
        results.append(QualityResult(name, label(d), label(ref), count, math.exp(nll / count), agree))
    return results
