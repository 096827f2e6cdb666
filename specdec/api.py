"""The Python API: load a model once, generate many times.

    from specdec import LLM
    llm = LLM("smollm2-135m")                       # a known name, an HF folder or a .gguf path
    r = llm.generate("Name three colours.", max_new_tokens=32)
    r.text, r.tokens_per_s, r.mean_accepted         # same fields as `specdec generate --json`
    for piece in llm.stream("Tell me a story.", temperature=0.7, seed=1):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import torch

from specdec.decode import Chunk, Request, Result, decode
from specdec.runtime.loader import load_transformer, resolve_dtype
from specdec.sampling import SamplingParams
from specdec.tokenizer import Tokenizer

METHODS = ("plain",)


class LLM:
    def __init__(self, model: str = "smollm2-135m", dtype: str | None = None, pull: bool = True):
        from specdec.store import resolve

        self.name = model
        self.folder: Path = resolve(model, pull=pull)
        self.dtype: torch.dtype = resolve_dtype(dtype)
        self.model = load_transformer(self.folder, self.dtype)
        self.tokenizer = Tokenizer(self.folder)

    def chunks(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                stop: Sequence[str] = (), chat: bool | None = None, method: str = "plain") -> Iterator[Chunk]:
        """The decoding loop's chunks: text as it is committed, the final one carrying the Result."""
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        request = Request(max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop))
        ids = list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt, chat=chat)
        return decode(self.model, self.tokenizer, ids, request)

    def stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[str]:
        """Yield text as tokens are committed (same keyword arguments as `generate`)."""
        for chunk in self.chunks(prompt, **kwargs):
            if chunk.text:
                yield chunk.text

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Result:
        """Generate a completion. Keyword arguments: max_new_tokens, temperature (0 = greedy), top_k,
        top_p, min_p, seed, stop (list of strings), chat (None = use the chat template if the model has one),
        method. A prompt may also be a list of token ids (used as is)."""
        for chunk in self.chunks(prompt, **kwargs):
            if chunk.result is not None:
                return chunk.result
        raise RuntimeError("decoding ended without a result")
