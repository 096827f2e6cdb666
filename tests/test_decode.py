"""Plain decoding on tiny models: equals transformers' greedy generate, seeds, and every stop rule."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.decode import Request, Stopper, decode
from specdec.errors import SpecdecError
from specdec.runtime.loader import load_transformer
from specdec.sampling import SamplingParams
from specdec.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_transformer(tiny_folder, torch.float32), Tokenizer(tiny_folder), tiny_folder


def run(model, tok, ids, **kw):
    chunks = list(decode(model, tok, ids, Request(**kw)))
    result = chunks[-1].result
    assert "".join(c.text for c in chunks) == result.text  # the stream adds up to the final text
    return result


def test_greedy_equals_transformers_generate(tiny):
    model, tok, folder = tiny
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok.encode("Speculate, then verify.", chat=False)
    ours = run(model, tok, ids, max_new_tokens=40)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=2,
                      pad_token_id=0)[0, len(ids):].tolist()
    assert ours.token_ids == ref
    assert ours.target_forwards == len(ref) and ours.mean_accepted == 1.0


def test_same_seed_same_output(tiny):
    model, tok, _ = tiny
    ids = tok.encode("seed", chat=False)
    sp = dict(temperature=1.0, top_p=0.9)
    a = run(model, tok, ids, max_new_tokens=30, sampling=SamplingParams(seed=7, **sp))
    b = run(model, tok, ids, max_new_tokens=30, sampling=SamplingParams(seed=7, **sp))
    c = run(model, tok, ids, max_new_tokens=30, sampling=SamplingParams(seed=8, **sp))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_max_new_tokens_and_eos(tiny):
    model, tok, _ = tiny
    ids = tok.encode("abc", chat=False)
    r = run(model, tok, ids, max_new_tokens=5)
    assert r.new_tokens <= 5 and (r.finish_reason == "length") == (r.token_ids[-1] not in tok.eos_ids)


class FakeTok:
    eos_ids = frozenset({0})

    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids if i)


def test_a_drafter_without_a_policy_drafts_4_deep(tiny):
    """decode(..., drafter) with no policy: FixedK(4), the lesson's default k (capped by the tokens left)."""
    from specdec.draft import Draft
    from specdec.drafters.base import Drafter

    class Fives(Drafter):
        name = "fives"

        def __init__(self):
            self.asked, self.timed = [], []

        def propose(self, ctx, k):
            self.asked.append(k)
            return Draft.chain([5] * k)

        def timing(self, drafted, draft_seconds, target_seconds):  # what adaptive k learns tau from
            self.timed.append((drafted, draft_seconds, target_seconds))

    model, tok, _ = tiny
    fives = Fives()
    chunks = list(decode(model, tok, [5, 6, 7], Request(max_new_tokens=12), fives))
    assert fives.asked[0] == 4 and max(fives.asked) == 4
    r = chunks[-1].result  # its times are parts of the whole
    assert 0 < r.prefill_seconds < r.seconds and 0 < r.draft_seconds and 0 < r.target_seconds
    assert r.prefill_seconds + r.draft_seconds + r.target_seconds <= r.seconds
    assert fives.timed == [(x["drafted"], x["draft_s"], x["target_s"]) for x in r.rounds if x["drafted"]]
    assert chunks[-1].result.token_ids == run(model, tok, [5, 6, 7], max_new_tokens=12).token_ids


def test_plain_steps_price_prefill_and_time_the_drafter_speculating_ones_do_not(tiny):
    """A round the drafter leaves empty is a plain step: it sets ctx.prefill_cost (one prompt token's prefill in
    steps, from the prefill's and this step's times) and calls plain_timing on the drafter (and the policy) with
    its time. A drafting round does neither; it calls timing. The result's times are the rounds' own."""
    import time

    from specdec.draft import Draft
    from specdec.drafters.base import Drafter

    class EveryOther(Drafter):
        name = "every-other"

        def __init__(self):
            self.costs, self.plain, self.timed = [], [], []

        def propose(self, ctx, k):
            self.costs.append(ctx.prefill_cost)
            return Draft.chain([5] * k) if len(self.costs) % 2 == 0 else Draft.empty()

        def plain_timing(self, seconds):
            self.plain.append(seconds)

        def timing(self, drafted, draft_seconds, target_seconds):
            self.timed.append((drafted, draft_seconds, target_seconds))

    model, tok, _ = tiny
    for prompt in ([5], [5, 6], [5, 6, 7, 8]):
        d = EveryOther()
        t = time.perf_counter()
        r = list(decode(model, tok, prompt, Request(max_new_tokens=12), d))[-1].result
        wall = time.perf_counter() - t
        assert 0 < r.seconds <= wall and r.tokens_per_s == r.new_tokens / r.seconds
        ts = [x["t"] for x in r.rounds]
        assert ts == sorted(ts) and 0 < ts[0] and ts[-1] <= r.seconds
        plain = [x for x in r.rounds if not x["drafted"]]
        assert len(plain) >= 2 and d.plain == [x["target_s"] for x in plain]
        assert d.timed == [(x["drafted"], x["draft_s"], x["target_s"]) for x in r.rounds if x["drafted"]]
        want, last = [], None  # the cost each propose saw: set by the latest plain round before it, never after
        for x in r.rounds:
            want.append(last)
            if not x["drafted"] and len(prompt) > 1:
                last = r.prefill_seconds / (len(prompt) - 1) / x["target_s"]
        assert d.costs == want[:len(d.costs)]  # the same floats, divided alike
        assert d.costs[0] is None and (d.costs[1] is None) == (len(prompt) == 1)


def test_summarize_counts_per_position_acceptance_by_depth():
    """accepted_per_position[i]: of the rounds that drafted deeper than i and accepted the first i tokens, the
    share that accepted token i too (a tree's depth, not its node count; plain rounds count nowhere; a position no
    round reached: 0.0).
    Rounds (depth, accepted) = (3, 1), (2, 2), (0, 0), (4, 4): position 0: 3 of 3; position 1: (3, 1) stops there,
    2 of 3; position 2: only (4, 4) reached it (the depth-2 round could not), 1 of 1; position 3: 1 of 1."""
    from specdec.decode import summarize

    class Done:
        ids, text, finish_reason = [1] * 11, "x", "length"

    rounds = [dict(drafted=d, depth=d, accepted=a) for d, a in ((3, 1), (2, 2), (0, 0), (4, 4))]
    rounds[3]["drafted"] = 7  # a tree: 7 nodes, 4 deep
    r = summarize(Done(), 5, 2.0, 0.5, 4, 0.25, 1.0, rounds)
    assert r.accepted_per_position == [1.0, 2 / 3, 1.0, 1.0]
    assert r.acceptance_rate == 7 / 9 and r.drafted == 12 and r.accepted == 7
    assert r.mean_accepted == 11 / 4 and r.tokens_per_s == 5.5 and r.new_tokens == 11
    plain = summarize(Done(), 5, 2.0, 0.5, 1, 0.0, 1.0, [rounds[2]])
    assert plain.accepted_per_position == [] and plain.acceptance_rate == 0.0 and plain.mean_accepted == 11
    none = [dict(drafted=3, depth=3, accepted=0)]  # positions 1 and 2 never reached: 0.0, as if rejected
    assert summarize(Done(), 5, 2.0, 0.5, 1, 0.0, 1.0, none).accepted_per_position == [0.0, 0.0, 0.0]


def test_stopper_rules():
    s = Stopper(FakeTok(), Request(max_new_tokens=10, stop=("cd",)))
    assert not s.push(1) and not s.push(2) and s.new_text() == "a"  # "b" held back: could start "cd"? no, but 1 char holdback
    assert not s.push(3)
    assert s.push(4) and s.finish_reason == "stop" and s.text == "ab"
    assert s.new_text() == "b"
    s = Stopper(FakeTok(), Request(max_new_tokens=3))
    assert not s.push(1) and not s.push(2) and s.push(3) and s.finish_reason == "length" and s.text == "abc"
    s = Stopper(FakeTok(), Request(max_new_tokens=3))
    assert not s.push(1) and s.push(0) and s.finish_reason == "stop" and s.text == "a" and s.ids == [1, 0]


class WordTok:
    """Tokens of several characters; 3 is EOS but decodes to text (as some tokenizers' EOS does)."""
    eos_ids = frozenset({3})

    def decode(self, ids):
        return "".join({1: "ab", 2: "cdx", 3: "y"}[i] for i in ids)


def test_stopper_with_multi_character_tokens_and_a_visible_eos():
    s = Stopper(WordTok(), Request(max_new_tokens=10, stop=("cd",)))
    assert not s.push(1) and s.push(2) and s.finish_reason == "stop" and s.text == "ab"  # "cd" ends inside "cdx"
    s = Stopper(WordTok(), Request(max_new_tokens=2))
    assert not s.push(1) and s.push(3) and s.finish_reason == "stop" and s.text == "ab"  # EOS as the last token
    assert s.new_text() == "ab"  # EOS's own text is never part of it


def test_stop_strings_completing_at_one_token_cut_at_the_earliest_in_any_order():
    """Token "cdx" completes both "dx" and "bc" in "abcdx": the text is cut before the earliest ("a"), not
    before whichever is listed first (it was "abc" for ("dx", "bc"), "a" for ("bc", "dx"))."""
    for stop in (("dx", "bc"), ("bc", "dx")):
        s = Stopper(WordTok(), Request(max_new_tokens=10, stop=stop))
        out = ""
        assert not s.push(1)
        out += s.new_text()
        assert s.push(2) and s.finish_reason == "stop" and s.text == "a", stop
        assert out + s.new_text() == "a"


class ByteTok:
    """Token = one byte (0 = EOS); decoded like a byte-level BPE: a character cut short shows as U+FFFD."""
    eos_ids = frozenset({0})

    def decode(self, ids):
        return bytes(i for i in ids if i).decode("utf-8", errors="replace")


def test_stop_string_with_u_fffd_ignores_half_decoded_characters():
    e_acute = list("é".encode())                           # two bytes: the first alone decodes to U+FFFD
    s = Stopper(ByteTok(), Request(max_new_tokens=10, stop=("\ufffd",)))
    assert not s.push(ord("a")) and not s.push(e_acute[0]) and not s.push(e_acute[1])
    assert not s.push(ord("b")) and s.text == "aéb"
    s = Stopper(ByteTok(), Request(max_new_tokens=10, stop=("a\ufffdb",)))
    assert not s.push(ord("a")) and not s.push(0xFF)          # 0xFF is never UTF-8: a real U+FFFD, once followed
    assert s.push(ord("b")) and s.finish_reason == "stop" and s.text == ""
    s = Stopper(ByteTok(), Request(max_new_tokens=2, stop=("\ufffd",)))
    assert not s.push(ord("a")) and s.push(e_acute[0])       # the last token: the text is final
    assert s.finish_reason == "stop" and s.text == "a"
    s = Stopper(ByteTok(), Request(max_new_tokens=9, stop=("\ufffd",)))
    assert not s.push(ord("a")) and not s.push(e_acute[0]) and s.push(0)  # EOS: final too
    assert s.finish_reason == "stop" and s.text == "a"


def test_holdback_counts_complete_characters_only():
    """A stop string ending in a multi-byte character: a half-decoded character (U+FFFD until its last byte)
    must not use up the holdback, or the first star is shown before the stop string completes."""
    star = list("🌟".encode())  # four bytes

    def shown(tokens, stop):
        s, out = Stopper(ByteTok(), Request(max_new_tokens=len(tokens), stop=(stop,))), ""
        for t in tokens:
            done = s.push(t)
            out += s.new_text()
            if done:
                return out, s.text, s.finish_reason

    assert shown(star + star + [ord("a")], "🌟🌟") == ("", "", "stop")  # was "🌟": a star of the stop string shown
    assert shown([ord("a")] + star + [ord("b")] + star + star, "🌟🌟") == ("a🌟b", "a🌟b", "stop")
    assert shown(star + [ord("a")] + star, "🌟🌟") == ("🌟a🌟", "🌟a🌟", "length")


def test_the_longest_stop_string_sets_the_holdback():
    """Stops "q" and "xyz": two characters are held back ("xy" may start "xyz"), not none (the shortest's)."""
    s, out = Stopper(ByteTok(), Request(max_new_tokens=9, stop=("q", "xyz"))), ""
    for t in b"axy":
        assert not s.push(t)
        out += s.new_text()
    assert out == "a"
    assert s.push(ord("z")) and s.text == "a" and out + s.new_text() == "a"


def test_a_tokenizer_without_clean_up_holds_nothing_back_at_spaces():
    s, out = Stopper(ByteTok(), Request(max_new_tokens=9)), ""  # ByteTok says nothing of `cleans_up_spaces`
    for t in b"a b":
        s.push(t)
        out += s.new_text()
    assert out == "a b"


class CleanTok(ByteTok):
    """Byte tokens with transformers' clean-up of " .": a space may vanish when a later token comes."""
    cleans_up_spaces = True

    def decode(self, ids):
        return super().decode(ids).replace(" .", ".")


def test_a_space_the_clean_up_may_drop_is_held_back_only_while_it_may():
    def shown(data):
        s, out = Stopper(CleanTok(), Request(max_new_tokens=99)), []
        for t in data:
            s.push(t)
            out.append(s.new_text())
        return out

    assert shown(b" .") == ["", "."]  # the first character a space: held back, then dropped
    assert shown(b"a .") == ["a", "", "."]
    assert "".join(shown(b"a b cdef")) == "a b cdef" and shown(b"a b cdef")[-1] == "f"  # spaces 3+ back: shown


class ModeTok(ByteTok):
    """A tokenizer whose pieces do not add up: token 1 anywhere upper-cases the whole text."""

    def decode(self, ids):
        text = super().decode([i for i in ids if i != 1])
        return text.upper() if 1 in ids else text


def test_pieces_that_do_not_add_up_are_caught_and_decoded_whole():
    """The incremental text is checked against a whole decode at every power-of-two length (a window of 4
    tokens cannot see token 1 once it is 5 back): from the 8th token on, the text is the whole decode."""
    ids = [1] + [ord("a")] * 15
    s = Stopper(ModeTok(), Request(max_new_tokens=99))
    for n, t in enumerate(ids, 1):
        s.push(t)
        if n >= 8:
            assert s.text == "A" * (n - 1), n


class Counting:
    """A tokenizer's decode, counting the tokens it was handed."""

    def __init__(self, tok):
        self.tok, self.eos_ids, self.decoded = tok, frozenset(), 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tok.decode(ids)


def pushes_decode_whole(tok, ids):
    """Push ids one by one (no stop rule can fire): the text equals a whole decode after every token; returns
    the tokens the tokenizer decoded in all."""
    counting = Counting(tok)
    s = Stopper(counting, Request(max_new_tokens=len(ids) + 1))
    for i, t in enumerate(ids):
        assert not s.push(t)
        assert s.text == tok.decode(ids[:i + 1]), (ids[:i + 1], s.text)
    return counting.decoded


def test_stopper_text_is_the_whole_decode_after_every_token(tiny_folder):
    """The incremental text (`Stopper._decoded`) against a whole decode at every token: byte tokens with
    characters of 2-4 bytes cut anywhere, and the tiny character tokenizer with its specials; 600 tokens
    decode ~11 each (a whole decode every time: ~300)."""
    g = torch.Generator().manual_seed(0)
    text = "aé€😀 b\n" * 80
    ids = list(text.encode())
    ids[100:103] = [0xFF, 0xC3, ord("x")]  # invalid and cut-short sequences, real U+FFFDs
    assert pushes_decode_whole(ByteTok(), ids) < 20 * len(ids)
    tok = Tokenizer(tiny_folder)
    ids = torch.randint(0, 96, (600,), generator=g).tolist()  # <unk>, <s>, </s> among characters
    assert pushes_decode_whole(tok, ids) < 20 * len(ids)


def test_stream_adds_up_with_a_tokenizer_that_cleans_up_spaces(tmp_path):
    """A tokenizer configured with transformers' clean-up (Llama 3's tokenizer_config says so; transformers 4
    applies it to BPE) drops a space when a later token completes " 'm", " ." or " n't": the stream must not
    have shown that space already (it showed "for 'manual'..." beside the final "for'manual'...", and a stop
    string matching across the dropped space cut the text before what had been shown)."""
    import json

    from tests.tiny import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(clean_up_tokenization_spaces=True,  # transformers 5 skips BPE's clean-up unless forced
                  clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(tmp_path)
    ids = tok.encode("for 'manual' x . y n't ok ?", chat=False)
    final = tok.decode(ids)
    assert final == "for'manual' x. yn't ok?"  # the clean-up is on
    assert pushes_decode_whole(tok, ids)
    for stop, text in (((), final), (("r'",), "fo"), (("x.",), "for'manual' ")):
        s, out = Stopper(tok, Request(max_new_tokens=len(ids), stop=stop)), ""
        for t in ids:
            done = s.push(t)
            out += s.new_text()
            if done:
                break
        assert (s.text, out) == (text, text), stop


def test_decode_is_transformers_decode(tiny_folder):
    """`Tokenizer.decode` calls the Rust tokenizer directly (no clean-up configured): the text of transformers'
    own decode, specials skipped, for random ids and cut multi-byte characters."""
    tok = Tokenizer(tiny_folder)
    assert tok._decoder is not None
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 2, 5, 40):
        for _ in range(20):
            ids = torch.randint(0, tok.vocab_size, (n,), generator=g).tolist()
            assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True)


def test_context_overflow_and_bad_requests(tiny):
    model, tok, _ = tiny
    with pytest.raises(SpecdecError, match="context"):
        run(model, tok, [5] * 200, max_new_tokens=100)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="max_new_tokens"):
            Request(max_new_tokens=bad)
    with pytest.raises(SpecdecError, match="empty"):
        run(model, tok, [], max_new_tokens=3)
