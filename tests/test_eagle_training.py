"""EAGLE training on a tiny random target: the multi-layer hidden cache (shapes, equal to the target's
forward), the draft vocabulary's d2t/t2d round trip, the training-time-test unroll equal to what the head
computes at inference (full-sequence call for step 0, KV-cache replay for later steps), the unrolled loss
going down, an interrupted run resuming to the same head."""

import math
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.drafters.eagle_head import EagleConfig, EagleHead, default_aux_layers
from specdec.runtime.loader import load_transformer
from specdec.tokenizer import Tokenizer
from specdec.training import eagle as E
from specdec.training import hidden_cache
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = save_tiny("llama", tmp_path_factory.mktemp("target"), seed=0)
    return dict(folder=folder, target=load_transformer(folder), tok=Tokenizer(folder))


def documents(env, n=10, words=60, seed=0):
    from specdec.training import corpus

    vocab = ["the cat", "sat on", "a mat", "and then", "it ran", "far away"]
    g = torch.Generator().manual_seed(seed)
    docs = [" ".join(vocab[int(i)] for i in torch.randint(0, 6, (words,), generator=g)) for _ in range(n)]
    return list(corpus.token_documents(docs, env["tok"], max_len=120))


@pytest.fixture(scope="module")
def cache(env, tmp_path_factory):
    layers = default_aux_layers(3, env["target"].cfg.num_layers)
    folder = tmp_path_factory.mktemp("hidden") / "c"
    return hidden_cache.build(env["target"], iter(documents(env)), folder, 1000, {"test": 1, "layers": list(layers)},
                              progress=False, layers=layers)


def test_layer_cache_holds_the_targets_layer_outputs(env, cache, tmp_path):
    layers = tuple(cache.meta["layers"])
    assert layers == (1, 0, 0) and cache.hidden is None
    assert cache.features.shape == (1000, 3 * 64) and cache.meta["hidden_size"] == 64
    ids = documents(env)[0]
    out = env["target"](torch.tensor([ids]), env["target"].new_cache(len(ids)), hidden_layers=layers)
    want = torch.cat([out.hidden[i][0] for i in layers], -1)
    got = torch.from_numpy(np.asarray(cache.features[:len(ids)], dtype=np.float32))
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert (cache.labels[:len(ids)] == out.logits[0].argmax(-1).numpy()).all()
    again = hidden_cache.build(None, iter(()), cache.folder, 1000, {}, progress=False, layers=layers)  # reused
    assert np.array_equal(again.features[:50], cache.features[:50])
    # a cache without layers keeps the name it had before layers existed
    assert hidden_cache.cache_dir(Path("/r"), {"format": 1, "requested": 5}).name == "794d1ec83fa0c260"


def test_a_batched_build_caches_what_one_document_a_forward_caches(env, tmp_path):
    """`build(batch=3)` (documents of different lengths right-padded into one forward) caches the same labels,
    tokens and documents as one document a forward, and the same features up to fp32 noise (found by mutating
    hidden_cache.py: left padding, or labels read one position late, passed)."""
    docs = [d[:k] for d, k in zip(documents(env, n=4), (40, 90, 17, 60))]
    total = sum(map(len, docs))
    layers = (1, 0)
    one, three = (hidden_cache.build(env["target"], iter(docs), tmp_path / str(b), total, {"b": b}, progress=False,
                                     layers=layers, batch=b) for b in (1, 3))
    assert len(one) == len(three) == total
    for a in ("labels", "tokens", "doc"):
        assert np.array_equal(getattr(one, a), getattr(three, a)), a
    assert np.array_equal(one.tokens, np.concatenate(docs)) and one.doc[-1] == 3
    torch.testing.assert_close(torch.from_numpy(np.asarray(three.features, np.float32)),
                               torch.from_numpy(np.asarray(one.features, np.float32)), atol=2e-3, rtol=2e-3)


def test_draft_vocabulary_round_trip(env):
    labels = np.array([5, 5, 9, 2, 5, 9, 40, 2, 2, 2])
    vocab, coverage = E.draft_vocabulary(labels, 3)
    assert vocab.tolist() == [2, 5, 9] and coverage == pytest.approx(0.9)
    cfg = EagleConfig.for_target(env["target"].cfg, "tiny", None, version=3, draft_vocab_size=3)
    head = EagleHead(cfg)
    head.set_vocab(torch.from_numpy(vocab))
    assert head.to_target(torch.arange(3)).tolist() == [2, 5, 9]  # target_id = draft_id + d2t[draft_id]
    assert head.t2d.nonzero().flatten().tolist() == [2, 5, 9]
    tr = E.Trainer(head, None, None, E.TrainSettings())
    assert tr.draft_targets(torch.tensor([9, 2, 40, -1, 5])).tolist() == [2, 0, -1, -1, 1]


def random_head(env, seed=0):
    cfg = EagleConfig.for_target(env["target"].cfg, "tiny", None, version=3, draft_vocab_size=40)
    torch.manual_seed(seed)
    head = EagleHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    head.set_vocab(torch.arange(0, 80, 2))
    return head.eval()


def test_unroll_is_what_the_drafter_computes(env):
    head = random_head(env)
    g = torch.Generator().manual_seed(1)
    B, T, S, D = 2, 9, 3, 64
    fused = torch.randn(B, T, D, generator=g)
    embs = [torch.randn(B, T, D, generator=g) for _ in range(S)]
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        steps = list(E.unroll(head, fused, embs, pos))
        logits0, h0 = head(embs[0], fused, pos)
        torch.testing.assert_close(steps[0][0], logits0, atol=1e-4, rtol=1e-4)
        for b, t in ((0, 0), (1, 5), (0, 8)):  # the drafter: prefix rows 0..t, then steps 1.. on its own outputs
            cache = head.new_cache(T + S)
            logits, h = head(embs[0][b:b + 1, :t + 1], fused[b:b + 1, :t + 1], pos[b:b + 1, :t + 1], cache)
            hid = h[:, -1:]
            for j in range(1, S):
                logits, hid = head(embs[j][b:b + 1, t:t + 1], hid, torch.tensor([[t + j]]), cache)
                torch.testing.assert_close(logits[0, 0], steps[j][0][b, t], atol=1e-4, rtol=1e-4)


def settings(**kw):
    base = dict(bf16=False, epochs=4, ttt_steps=3, draft_vocab=40, batch_tokens=300, lr=2e-3, warmup=5, val_fraction=0.2,
                eval_depth=4, evals=2, checkpoint_every=5)
    return E.TrainSettings(**{**base, **kw})


def unrolled_loss(head, env, cache, s):
    tr = E.Trainer(head, env["target"].embed.weight.detach().float(), cache, s)
    docs = E.Documents(cache, s.val_fraction)
    with torch.no_grad():
        return float(np.mean([tr.loss(E.Batch(cache, g, s.ttt_steps))[0].item()
                              for g in docs.batches(docs.train, s.batch_tokens, None)]))


def test_training_time_test_lowers_the_unrolled_loss_and_resumes_exactly(env, cache, tmp_path, monkeypatch):
    s = settings()
    head = E.train(cache, env["target"], "tiny", "fp", s, tmp_path / "a", progress=False)
    docs = E.Documents(cache, s.val_fraction)
    vocab, _ = E.draft_vocabulary(np.concatenate([cache.labels[a:b] for a, b in docs.train]), 40)
    before = unrolled_loss(E.new_head(env["target"], "tiny", "fp", s, head.cfg.aux_layers, vocab), env, cache, s)
    after = unrolled_loss(head, env, cache, s)
    assert after < before - 0.5, (before, after)
    t = head.cfg.training
    assert len(t["val"]["alpha"]) == 4 and len(t["history"]) == 2 and t["history"][0]["tokens_seen"] > 0
    assert head.to_target(torch.arange(40)).tolist() == vocab.tolist()

    calls = {"n": 0}
    real = E.Trainer.loss

    def interrupted(self, batch):  # Ctrl-C in the 8th step (after the checkpoint at step 5): held to its end
        calls["n"] += 1
        if calls["n"] == 8:
            signal.raise_signal(signal.SIGINT)
        return real(self, batch)

    monkeypatch.setattr(E.Trainer, "loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        E.train(cache, env["target"], "tiny", "fp", s, tmp_path / "b", progress=False)
    monkeypatch.setattr(E.Trainer, "loss", real)
    assert torch.load(tmp_path / "b" / E.CHECKPOINT, weights_only=False)["state"]["step"] == 8
    resumed = E.train(cache, env["target"], "tiny", "fp", s, tmp_path / "b", resume=True, progress=False)
    assert resumed.cfg.training["steps"] == t["steps"]
    for k, v in head.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


def test_eagle1_regresses_features_with_frozen_lm_head(env, tmp_path):
    layers = default_aux_layers(1, env["target"].cfg.num_layers)
    c1 = hidden_cache.build(env["target"], iter(documents(env)), tmp_path / "c1", 600, {"layers": list(layers)},
                            progress=False, layers=layers)
    s = settings(version=1, epochs=2, ttt_steps=1)
    head = E.train(c1, env["target"], "tiny", "fp", s, tmp_path / "v1", progress=False)
    assert head.cfg.draft_vocab_size == env["target"].cfg.vocab_size and head.cfg.aux_layers == (2,)
    assert head.cfg.training["draft_vocab"] == env["target"].cfg.vocab_size  # the record says what it drafted over
    assert torch.equal(head.fc.weight, torch.eye(64))  # EAGLE-1: features pass through
    assert torch.equal(head.lm_head.weight, env["target"].lm_head.weight.float())


def test_train_eagle_from_the_command_line(env, tmp_path, monkeypatch, capsys):
    import json

    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    data = tmp_path / "corpus.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"count {i}"}, {"role": "assistant", "content": "1 2 3 4 " * 9}]}
            for i in range(6)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "eagle"
    args = ["train", "eagle", "--model", str(env["folder"]), "--data", str(data), "--tokens", "400", "--epochs", "1",
            "--draft-vocab", "30", "--batch-tokens", "128", "--out", str(out), "--quiet", "--json"]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["tokens"] == 400 and record["ttt_steps"] == 3 and len(record["val"]["alpha"]) == 6
    head = EagleHead.load(out)
    assert head.cfg.version == 3 and head.cfg.draft_vocab_size == 30 and head.cfg.aux_layers == (1, 0, 0)
    assert head.cfg.training["steps"] == record["steps"]
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").dtype == torch.float16
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert main(args[:-2] + ["--resume", "--quiet"]) == 0  # the finished run's checkpoint: nothing left to do
    assert main(args[:2] + ["--model", str(env["folder"]), "--ttt-steps", "0"]) == 2
    # self-distillation: the target's own answers to the first user turns, a cache of its own name
    regen = ["--regenerate", "--max-len", "60", "--device", "cpu", "--out", str(tmp_path / "regen")]
    assert main(args[:-4] + regen + ["--quiet"]) == 0
    folders = sorted((tmp_path / "home" / "hidden").glob("*/*/meta.json"))
    assert len(folders) == 2 and any(json.loads(f.read_text()).get("regenerate") for f in folders)
    assert main(args[:-4] + regen[:-2] + ["--device", "tpu", "--quiet"]) == 2


def test_train_refuses_what_it_would_lose_or_ignore_before_the_corpus_pass(env, tmp_path, monkeypatch, capsys):
    """Each refusal is one line (exit 2) said before the target runs over the corpus (`hidden_cache.build` would
    raise here): a resume with other --tokens (was: the whole cache built, then refused); a checkpoint cut short
    (was: torch's traceback) or another trainer's (was: settings named, not the kind); an --out holding another
    kind's head or a model (was: silently overwritten); --draft-vocab with --version 1 (was: ignored, recorded)."""
    import json

    from specdec.cli import main
    from specdec.training import hidden_cache

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    data = tmp_path / "corpus.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"{i} " + "the cat sat on a mat " * 12}) for i in range(6)))
    out = tmp_path / "eagle"
    args = ["train", "eagle", "--model", str(env["folder"]), "--data", str(data), "--tokens", "300", "--epochs", "1",
            "--draft-vocab", "30", "--batch-tokens", "128", "--quiet"]
    assert main(args + ["--out", str(out)]) == 0
    monkeypatch.setattr(hidden_cache, "build", lambda *a, **k: pytest.fail("the corpus pass ran"))
    medusa_ck = tmp_path / "medusa-run"
    medusa_ck.mkdir()
    torch.save({"heads": {}, "settings": {}}, medusa_ck / "checkpoint.pt")
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "checkpoint.pt").write_bytes((out / "checkpoint.pt").read_bytes()[:500])
    model_out = tmp_path / "model-copy"
    model_out.mkdir()
    (model_out / "config.json").write_text((env["folder"] / "config.json").read_text())
    medusa = ["train", "medusa", "--model", str(env["folder"]), "--data", str(data), "--tokens", "300", "--quiet"]
    cases = [(args + ["--out", str(out), "--resume", "--tokens", "250"], "--tokens differ"),
             (args + ["--out", str(out), "--resume", "--batch-tokens", "64"], "batch_tokens 128 (now 64)"),
             (args + ["--out", str(cut), "--resume"], "checkpoint.pt is damaged or unreadable"),
             (args + ["--out", str(medusa_ck), "--resume"], "is a medusa training checkpoint, not eagle's"),
             (medusa + ["--out", str(out)], "holds eagle heads; training medusa heads there would overwrite it"),
             (args + ["--out", str(model_out)], "not a specdec head's (a model?)"),
             (args + ["--out", str(tmp_path / "v1"), "--version", "1"], "--draft-vocab is for --version 3")]
    for argv, said in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert said in err and "Traceback" not in err and "\n" not in err, (argv, err)
    assert json.loads((model_out / "config.json").read_text()) == json.loads((env["folder"] / "config.json").read_text())
    assert not (tmp_path / "v1").exists()


def test_batch_rows_are_the_shifted_tokens_labels_and_features():
    """Batch by hand (found by mutating eagle.py: shifting tokens, labels, feat_next or on_path by one, or keeping a
    2-token document, went unnoticed): row t of a document of n reads features[t] and, at step j, token t+1+j,
    label t+1+j and (v1) features[t+1+j]; on_path[j] says the corpus token t+1+j is the target's greedy one after
    t+j. Past a document's end: token 0, label -1, features 0."""
    tokens = np.array([100, 101, 102, 103, 104, 200, 201, 202, 300, 301], np.int32)
    labels = np.array([101, 7, 103, 104, 9, 201, 202, 5, 301, 8], np.int32)  # 7, 9, 5, 8: off the corpus
    doc = np.array([0, 0, 0, 0, 0, 1, 1, 1, 2, 2], np.int32)
    feats = np.stack([np.arange(10), -np.arange(10)], 1).astype(np.float16)
    cache = hidden_cache.HiddenCache(None, {}, labels=labels, tokens=tokens, doc=doc, features=feats)
    docs = E.Documents(cache, val_fraction=0.5)
    assert docs.spans == [(0, 5), (5, 8)] and docs.train == [(0, 5)] and docs.val == [(5, 8)]  # 2 tokens: dropped
    b = E.Batch(cache, docs.spans, steps=2, with_next=True)
    assert b.feats[..., 0].tolist() == [[0, 1, 2, 3], [5, 6, 0, 0]]
    assert b.tokens.tolist() == [[[101, 102, 103, 104], [201, 202, 0, 0]], [[102, 103, 104, 0], [202, 0, 0, 0]]]
    assert b.labels.tolist() == [[[7, 103, 104, 9], [202, 5, -1, -1]], [[103, 104, 9, -1], [5, -1, -1, -1]]]
    T, F_ = True, False
    assert b.on_path.tolist() == [[[T, F_, T, T], [T, T, F_, F_]], [[F_, T, T, F_], [T, F_, F_, F_]],
                                  [[T, T, F_, F_], [F_, F_, F_, F_]]]
    assert b.feat_next[..., 0].tolist() == [[[1, 2, 3, 4], [6, 7, 0, 0]], [[2, 3, 4, 0], [7, 0, 0, 0]]]
    assert b.positions.tolist() == [[0, 1, 2, 3]] * 2


def test_loss_weighs_step_j_by_0_8_to_the_j_and_drops_labels_past_the_end(env, monkeypatch):
    """Trainer.loss by hand (found by mutating eagle.py): uniform logits over a draft vocabulary of 4 give every
    scored row log 4, so the 3-step loss is log 4 x (1 + 0.8 + 0.64); a label past a document's end (-1) maps to
    no draft id, even where token 0 is in the draft vocabulary."""
    cfg = EagleConfig.for_target(env["target"].cfg, "tiny", None, version=3, draft_vocab_size=4)
    head = EagleHead(cfg)
    head.set_vocab(torch.tensor([0, 3, 5, 7]))
    n = 6
    cache = hidden_cache.HiddenCache(None, {}, labels=np.full(n, 3, np.int32), tokens=np.arange(n, dtype=np.int32),
                                     doc=np.zeros(n, np.int32), features=np.zeros((n, 64), np.float16))
    tr = E.Trainer(head, None, cache, settings(ttt_steps=3))
    assert tr.draft_targets(torch.tensor([-1, 0, 3, 4, 7])).tolist() == [-1, 0, 1, -1, 3]

    def uniform(self, batch, steps, noise=False):
        for _ in range(steps):
            yield torch.zeros(*batch.labels.shape[1:], 4), None

    monkeypatch.setattr(E.Trainer, "run", uniform)
    loss, acc = tr.loss(E.Batch(cache, [(0, n)], 3))
    assert math.isclose(float(loss), math.log(4) * (1 + 0.8 + 0.64), rel_tol=1e-6)
    assert acc == [0.0, 0.0, 0.0]  # argmax 0 is token 0, the labels are token 3


def test_validation_alpha_counts_only_positions_on_the_targets_greedy_path(env, monkeypatch):
    """An oracle head (right everywhere but at depth 1 of row 0): α is 1 wherever measured, except depth 1,
    and a position is measured only while the corpus follows the target's greedy tokens."""
    n = 12
    tokens = np.arange(3, 3 + n, dtype=np.int32)
    labels = np.r_[tokens[1:], 50].astype(np.int32)
    labels[5] = 60  # the target would not continue the corpus after token 5
    cache = hidden_cache.HiddenCache(None, {}, labels=labels, tokens=tokens, doc=np.zeros(n, np.int32),
                                     features=np.zeros((n, 64), np.float16))
    cfg = EagleConfig.for_target(env["target"].cfg, "tiny", None, version=3)
    s = settings(eval_depth=4)
    tr = E.Trainer(EagleHead(cfg), None, cache, s)

    def oracle(self, batch, steps, noise=False):
        for j in range(steps):
            pick = batch.labels[j].clamp(min=0).clone()
            if j == 1:
                pick[0, 0] = 1  # wrong at depth 1 of row 0
            yield torch.nn.functional.one_hot(pick, 96).float(), None

    monkeypatch.setattr(E.Trainer, "run", oracle)
    got = tr.evaluate([(0, n)])
    agree = labels[:-1] == tokens[1:]
    reached = [0] * 4
    for t in range(n - 1):
        for j in range(4):
            if t + 1 + j > n - 1 or not agree[t:t + j + 1].all() or (t == 0 and j == 2):
                break
            reached[j] += 1
    assert got["reached"] == reached and reached[0] == 10
    assert got["alpha"] == [1.0, round(1 - 1 / reached[1], 4), 1.0, 1.0]


def test_shipped_smollm2_head_is_a_small_trained_eagle3_head():
    from specdec.training.heads import SHIPPED

    folder = SHIPPED / "smollm2-135m" / "eagle"
    head = EagleHead.load(folder)
    c = head.cfg
    assert c.version == 3 and c.aux_layers == (1, 14, 26) and c.hidden_size == 576 and c.vocab_size == 49152
    assert (folder / "model.safetensors").stat().st_size < 25e6 and not (folder / E.CHECKPOINT).exists()
    t = c.training
    assert t["ttt_steps"] >= 3 and len(t["val"]["alpha"]) == t["eval_depth"] and len(t["history"]) >= 3
    assert t["history"][0]["tokens_seen"] < t["history"][-1]["tokens_seen"]  # the α-vs-tokens curve
    assert head.t2d.sum() == c.draft_vocab_size and torch.equal(head.t2d[head.to_target(torch.arange(4))],
                                                                 torch.ones(4, dtype=torch.bool))


@pytest.mark.integration
def test_shipped_smollm2_head_matches_the_target():
    from specdec.store import resolve
    from specdec.training.heads import SHIPPED, fingerprint

    try:
        folder = resolve("smollm2-135m")
    except Exception as e:  # noqa: BLE001 - no network and no cache: nothing to test against
        pytest.skip(f"smollm2-135m unavailable: {e}")
    head = EagleHead.load(SHIPPED / "smollm2-135m" / "eagle")
    target = load_transformer(folder)
    head.cfg.check_target(target.cfg, "smollm2-135m", fingerprint(folder))
    assert head.cfg.target_fingerprint == fingerprint(folder)


def test_every_epoch_runs_all_its_batches_however_the_shuffle_groups_them(env, tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 120, 16)
    n = int(lengths.sum())
    cache = hidden_cache.HiddenCache(None, {"layers": [1, 0, 0], "tokens": n, "documents": 16},
                                     labels=rng.integers(3, 96, n).astype(np.int32),
                                     tokens=rng.integers(3, 96, n).astype(np.int32),
                                     doc=np.repeat(np.arange(16), lengths).astype(np.int32),
                                     features=rng.standard_normal((n, 192)).astype(np.float16))
    s = settings(epochs=3, batch_tokens=200, evals=2)
    docs = E.Documents(cache, s.val_fraction)
    counts = [len(docs.batches(docs.train, s.batch_tokens, s.seed + e)) for e in range(s.epochs)]
    assert len(set(counts)) > 1  # the shuffles group the documents into different numbers of batches
    head = E.train(cache, env["target"], "tiny", "fp", s, tmp_path, progress=False)
    total = sum(counts)
    assert head.cfg.training["steps"] == total
    assert [h["step"] for h in head.cfg.training["history"]] == [round(total / 2), total]  # at 50% and 100%


def test_draft_vocabulary_holds_only_tokens_the_target_predicts():
    """A draft vocabulary larger than the tokens seen is capped at them: no never-predicted token takes a row."""
    vocab, coverage = E.draft_vocabulary(np.array([5, 5, 9, 2, 5, 9]), 10)
    assert vocab.tolist() == [2, 5, 9] and coverage == 1.0
    vocab, coverage = E.draft_vocabulary(np.array([5, 5, 9, 2, 5, 9]), 2)  # the docstring's example
    assert vocab.tolist() == [5, 9] and coverage == pytest.approx(5 / 6)


def test_a_new_head_passes_the_last_aux_layers_features_through(env):
    """new_head: `fc` starts as [0 | 0 | I], the last aux layer's features (aux_layers (1, 0, 0): the third block,
    layer 0), and `lm_head` as the target's LM-head rows of the draft vocabulary."""
    vocab = np.array([2, 5, 9, 40])
    head = E.new_head(env["target"], "tiny", "fp", settings(), (1, 0, 0), vocab)
    g = torch.Generator().manual_seed(0)
    f = [torch.randn(4, 64, generator=g) for _ in range(3)]
    with torch.no_grad():
        torch.testing.assert_close(head.fuse(torch.cat(f, -1)), f[2])
    assert torch.equal(head.lm_head.weight, env["target"].lm_head.weight.detach().float()[torch.from_numpy(vocab)])
    assert head.to_target(torch.arange(4)).tolist() == vocab.tolist()


def v1_cache(n=6):
    """A one-document cache for EAGLE-1 (one aux layer of width 64): features[t] = (t, 0, ..., 0)."""
    labels = np.array([3, 4, 5, 9, 7, 3], np.int32)[:n]  # 4 and 9: outside the draft vocabulary [0, 3, 5, 7]
    feats = np.zeros((n, 64), np.float16)
    feats[:, 0] = np.arange(n)
    return hidden_cache.HiddenCache(None, {}, labels=labels, tokens=np.arange(10, 10 + n, dtype=np.int32),
                                    doc=np.zeros(n, np.int32), features=feats)


def test_eagle1_loss_regresses_every_rows_next_features(env, monkeypatch):
    """Trainer.loss for version 1 by hand: SmoothL1(out_t, f_{t+1}) over every row with a next token (labels
    outside the draft vocabulary too: the feature regression needs no token) + 0.1 x CE over the rows whose
    label is in the draft vocabulary. Outputs 0 and f_{t+1} = (t+1, 0, ..): SmoothL1 = |t+1| - 0.5 in one of
    64 columns, rows 0..4: (0.5 + 1.5 + 2.5 + 3.5 + 4.5) / (5 x 64); uniform logits: CE = log 4."""
    cfg = EagleConfig.for_target(env["target"].cfg, "tiny", None, version=1, draft_vocab_size=4, aux_layers=(2,))
    head = EagleHead(cfg)
    head.set_vocab(torch.tensor([0, 3, 5, 7]))
    cache = v1_cache()
    tr = E.Trainer(head, None, cache, settings(version=1, ttt_steps=1))

    def zeros(self, batch, steps, noise=False):
        for _ in range(steps):
            yield torch.zeros(*batch.labels.shape[1:], 4), torch.zeros(*batch.labels.shape[1:], 64)

    monkeypatch.setattr(E.Trainer, "run", zeros)
    batch = E.Batch(cache, [(0, 6)], 1, with_next=True)
    assert tr.draft_targets(batch.labels[0]).tolist() == [[-1, 2, -1, 3, 1]]
    loss, _ = tr.loss(batch)
    assert math.isclose(float(loss), 12.5 / (5 * 64) + 0.1 * math.log(4), rel_tol=1e-6)


def test_eagle1_noise_is_uniform_on_both_sides(env, monkeypatch):
    """EAGLE-1's input noise is U(-0.1, 0.1) on the target features the head fuses (not U(0, 0.1)): centred."""
    cfg = EagleConfig.for_target(env["target"].cfg, "tiny", None, version=1, aux_layers=(2,))
    head = EagleHead(cfg)
    cache = v1_cache()
    tr = E.Trainer(head, env["target"].embed.weight.detach().float(), cache, settings(version=1, ttt_steps=1))
    fused, real = [], head.fuse
    monkeypatch.setattr(head, "fuse", lambda f: fused.append(f.clone()) or real(f))
    batch = E.Batch(cache, [(0, 6)], 1)
    torch.manual_seed(0)
    with torch.no_grad():
        next(tr.run(batch, 1, noise=True))
        next(tr.run(batch, 1, noise=False))
    assert torch.equal(fused[1], batch.feats)
    noise = (fused[0] - batch.feats).flatten()  # 5 rows x 64
    assert float(noise.abs().max()) <= E.V1_NOISE and float(noise.min()) < -0.05 and float(noise.max()) > 0.05
    assert abs(float(noise.mean())) < 0.02


def test_a_cache_build_never_ends_on_a_document_too_short_to_train_on(env, tmp_path):
    """The token budget cuts the last document short, but never to 1 or 2 tokens (no draft position with a
    next token to learn): two documents of 10, budget 11 or 12 -> the first document alone; budget 13 -> 10 + 3."""
    docs = [list(range(3, 13)), list(range(20, 30))]
    for budget, want in ((11, [10]), (12, [10]), (13, [10, 3])):
        c = hidden_cache.build(env["target"], iter(docs), tmp_path / str(budget), budget, {"b": budget},
                               progress=False, layers=(2,))
        assert len(c) == sum(want) and c.meta["documents"] == len(want), budget
        assert np.bincount(c.doc).tolist() == want and c.tokens.tolist() == sum(docs, [])[:sum(want)]


def test_corpus_documents_under_3_tokens_are_dropped(env):
    """token_documents keeps documents of 3+ tokens (a draft position needs a next token and a label after it),
    cut to max_len: with the one-token-per-character tiny tokenizer, "ab" is dropped, "abc" kept."""
    from specdec.training import corpus

    docs = list(corpus.token_documents(["ab", "abc", "x", "abcdefgh"], env["tok"], max_len=5))
    assert [len(d) for d in docs] == [3, 5] and docs[0] == env["tok"].encode("abc", chat=False)


def test_the_cache_folder_is_named_by_the_settings_whatever_their_order():
    """Settings built in another order (train.py adds "regenerate" and "layers" after the rest; a checkpoint's copy
    comes back from JSON) name the same cache folder, other layers another one (found by mutating hidden_cache.py:
    `sort_keys=False` passed, the pinned name's keys being in sorted order already)."""
    name = hidden_cache.cache_dir(Path("/r"), {"format": 1, "requested": 5, "layers": [1, 0]})
    assert name == hidden_cache.cache_dir(Path("/r"), {"layers": [1, 0], "requested": 5, "format": 1})
    assert name != hidden_cache.cache_dir(Path("/r"), {"format": 1, "requested": 5, "layers": [0, 1]})
    assert name.parent == Path("/r") and len(name.name) == 16


@pytest.mark.parametrize("batch", [1, 2])
def test_an_interrupted_batched_layer_cache_resumes_to_the_uninterrupted_arrays(env, tmp_path, batch):
    """Ctrl-C while the 6th document is read (progress saved after every forward): progress.json holds the whole
    forwards done (5 documents one a forward, 4 two a forward), the next build runs only the rest in forwards of
    `batch` and ends with the arrays, bit for bit, and the meta of one uninterrupted build (found by mutating
    hidden_cache.py: `len(group) == batch` -> `!=` put every document into one forward at the end and saved no
    progress, yet passed test_an_interrupted_hidden_cache_build_continues, whose resume had one document left)."""
    import json

    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (12, 7, 15, 9, 11, 6, 14, 10)]
    budget, layers = sum(map(len, docs)) - 4, (1, 0)  # the last document cut to 6
    whole = hidden_cache.build(env["target"], iter(docs), tmp_path / "a", budget, {"t": 1}, progress=False,
                               layers=layers, batch=batch)
    assert whole.meta["documents"] == 8 and len(whole) == budget

    def stops_at_the_sixth():
        yield from docs[:5]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        hidden_cache.build(env["target"], stops_at_the_sixth(), tmp_path / "b", budget, {"t": 1}, progress=False,
                           layers=layers, batch=batch, save_every=0)
    k = 5 if batch == 1 else 4
    assert json.loads((tmp_path / "b" / "progress.json").read_text()) == {"tokens": sum(map(len, docs[:k])),
                                                                           "documents": k}
    calls = []

    class Counting:  # the target, recording the batch and width of each forward
        cfg = env["target"].cfg
        new_cache = env["target"].new_cache

        def __call__(self, tokens, *a, **kw):
            calls.append(tuple(tokens.shape))
            return env["target"](tokens, *a, **kw)

    rest = hidden_cache.build(Counting(), iter(docs), tmp_path / "b", budget, {"t": 1}, progress=False,
                              layers=layers, batch=batch)
    widths = [len(d) for d in docs[k:-1]] + [6]
    assert calls == ([(1, w) for w in widths] if batch == 1 else [(2, max(widths[:2])), (2, max(widths[2:]))])
    assert rest.meta == whole.meta and not (tmp_path / "b" / "progress.json").exists()
    for a in hidden_cache.arrays(layers):
        assert np.array_equal(getattr(rest, a), getattr(whole, a)), a
    assert rest.doc.tolist() == sum(([i] * len(d) for i, d in enumerate(docs[:-1])), []) + [7] * 6
