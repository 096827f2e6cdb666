"""The Python API: load a model once, generate many times.

    from specdec import LLM
    llm = LLM("smollm2-135m")                       # a known name, an HF folder or a .gguf path
    r = llm.generate("Name three colours.", max_new_tokens=32)
    r.text, r.tokens_per_s, r.mean_accepted         # same fields as `specdec generate --json`
    r = llm.generate("Fix this code: ...", method="prompt-lookup")        # k chosen adaptively
    r = LLM("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b").generate("...", method="draft", k=4)
    r = LLM("smollm2-135m", tree="auto").generate("...", method="medusa")  # trained heads, a calibrated tree
    r = LLM("smollm2-135m").generate("...", method="eagle")  # an EAGLE head: a chain, or EAGLE-2's dynamic tree where verifying is wide
    for piece in llm.stream("Tell me a story.", temperature=0.7, seed=1):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Iterator, Sequence

import torch

from specdec.adaptive import AdaptiveK, CostCurve, FixedK
from specdec.decode import Chunk, Result, decode
from specdec.drafters import METHODS  # noqa: F401 - specdec.api.METHODS, read by the bench
from specdec.drafters.base import Drafter
from specdec.errors import SpecdecError
from specdec.options import (NEEDS_DRAFT, GenerationOptions, LookaheadConfig, OptionError, check_exit_layer,
                             check_k, check_method, check_prompt, check_setup, check_tree)
from specdec.runtime.loader import KV_DTYPES, check_dtype, load_transformer, resolve_device, resolve_dtype
from specdec.runtime.threads import release_threads
from specdec.tokenizer import Tokenizer


class LLM:
    """A loaded model and its tokenizer; drafters are built on first use. `model`: a known name, a Hugging Face folder
    or a .gguf file; `dtype`: "fp32", "bf16", "q8", "q4", or None / "auto" (q4 for a 4-bit GGUF, else bf16 where a
    bf16 path works, else fp32); `pull`: download a known model not yet in the store (False: an error instead).
    `draft`: the draft model for method "draft"; `datastore`: retrieval's folder; `exit_layer`: early exit's layer or
    "auto"; `sources`: hybrid's drafters in order; `lookahead`: a `LookaheadConfig` (or "auto", or the older tuple
    (W, N, G[, pool])); `heads`, `tree`, `tree_nodes`: Medusa's and EAGLE's heads folder (None: the store's, else the
    shipped ones), tree and size (`tree_nodes` also token recycling's; None: from the probe's budget); `device`:
    "cpu" or "cuda[:N]" (the weights and KV cache on a GPU, torch's kernels; the loop, drafts and sampling stay on
    the host); `kv_dtype`: "auto" (fp16 on the exact CPU paths, bf16 for bf16 weights on a CPU with AMX, else the
    activations' dtype), "fp16", "bf16" or "fp32". These settings are checked before the model loads."""

    def __init__(self, model: str = "smollm2-135m", dtype: str | None = None, pull: bool = True,
                 draft: str | None = None, datastore: str | None = None, exit_layer: int | str = "auto",
                 sources: Sequence[str] | str = ("prompt-lookup", "draft"),
                 lookahead: LookaheadConfig | str | tuple = "auto", heads: str | None = None, tree: str = "auto",
                 tree_nodes: int | None = None, device: str = "cpu", kv_dtype: str = "auto"):
        from specdec.store import resolve

        check_setup(draft=draft, sources=sources, exit_layer=exit_layer, lookahead=lookahead, tree=tree, heads=heads,
                    tree_nodes=tree_nodes, datastore=datastore)
        if not isinstance(pull, bool):  # "no" is truthy: it would pull
            raise OptionError(f"pull must be True or False, got {pull!r}")
        if kv_dtype not in KV_DTYPES:
            raise OptionError(f"unknown KV-cache dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        self.kv_dtype = kv_dtype
        try:  # an unknown dtype or device, or a GPU torch does not see: bad options like the others
            check_dtype(dtype)
            self.device = resolve_device(device)
        except SpecdecError as e:
            raise OptionError(str(e)) from None
        self.name = model
        self.folder: Path = resolve(model, pull=pull)
        if draft is not None:  # a known draft of another family: said before anything loads or is pulled
            from specdec.drafters.draft_model import check_draft_family

            check_draft_family(self.folder, draft)
        self.tokenizer = Tokenizer(self.folder)  # a folder without a usable tokenizer: said before the weights load
        self.dtype: torch.dtype | str = resolve_dtype(dtype, self.folder, self.device)
        self.model = load_transformer(self.folder, self.dtype, self.device, kv_dtype)
        self.draft_name = draft
        self.datastore = datastore
        self.exit_layer = check_exit_layer(exit_layer, self.model.cfg.num_layers)
        self.sources = sources
        self.lookahead = LookaheadConfig.of(lookahead)
        self.heads, self.tree, self.tree_nodes = heads, str(tree), tree_nodes  # Medusa/EAGLE (checked above; a Path too)
        self._medusa = None
        self._eagle = None
        self._recycling = None
        self._draft = None
        self._retrieval = None
        self._early_exit = None
        self._cost = None
        self._cost_measured = False
        self._building = threading.RLock()  # one thread builds a drafter or measures the probe; the others wait for it
        release_threads()  # the weights loaded in this thread: its idle OpenMP pool would slow another thread's decoding

    # --- drafters -----------------------------------------------------------------------
    def drafter(self, method: str) -> Drafter | None:
        """A drafter for one request. What is slow to build (heads, a draft model, early exit's measurement, the
        recycling table, a datastore) is built once; a drafter with per-request state (a KV cache, a context) is
        handed out as its own `fresh()` copy, so streams or threads of one LLM never draft on each other's caches."""
        with self._building:  # threads asking at once build (and probe) once
            return self._drafter(method)

    def _drafter(self, method: str) -> Drafter | None:
        if check_method(method) == "plain":
            return None
        if method == "prompt-lookup":
            from specdec.drafters.prompt_lookup import PromptLookup

            return PromptLookup()
        if method == "recycling":
            if self._recycling is None:  # one table for every request: it describes the target
                from specdec.drafters.recycling import Recycling

                self._recycling = Recycling(nodes=self.tree_nodes or max(2, self.budget() - 1))
            return self._recycling.fresh()
        if method == "draft":
            return self._draft_model().fresh()
        if method == "retrieval":
            if self._retrieval is None:
                from specdec.drafters.retrieval import build

                self._retrieval = build(self, self.datastore)
            return self._retrieval
        if method == "early-exit":
            if self._early_exit is None:
                from specdec.drafters.early_exit import build_early_exit

                self._early_exit = build_early_exit(self, self.exit_layer)
            return self._early_exit.fresh()
        if method == "lookahead":
            from specdec.drafters.lookahead import Lookahead

            return Lookahead(*self.lookahead_config(), pool=self.lookahead.pool,
                             eos_ids=tuple(self.tokenizer.eos_ids))
        if method == "hybrid":
            from specdec.drafters.hybrid import build_hybrid

            return build_hybrid(self.sources, self.drafter)
        if method in ("medusa", "eagle"):
            check_tree(self.tree, method)  # one this method drafts: said before its heads load
        if method == "medusa":
            if self._medusa is None:
                from specdec.drafters.medusa import build

                self._medusa = build(self, self.heads, self.tree, self.tree_nodes)
            return self._medusa
        if method == "eagle":
            if self._eagle is None:
                from specdec.drafters.eagle import build as build_eagle

                self._eagle = build_eagle(self, self.heads, self.tree, self.tree_nodes)
            return self._eagle.fresh()
        raise AssertionError(method)

    def _draft_model(self):
        from specdec.drafters.draft_model import DraftModel, check_same_tokenizer
        from specdec.store import resolve

        if self.draft_name is None:
            raise OptionError(NEEDS_DRAFT)
        if self._draft is None:
            folder = resolve(self.draft_name, pull=True)
            shared = check_same_tokenizer(self.tokenizer, Tokenizer(folder))
            model = load_transformer(folder, self.dtype, self.device, self.kv_dtype)
            weights = model.num_weights() / self.model.num_weights()
            self._draft = DraftModel(model, self.model.cfg.vocab_size, shared, tau_prior=weights)
        return self._draft

    def lookahead_config(self) -> tuple[int, int, int]:
        """(window W, n-gram size N, guesses G): given, or fitted to the budget `specdec probe` measured."""
        from specdec.drafters.lookahead import auto_config

        c = self.lookahead
        given = (c.window, c.ngram, c.guesses)
        auto = auto_config(self.budget()) if c.auto else (None, None, None)
        return tuple(a if g is None else int(g) for g, a in zip(given, auto))

    def budget(self) -> int:
        """Positions one forward can evaluate for about the cost of one (cost within 10%), from the probe."""
        curve = self.cost_curve(measure=True)
        return max(n for n in range(1, 65) if curve(n) <= 1.1)

    def policy(self, k: int | str, drafter: Drafter | None):
        if drafter is None:
            return None
        check_k(k)

        def auto(d):
            if getattr(d, "name", "") == "lookahead":
                if d.window or d.guesses > 1:  # a window or a tree: the configuration fits the budget already
                    return FixedK(d.ngram - 1)
                return AdaptiveK(k_max=d.ngram - 1, cost=self.cost_curve(), plain_first=True)  # like lookup
            return AdaptiveK(cost=self.cost_curve(), tau=getattr(d, "tau_prior", 0.0), plain_first=True,
                             prior_alpha=getattr(d, "prior_alpha", AdaptiveK.prior_alpha),
                             k_max=getattr(d, "k_max", AdaptiveK.k_max), nodes=getattr(d, "nodes", None))

        if k != "auto":
            return FixedK(k)
        if getattr(drafter, "sources", None) is not None:  # hybrid: each source keeps its own alpha, tau and k
            drafter.use_policies(auto)  # the first source that wants to draft does
            return FixedK(AdaptiveK.k_max)
        return auto(drafter)

    def cost_curve(self, measure: bool = False) -> CostCurve:
        """The verify-cost curve from `specdec probe` (cached per model and dtype); when none is cached,
        measured now if `measure`, else a mild default."""
        with self._building:
            return self._cost_curve(measure)

    def _cost_curve(self, measure: bool) -> CostCurve:
        if self._cost is None or (measure and not self._cost_measured):
            from specdec.probe import dtype_key, load_cached, probe, save

            result = load_cached(self.name, dtype_key(self.model))
            if result is None and measure:
                print(f"specdec: measuring the forward-cost curve of {self.name} once (`specdec probe`)",
                      file=sys.stderr)
                result = probe(self.model, self.name)
                save(result)
            self._cost_measured = result is not None
            self._cost = CostCurve.from_probe(result) if result else CostCurve()
        return self._cost

    # --- generation -----------------------------------------------------------------------
    def chunks(self, prompt: str | Sequence[int], **options) -> Iterator[Chunk]:
        """The decoding loop's chunks: text as it is committed, the final one carrying the Result.
        `options`: the fields of `specdec.options.GenerationOptions`."""
        opts = GenerationOptions.of(**options)
        prompt = check_prompt(prompt, self.model.cfg.vocab_size)
        drafter = self.drafter(opts.method)
        policy = self.policy(opts.k, drafter)
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt, chat=opts.chat)
        return _releasing(decode(self.model, self.tokenizer, ids, opts.request, drafter, policy))

    def stream(self, prompt: str | Sequence[int], **options) -> Iterator[str]:
        """Text as tokens are committed (same keyword arguments as `generate`). Bad options raise here,
        at the call, not at the first item."""
        chunks = self.chunks(prompt, **options)
        return (chunk.text for chunk in chunks if chunk.text)

    def generate(self, prompt: str | Sequence[int], **options) -> Result:
        """Generate a completion of a prompt: text, or a list of token ids (used as is). Keyword arguments
        (`specdec.options.GenerationOptions`): max_new_tokens, temperature (0 = greedy), top_k, top_p, min_p,
        seed (0..2**64-1), stop (a string or a list of strings), chat (None = use the chat template if the
        model has one), method (one of specdec.drafters.METHODS), k (draft length, or "auto"), acceptance
        ("exact", the default, or "typical": Medusa's LOSSY typical acceptance under sampling, with
        posterior_threshold and posterior_alpha; Result.distribution_exact is then False for any method but
        plain). Bad values raise one SpecdecError (also a ValueError) saying what to pass."""
        for chunk in self.chunks(prompt, **options):
            if chunk.result is not None:
                return chunk.result
        raise RuntimeError("decoding ended without a result")


def _releasing(chunks: Iterator[Chunk]) -> Iterator[Chunk]:
    """The chunks, then this thread's OpenMP pool released (`specdec.runtime.threads`): the next generation may
    run in another thread, which the idle pool would slow by a fifth on 2 vCPUs."""
    try:
        yield from chunks
    finally:
        release_threads()
