"""Self-distillation data: the target writes the answers its heads will learn to draft.

A head learns what the target says after a prefix. On a corpus written by someone else (ShareGPT's answers
came from ChatGPT), most positions follow text the target would never have written, so the unrolled steps of
training see inputs that greedy drafting never feeds. HASS and EAGLE-3's released recipes (SpecForge)
therefore regenerate the answers with the target itself; `--regenerate` does the same: each conversation's
first user turn goes through the chat template (with the assistant header), and the target continues it
greedily until an end-of-turn token or `max_len` tokens in all.

Generation is batched: prompts sorted by length, `batch` at a time, left-padded. Row b with p_b pad slots
runs at positions max(0, i - p_b) and attends to keys j >= p_b only (each query also to itself, so a pad
row is never empty), which gives each row what it would get alone, up to float rounding of the batch.
Example: prompts [[5, 6, 7], [8]] -> tokens [[5, 6, 7], [0, 0, 8]], positions [[0, 1, 2], [0, 0, 0]],
the second row's keys 0 and 1 masked.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch


def first_turn_prompts(docs: Iterable, tokenizer, max_prompt: int) -> Iterator[list[int]]:
    """Token ids of each conversation's messages before its first assistant turn, with the generation prompt
    (the chat template's assistant header); conversations whose prompt is longer than `max_prompt` are
    skipped, plain-text documents too (they have no turn to answer)."""
    hf = tokenizer.hf
    for doc in docs:
        if not isinstance(doc, list):
            continue
        turns = []
        for m in doc:
            if m["role"] == "assistant":
                break
            turns.append(m)
        if not turns or turns[-1]["role"] != "user":
            continue
        if tokenizer.has_chat_template:
            text = hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        else:
            text = "\n\n".join(m["content"] for m in turns) + "\n\n"
        ids = hf.encode(text, add_special_tokens=False)
        if 0 < len(ids) <= max_prompt:
            yield ids


@torch.inference_mode()
def greedy_batch(model, prompts: Sequence[Sequence[int]], max_len: int, stop: set[int]) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation, ending after a `stop` token or at `max_len`
    tokens in all (prompt included). One left-padded batch (module docstring); every forward stays on the
    model's device."""
    B = len(prompts)
    width = max(len(p) for p in prompts)
    pads = torch.tensor([width - len(p) for p in prompts])
    device = model.device
    tokens = torch.zeros(B, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, width - len(p):] = torch.tensor(p)
    steps = max_len - min(len(p) for p in prompts)
    cache = model.new_cache(width + steps, batch=B)
    slots = torch.arange(width)
    positions = (slots - pads[:, None]).clamp(min=0)
    keep = slots[None, :] >= pads[:, None]                                   # [B, S]: real keys
    mask = (slots[None, :, None] >= slots[None, None, :]) & keep[:, None, :]  # causal over real keys
    mask |= torch.eye(width, dtype=torch.bool)
    out = model(tokens, cache, positions=positions, mask=mask, last_only=True, on_device=True)
    nxt = out.logits[:, -1].argmax(-1)
    pads, keep = pads.to(device), keep.to(device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    limit = torch.tensor([max_len - len(p) for p in prompts], device=device)
    stop_ids = torch.tensor(sorted(stop), device=device)
    generated = []
    for step in range(steps):
        generated.append(nxt)
        done |= torch.isin(nxt, stop_ids) | (step + 1 >= limit)
        if step + 1 == steps or bool(done.all()):
            break
        start = cache.length
        keep = torch.cat([keep, torch.ones(B, 1, dtype=torch.bool, device=device)], 1)
        pos = (start - pads)[:, None]
        out = model(nxt[:, None], cache, positions=pos, mask=keep[:, None, :], on_device=True)
        nxt = out.logits[:, -1].argmax(-1)
    rows = []
    for p, row in zip(prompts, torch.stack(generated, 1).tolist()):  # [B, steps taken]
        end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        rows.append(list(p) + row[:min(end, max_len - len(p))])
    return rows


def regenerate(model, prompts: Iterable[list[int]], max_len: int, stop: set[int], batch: int,
               max_tokens: int, progress: bool = True, skip: int = 0) -> Iterator[list[int] | None]:
    """Documents prompt + greedy answer (`greedy_batch`), `batch` prompts at a time in order of length, until
    about `max_tokens` tokens are written. Reads prompts lazily, a pool of 8 batches at a time. The first `skip`
    documents (an interrupted build's, already cached) come as None, in the same order, and a batch of only such
    documents is not generated again (a batch holding others runs whole: its rows round as they did)."""
    from tqdm import tqdm

    bar = tqdm(total=max_tokens, unit="tok", unit_scale=True, desc="target answers", disable=not progress)
    it, written, index = iter(prompts), 0, 0
    while written < max_tokens:
        pool = [p for _, p in zip(range(8 * batch), it)]
        if not pool:
            break
        pool.sort(key=len)
        for i in range(0, len(pool), batch):
            group = pool[i:i + batch]
            if index + len(group) <= skip:
                index += len(group)
                yield from [None] * len(group)
                continue
            for doc in greedy_batch(model, group, max_len, stop):
                index += 1
                if index <= skip:
                    yield None
                    continue
                written += len(doc)
                bar.update(len(doc))
                yield doc
            if written >= max_tokens:
                break
    bar.close()
