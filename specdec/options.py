"""What a user may ask for, checked in one place before any model loads (the CLI, `specdec.LLM` and
the race all call these): generation options, prompts, and the LLM's method settings.

    opts = GenerationOptions(max_new_tokens=32, temperature=0.7, stop="END", method="prompt-lookup")
    opts.request          # decode.Request: max_new_tokens, SamplingParams, stop=("END",)
    check_prompt("a\\udcffb")          # SpecdecError: the prompt is not valid UTF-8 text ...
    check_setup(sources="prompt-lookup,nosuch")   # SpecdecError: unknown hybrid source 'nosuch' ...

Every failure is a SpecdecError (a ValueError too, so `except ValueError` keeps working) whose
message says what is wrong and what to pass instead; the CLI prints it on one line and exits 2.
"""

from __future__ import annotations

import numbers
import operator
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Sequence

from specdec.drafters import METHODS
from specdec.errors import SpecdecError

TREES = ("auto", "chain", "dynamic", "static")  # tree names; anything else is a Medusa paths file
LOOKAHEAD_BOUNDS = {"window": (0, 64), "ngram": (2, 16), "guesses": (1, 64)}  # beyond them a forward is all overhead


class OptionError(SpecdecError, ValueError):
    """A bad option or prompt (both a SpecdecError and a ValueError)."""


def is_int(x) -> bool:
    """An int that is not a bool (True is not a token count)."""
    return isinstance(x, int) and not isinstance(x, bool)


# --- prompts -----------------------------------------------------------------------------------------

def check_utf8(text: str, what: str) -> str:
    """`text` must be a str of valid Unicode (no lone surrogates: what Python makes of invalid UTF-8
    bytes in a command-line argument)."""
    if not isinstance(text, str):
        raise OptionError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OptionError(f"{what} is not valid UTF-8 text (an undecodable byte at character {e.start}): "
                          "pass UTF-8 text") from None
    return text


def check_text(text: str, what: str = "the prompt") -> str:
    """Prompt text: valid UTF-8 (`check_utf8`) and not blank."""
    if not check_utf8(text, what).strip():
        raise OptionError(f"{what} is empty: give some text")
    return text


def decode_utf8(data: bytes, what: str) -> str:
    """Bytes read from a file or stdin -> text, or one line naming `what` and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OptionError(f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): "
                          "convert it to UTF-8, e.g. with iconv") from None


def check_prompt(prompt, vocab_size: int | None = None) -> str | list[int]:
    """A prompt is text (see `check_text`) or a non-empty sequence of token ids, each an integer in
    [0, vocab_size) when the vocabulary size is given. Bytes are refused: decode them first."""
    if isinstance(prompt, str):
        return check_text(prompt)
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise OptionError("the prompt is bytes: pass text (e.g. data.decode('utf-8')) or a list of token ids")
    try:
        ids = [operator.index(t) if not isinstance(t, bool) else None for t in prompt]
    except TypeError:
        raise OptionError("the prompt must be text or a sequence of integer token ids") from None
    if None in ids:
        raise OptionError("token ids must be integers, not bools")
    if not ids:
        raise OptionError("the prompt is empty: give some text or token ids")
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise OptionError(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1})")
    return ids


# --- generation options ---------------------------------------------------------------------------------

K_MAX = 1000  # the longest draft a round may ask for (and `specdec calc`'s longest k)


def check_k(k) -> int | str:
    """'auto' or a draft length 0..K_MAX."""
    if k == "auto" or (is_int(k) and 0 <= k <= K_MAX):
        return k
    raise OptionError(f"k must be an integer 0..{K_MAX} or 'auto', got {k!r}")


def check_method(method) -> str:
    if method not in METHODS:
        raise OptionError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    return method


def check_stop(stop) -> tuple[str, ...]:
    """None -> no stop strings; a str -> that one string (not its characters); else each item a non-empty
    str."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (bytes, bytearray)):
        raise OptionError(f"stop must be a string or a list of strings, got bytes {bytes(stop)!r}: decode it first")
    try:
        stop = tuple(stop)
    except TypeError:
        raise OptionError(f"stop must be a string or a list of strings, got {type(stop).__name__}") from None
    for s in stop:
        if not isinstance(s, str) or not s:
            raise OptionError(f"stop strings must be non-empty strings, got {s!r}")
        check_utf8(s, "a stop string")
    return stop


@dataclass(frozen=True)
class GenerationOptions:
    """One generation's options (the keyword arguments of `LLM.generate` and `LLM.stream`):
    max_new_tokens, temperature (0 = greedy), top_k, top_p, min_p, seed (0..2**64-1, None = random),
    stop (a string or a list of strings; None = none), chat (None = the chat template when the model
    has one), method (one of specdec.drafters.METHODS), k (draft length, or "auto"), and acceptance
    ("exact", the default, or "typical": Medusa's LOSSY typical acceptance under sampling, with
    posterior_threshold and posterior_alpha). Checked when built; `stop` is normalized to a tuple."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] | str | None = field(default=())
    chat: bool | None = None
    method: str = "plain"
    k: int | str = "auto"
    acceptance: str = "exact"
    posterior_threshold: float | None = None  # None: Medusa's default epsilon (verify.TYPICAL_EPSILON)
    posterior_alpha: float | None = None      # None: Medusa's default delta (verify.TYPICAL_DELTA)

    def __post_init__(self):
        from specdec.decode import Request
        from specdec.sampling import SamplingParams

        for name in NUMBERS:  # numpy's scalars (a seed or length read from an array) as Python's int and float
            object.__setattr__(self, name, python_number(getattr(self, name)))
        object.__setattr__(self, "stop", check_stop(self.stop))
        check_method(self.method)
        check_k(self.k)
        if self.method == "plain" and self.k != "auto":
            raise OptionError(f"k={self.k!r} sets a draft length, and method 'plain' drafts nothing: drop k or "
                              "choose a speculative method")
        if self.acceptance == "typical" and self.method == "plain":
            raise OptionError("acceptance='typical' loosens how drafts are accepted, and method 'plain' drafts "
                              "nothing: drop it or choose a speculative method")
        given = [n for n in ("posterior_threshold", "posterior_alpha") if getattr(self, n) is not None]
        if given and self.acceptance != "typical":
            raise OptionError(f"{' and '.join(given)} tune{'s' * (len(given) == 1)} typical acceptance: pass "
                              "acceptance='typical' too, or drop them")
        if self.chat is not None and not isinstance(self.chat, bool):
            raise OptionError(f"chat must be True, False or None, got {self.chat!r}")
        try:
            sampling = SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                      min_p=self.min_p, seed=self.seed)
            typical = {name: v for name in ("posterior_threshold", "posterior_alpha")
                       if (v := getattr(self, name)) is not None}
            request = Request(max_new_tokens=self.max_new_tokens, sampling=sampling, stop=self.stop,
                              acceptance=self.acceptance, **typical)
        except ValueError as e:
            raise OptionError(str(e)) from None
        object.__setattr__(self, "_request", request)

    @property
    def request(self):
        """The decoding loop's `decode.Request`."""
        return self._request

    @classmethod
    def of(cls, **options) -> "GenerationOptions":
        """Built from a user's keyword arguments: an unknown name is an OptionError listing the options (the
        dataclass alone would raise a TypeError). Example: of(n=2) -> "unknown option 'n': the options are ..."."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise OptionError(f"unknown option{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}: "
                              f"the options are {', '.join(names)}")
        return cls(**options)


NUMBERS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "k", "posterior_threshold",
           "posterior_alpha")


def python_number(x):
    """Another library's integer or real scalar (numpy's int64, float32...) as Python's int or float; anything
    else, bools included, as it is (and checked as it is). Example: python_number(np.int64(5)) -> 5."""
    if isinstance(x, (bool, int, float)):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    return x


# --- the LLM's method settings -------------------------------------------------------------------------

@dataclass(frozen=True)
class LookaheadConfig:
    """Lookahead decoding's shape: Jacobi window W columns (0 = none), n-gram size N (N-1 levels,
    candidates of N-1 tokens), G pool guesses verified per forward; None = fitted to the budget
    `specdec probe` measured. `pool=False` keeps no n-gram pool (a baseline).

        LLM("smollm2-135m", lookahead=LookaheadConfig(window=3, ngram=4, guesses=3))
    """

    window: int | None = None
    ngram: int | None = None
    guesses: int | None = None
    pool: bool = True

    def __post_init__(self):
        for name, (least, most) in LOOKAHEAD_BOUNDS.items():
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not least <= v <= most):
                raise OptionError(f"lookahead {name} must be an integer {least}..{most} (or None = auto), got {v!r}")
        if not isinstance(self.pool, bool):
            raise OptionError(f"lookahead pool must be True or False, got {self.pool!r}")

    @property
    def auto(self) -> bool:
        """True when the probe's budget decides some of W, N and G."""
        return None in (self.window, self.ngram, self.guesses)

    @classmethod
    def of(cls, value) -> LookaheadConfig:
        """'auto', a LookaheadConfig, or a tuple (W, N, G[, pool]) (the older form) -> a LookaheadConfig."""
        if value == "auto" or value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, tuple) and 3 <= len(value) <= 4:
            return cls(*value)
        raise OptionError(f"lookahead must be 'auto', a LookaheadConfig or a tuple (W, N, G[, pool]), got {value!r}")


HYBRID_SOURCES = tuple(m for m in METHODS if m not in ("plain", "hybrid"))


def check_sources(sources: Sequence[str] | str) -> list[str]:
    """Hybrid sources, in order: drafter method names, comma-separated or a list."""
    if not isinstance(sources, str) and (not isinstance(sources, (list, tuple))
                                         or not all(isinstance(s, str) for s in sources)):
        raise OptionError(f"sources must be method names, comma-separated or a list of strings, got {sources!r}")
    names = [s.strip() for s in (sources.split(",") if isinstance(sources, str) else sources) if s.strip()]
    if not names:
        raise OptionError("hybrid needs at least one source, e.g. --sources prompt-lookup,draft")
    bad = [n for n in names if n not in HYBRID_SOURCES]
    if bad:
        raise OptionError(f"unknown hybrid source {bad[0]!r}: choose from {', '.join(HYBRID_SOURCES)}")
    return names


def check_exit_layer(value, layers: int | None = None) -> int | str:
    """'auto', or a layer 1..layers (the count when known) given as an int or a string of digits."""
    layer = int(value) if isinstance(value, str) and value.strip().isdecimal() else value  # "²" is a digit
    if layer == "auto":
        return layer
    if not is_int(layer) or layer < 1 or (layers is not None and layer > layers):
        span = f"1..{layers}" if layers else "an integer >= 1"
        raise OptionError(f"exit layer must be 'auto' or {span}, got {value!r}")
    return layer


NEEDS_DRAFT = "method 'draft' needs a draft model: pass --draft NAME, or LLM(draft=NAME) (e.g. qwen2.5-coder-0.5b)"


def check_tree(tree, method: str | None = None) -> str:
    """A tree setting as a string (a path may be a `Path`): a name in TREES or a Medusa paths file that exists;
    with `method`, one that method drafts (EAGLE: a name; Medusa: auto, chain or a file)."""
    tree = os.fspath(tree) if isinstance(tree, os.PathLike) else tree
    if not isinstance(tree, str) or not tree.strip():
        raise OptionError(f"tree must be 'auto', 'chain', 'static', 'dynamic' or a Medusa paths file, got {tree!r}")
    if tree not in TREES and not Path(tree).is_file():
        raise OptionError(f"tree {tree!r}: no such file; give auto, chain, dynamic, static or a Medusa paths file (JSON)")
    if method == "eagle" and tree not in TREES:
        raise OptionError(f"tree {tree!r}: EAGLE drafts an auto, dynamic, static or chain tree (a paths file is Medusa's)")
    if method == "medusa" and tree in ("dynamic", "static"):
        raise OptionError(f"tree {tree!r}: Medusa drafts an auto (calibrated) or chain tree, or a paths file's")
    return tree


def is_folder(path) -> bool:
    """None (the default), or a non-empty path (str or os.PathLike) to an existing folder."""
    return path is None or (isinstance(path, (str, os.PathLike)) and bool(str(path).strip())
                            and Path(path).expanduser().is_dir())


def check_setup(*, draft: str | None = None, sources: Sequence[str] | str = ("prompt-lookup", "draft"),
                exit_layer: int | str = "auto", lookahead="auto", method: str | None = None, tree: str = "auto",
                tree_nodes: int | None = None, heads: str | None = None, datastore: str | None = None) -> None:
    """The method settings of `specdec.LLM` (and `specdec race`), before anything loads; with `method`,
    also whether they let that method run (a draft model for 'draft', or for a hybrid that uses one).
    `tree`: Medusa's and EAGLE's tree (a name, or a Medusa paths file that must exist: read when the drafter is
    built); `tree_nodes`: their size and token recycling's, None = from the probe's budget; `heads` and
    `datastore`: a heads folder and retrieval's datastore folder, which must exist (None: the model's own)."""
    if draft is not None and (not isinstance(draft, str) or not draft.strip()):
        raise OptionError(f"draft must be a model name or path, got {draft!r}")
    if heads is not None:
        path = Path(heads).expanduser() if isinstance(heads, (str, os.PathLike)) and str(heads).strip() else None
        what = ("a file, not a folder" if path and path.is_file() else "no such folder" if not is_folder(heads)
                else None if (path / "config.json").is_file() else "no config.json in it, so no heads")
        if what:
            raise OptionError(f"heads {heads!r}: {what} (give the --out folder of `specdec train medusa|eagle`, or "
                              "a published EAGLE-3 head's folder)")
    if not is_folder(datastore):
        raise OptionError(f"datastore {datastore!r}: no such folder (give the --out folder of `specdec datastore "
                          "build`, or None for the model's ShareGPT datastore)")
    if tree_nodes is not None and (not is_int(tree_nodes) or tree_nodes < 1):
        raise OptionError(f"tree_nodes must be an integer >= 1 (or None = from the budget), got {tree_nodes!r}")
    names = check_sources(sources)
    for m in {method, *(names if method == "hybrid" else ())}:  # a hybrid's Medusa or EAGLE source too
        check_tree(tree, m)
    check_exit_layer(exit_layer)
    LookaheadConfig.of(lookahead)
    if draft is None and method == "draft":
        raise OptionError(NEEDS_DRAFT)
    if draft is None and method == "hybrid" and "draft" in names:
        raise OptionError(f"hybrid's sources ({','.join(names)}; --sources, default prompt-lookup,draft) include "
                          "draft, which needs a draft model: pass --draft NAME (e.g. qwen2.5-coder-0.5b) or sources "
                          "without it, e.g. --sources prompt-lookup,recycling (in Python: LLM(draft=NAME) or "
                          "LLM(sources=...))")
