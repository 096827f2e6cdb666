"""Run benchmark prompts through every method, interleaved, and record one row per generation.

Methods are our decoding methods (`specdec.api.METHODS`, read at run time) and, with
`compare_hf`, Hugging Face transformers' `generate` on the same prompt ids and weights:
`hf-plain`, `hf-assisted` (assistant_model = the draft model) and `hf-prompt-lookup`
(prompt_lookup_num_tokens = 10).

Fairness rules, the same for every method:
- one short untimed warm-up generation per method before anything is timed;
- then, for each prompt turn, every method runs back to back, so machine drift hits all alike;
- `seconds` is wall time around the whole call (prefill included) for ours and HF's alike;
- a multi-turn prompt runs turn after turn; turn t's chat holds the earlier questions and
  *plain decoding's* answers, so every method sees exactly the same prompt ids in every turn
  (under greedy decoding every method's answers equal plain's anyway);
- greedy: every method's token ids must equal plain's. A mismatch is reported with its first
  differing position and the target's logit margin there, which tells a bug (clear margin)
  from a bf16 near-tie (margin within a few bf16 steps).

    runners = our_methods(llm, ["plain", "prompt-lookup"], settings) + hf_methods(llm, settings)
    records = run_bench(llm, prompts, runners, settings)      # list of dicts, one per generation
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specdec.bench.prompts import BenchPrompt
from specdec.errors import SpecdecError

# Extra keyword arguments for llm.generate, per method (options that a method needs beyond k).
METHOD_KWARGS: dict[str, dict] = {
    "plain": {},
    "prompt-lookup": {},
}
HF_PROMPT_LOOKUP_TOKENS = 10
# A greedy mismatch whose logit margin (plain's token minus the other's, in the target) is at most
# this is a near-tie that rounding may flip; anything larger is a bug.
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.05}


@dataclass
class BenchSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    k: int | str = "auto"
    seed: int | None = 0
    warmup_tokens: int = 8
    method_kwargs: dict[str, dict] = field(default_factory=lambda: {m: dict(v) for m, v in METHOD_KWARGS.items()})

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def checks_tokens(self) -> bool:
        """Greedy, or sampling with a seed: deterministic drafts then give plain's tokens (`sampling.Draws`)."""
        return self.greedy or self.seed is not None


def available_methods() -> tuple[str, ...]:
    from specdec import api

    return tuple(api.METHODS)


TREE_METHODS = {"medusa": ("auto", "chain"), "eagle": ("auto", "dynamic", "static", "chain")}


def parse_methods(spec: str | Sequence[str]) -> list[str]:
    """'plain,prompt-lookup' -> the list, plain first (added when missing); unknown -> SpecdecError.
    A tree method may name its tree after '@' (e.g. 'eagle@chain,eagle': EAGLE's chain and its dynamic tree
    side by side in one run); without it the method takes `--tree`."""
    names = [m.strip() for m in (spec.split(",") if isinstance(spec, str) else spec) if m.strip()]
    known = available_methods()
    if not names:
        raise SpecdecError(f"--methods names no method: choose from {', '.join(known)}")
    unknown = [m for m in names if m.split("@")[0] not in known]
    if unknown:
        raise SpecdecError(f"unknown method{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                           f"choose from {', '.join(known)}")
    for m in names:
        base, at, tree = m.partition("@")
        if at and tree not in TREE_METHODS.get(base, ()):  # 'eagle@' names no tree; a paths file goes in --tree
            raise SpecdecError(f"{m!r}: " + (f"{base} trees are {', '.join(TREE_METHODS[base])}"
                                             + (" (a Medusa paths file: --tree FILE)" if base == "medusa" else "")
                                             if base in TREE_METHODS else f"only {' and '.join(TREE_METHODS)} take '@TREE'"))
    return list(dict.fromkeys(["plain"] + names))


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A chat (role/content dicts) -> prompt ids: the model's chat template with the generation
    prompt, encoded without adding special tokens (the template has them). Models without a chat
    template get the turns' contents joined by blank lines, encoded as plain text."""
    hf = tokenizer.hf
    if getattr(hf, "chat_template", None):
        text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return hf.encode(text, add_special_tokens=False)
    return hf.encode("\n\n".join(m["content"] for m in messages))


def _record(method: str, ids: Sequence[int], new_ids: list[int], seconds: float, text: str, **extra) -> dict:
    rec = dict(method=method, prompt_tokens=len(ids), new_tokens=len(new_ids), seconds=seconds,
               tokens_per_s=len(new_ids) / seconds if seconds > 0 else 0.0,
               target_forwards=None, mean_accepted=None, acceptance_rate=None, drafted=None, accepted=None,
               accepted_per_position=None, draft_seconds=None, target_seconds=None, finish_reason=None)
    rec.update(extra)
    rec.update(text=text, token_ids=list(new_ids))
    return rec


class OurMethod:
    """One of our methods through `LLM.generate` on prompt token ids (`checked`: held to plain's tokens)."""

    hf = False

    def __init__(self, llm, method: str, settings: BenchSettings, name: str | None = None, checked: bool = True):
        self.llm, self.name, self.settings, self.checked = llm, name or method, settings, checked
        self.method, _, tree = method.partition("@")
        if tree:  # the same loaded model, its own drafter for this tree
            self.llm = copy.copy(llm)
            self.llm.tree, self.llm._medusa, self.llm._eagle = tree, None, None
        self.kwargs = dict(settings.method_kwargs.get(self.method, {}))

    def plain_tokens(self) -> bool:
        """Held to plain's tokens: under greedy every method, under seeded sampling those whose drafts are
        deterministic (no q of their own: `sampling.Draws`)."""
        if not self.checked:
            return False
        drafter = None if self.settings.greedy else self.llm.drafter(self.method)
        return drafter is None or drafter.deterministic

    def generate(self, ids: Sequence[int], max_new_tokens: int | None = None) -> dict:
        s = self.settings
        kw = dict(max_new_tokens=max_new_tokens or s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                  top_k=s.top_k, min_p=s.min_p, seed=s.seed, method=self.method)
        if self.method != "plain":  # plain decoding has no k to set
            kw["k"] = s.k
        kw.update(self.kwargs)
        t0 = time.perf_counter()
        r = self.llm.generate(list(ids), **kw)
        seconds = time.perf_counter() - t0
        return _record(self.name, ids, r.token_ids, seconds, r.text, target_forwards=r.target_forwards,
                       mean_accepted=r.mean_accepted, acceptance_rate=r.acceptance_rate if r.drafted else None,
                       drafted=r.drafted, accepted=r.accepted, accepted_per_position=r.accepted_per_position,
                       draft_seconds=r.draft_seconds, target_seconds=r.target_seconds,
                       finish_reason=r.finish_reason, decode_seconds=r.seconds)


class HFMethod:
    """transformers' `generate` on the same ids: plain, assisted (draft model) or prompt lookup."""

    hf = True

    def __init__(self, name: str, model, tokenizer, settings: BenchSettings, **generate_kwargs):
        self.name, self.model, self.tok, self.settings = name, model, tokenizer, settings
        self.extra = generate_kwargs
        self.eos = sorted(tokenizer.eos_ids)

    def generate(self, ids: Sequence[int], max_new_tokens: int | None = None) -> dict:
        s = self.settings
        x = torch.tensor([list(ids)], device=self.model.device)
        kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens or s.max_new_tokens,
                  eos_token_id=self.eos, pad_token_id=self.eos[0] if self.eos else 0, **self.extra)
        if s.greedy:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kw.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p or None)
            if s.seed is not None:
                torch.manual_seed(s.seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, **kw)
            if out.device.type == "cuda":
                torch.cuda.synchronize(out.device)
        seconds = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        for i, t in enumerate(new):  # keep the first EOS (ours counts it too), drop the padding after it
            if t in self.tok.eos_ids:
                new = new[:i + 1]
                break
        finish = "stop" if new and new[-1] in self.tok.eos_ids else "length"
        return _record(self.name, ids, new, seconds, self.tok.decode(new), finish_reason=finish,
                       target_forwards=len(new) if self.name == "hf-plain" else None,
                       mean_accepted=1.0 if self.name == "hf-plain" else None)


def our_methods(llm, methods: Sequence[str], settings: BenchSettings) -> list[OurMethod]:
    return [OurMethod(llm, m, settings) for m in methods]


def load_hf_model(folder, dtype: torch.dtype | str, device: torch.device | str = "cpu"):
    """The transformers model in `dtype` (bf16 for our quantized q8/q4, which transformers cannot run), on
    `device` (ours: `--device`)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype if isinstance(dtype, torch.dtype)
                                                else torch.bfloat16).to(device).eval()


def hf_methods(llm, settings: BenchSettings, draft: str | None = None) -> list[HFMethod]:
    """hf-plain, hf-assisted (only with a draft model) and hf-prompt-lookup, on llm's weights, dtype and device."""
    from specdec.store import resolve

    model = load_hf_model(llm.folder, llm.dtype, llm.device)
    out = [HFMethod("hf-plain", model, llm.tokenizer, settings)]
    if draft:
        assistant = load_hf_model(resolve(draft, pull=True), llm.dtype, llm.device)
        out.append(HFMethod("hf-assisted", model, llm.tokenizer, settings, assistant_model=assistant))
    out.append(HFMethod("hf-prompt-lookup", model, llm.tokenizer, settings,
                        prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS))
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def explain_mismatch(llm, prompt_ids: Sequence[int], ref: Sequence[int], other: Sequence[int],
                     greedy: bool = True) -> dict | None:
    """None when equal; else where they first differ and, under greedy, the target's logit margin there
    (plain's token minus the other's, computed by our model in the benchmark dtype)."""
    i = first_difference(ref, other)
    if i is None:
        return None
    info = dict(position=i, plain_token=ref[i] if i < len(ref) else None,
                token=other[i] if i < len(other) else None, margin=None, near_tie=False, sampled=not greedy)
    if not greedy and None not in (info["plain_token"], info["token"]):
        info["plain_piece"], info["piece"] = llm.tokenizer.decode([ref[i]]), llm.tokenizer.decode([other[i]])
    elif info["plain_token"] is not None and info["token"] is not None:
        ctx = list(prompt_ids) + list(ref[:i])
        cache = llm.model.new_cache(len(ctx))
        logits = llm.model(torch.tensor([ctx]), cache, last_only=True).logits[0, -1]
        margin = float(logits[ref[i]] - logits[other[i]])
        info["margin"] = margin
        info["near_tie"] = abs(margin) <= NEAR_TIE.get(llm.dtype, 1e-3)
        info["plain_piece"] = llm.tokenizer.decode([ref[i]])
        info["piece"] = llm.tokenizer.decode([other[i]])
    return info


def describe_mismatch(rec: dict) -> str:
    m = rec["mismatch"]
    where = f"{rec['category']}/{rec['id']} turn {rec['turn']}"
    if m.get("sampled") and "piece" in m:
        return (f"SEEDED MISMATCH {rec['method']} vs plain on {where}: first difference at new token {m['position']} "
                f"(plain {m['plain_piece']!r}, {rec['method']} {m['piece']!r}): a deterministic draft must give plain's "
                "tokens under a seed (a bug on the exact CPU paths; elsewhere a draw within rounding of a boundary)")
    if m["margin"] is None:  # one answer ended first (greedy, or under a seed)
        return (f"{'SEEDED' if m.get('sampled') else 'GREEDY'} MISMATCH {rec['method']} vs plain on {where}: "
                f"lengths differ from new token {m['position']} on (a bug)")
    verdict = "a near-tie, rounding may flip it" if m["near_tie"] else "NOT a near-tie: a bug"
    return (f"GREEDY MISMATCH {rec['method']} vs plain on {where}: first difference at new token "
            f"{m['position']} (plain {m['plain_piece']!r}, {rec['method']} {m['piece']!r}; "
            f"logit margin {m['margin']:.4g}: {verdict})")


def warm_up(runners: Sequence, ids: Sequence[int], settings: BenchSettings) -> None:
    """One short untimed generation per method (loads drafters, fills caches, JIT paths)."""
    n = max(1, min(settings.warmup_tokens, settings.max_new_tokens))
    for r in runners:
        r.generate(ids, max_new_tokens=n)


def run_bench(llm, prompts: Sequence[BenchPrompt], runners: Sequence, settings: BenchSettings,
              progress: bool = True, report: Callable[[str], None] | None = None) -> list[dict]:
    """Every prompt turn through every runner (interleaved), after one warm-up per runner.
    `runners[0]` must be our plain decoding: its answers build later turns and are the greedy reference."""
    from tqdm import tqdm

    if not runners or runners[0].name != "plain":
        raise ValueError("the first runner must be our plain decoding")
    if not prompts:
        raise SpecdecError("no prompts to run")
    total = sum(len(p.turns) for p in prompts) * len(runners)
    bar = tqdm(total=total, file=sys.stderr, disable=not progress, unit="gen", dynamic_ncols=True)
    say = report or (lambda s: tqdm.write(s, file=sys.stderr))
    bar.set_description("warm-up")
    warm_up(runners, chat_ids(llm.tokenizer, [{"role": "user", "content": prompts[0].turns[0]}]), settings)
    records: list[dict] = []
    try:
        for p in prompts:
            history: list[dict] = []
            for t, question in enumerate(p.turns, 1):
                messages = history + [{"role": "user", "content": question}]
                ids = chat_ids(llm.tokenizer, messages)
                turn: list[dict] = []
                for r in runners:
                    bar.set_description(f"{p.category}/{p.id}.{t} {r.name}")
                    rec = r.generate(ids)
                    rec.update(category=p.category, id=p.id, turn=t, hf=r.hf, mismatch=None)
                    turn.append(rec)
                    bar.update()
                if settings.checks_tokens:
                    ref = turn[0]["token_ids"]
                    for r, rec in zip(runners[1:], turn[1:]):
                        if (not getattr(r, "checked", True) or (rec["hf"] and not isinstance(llm.dtype, torch.dtype))
                                or not (settings.greedy or (not rec["hf"] and r.plain_tokens()))):
                            rec["checked"] = False  # another engine, other weights (HF bf16 against our q8/q4),
                            continue                # or sampling from a draft's own q
                        rec["mismatch"] = explain_mismatch(llm, ids, ref, rec["token_ids"], settings.greedy)
                        if rec["mismatch"]:
                            say(describe_mismatch(rec))
                records.extend(turn)
                history = messages + [{"role": "assistant", "content": turn[0]["text"]}]
    finally:
        bar.close()
    return records
