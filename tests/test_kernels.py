"""The bf16 skinny-GEMM kernel: against a float64 reference, bit-exact order invariance, the build and the
torch fallback, and a tiny bf16 model whose greedy speculative decoding equals plain decoding."""

import logging

import pytest
import torch

from specdec.adaptive import FixedK
from specdec.decode import Request, decode
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.runtime import kernels
from specdec.errors import SpecdecError
from specdec.runtime.loader import cpu_has_bf16_matmul, load_transformer, matmul_path, resolve_dtype
from specdec.runtime.model import Linear
from specdec.tokenizer import Tokenizer
from tests.tiny import VOCAB, save_tiny

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"kernel unavailable: {kernels.reason()}")

SHAPES = [(1, 1), (7, 5), (13, 8), (77, 45), (64, 64), (100, 129), (257, 576), (1000, 17), (33, 1536)]
ZEN5 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
SPR = ZEN5 | {"amx_bf16", "amx_tile", "amx_int8"}


@pytest.fixture(params=[p for p in kernels.PATHS if p != "torch"])
def path(request):
    """Each of the kernel's paths; one this machine cannot run skips with the reason."""
    why = kernels.unavailable(request.param)
    if why:
        pytest.skip(f"{request.param}: {why}")
    return request.param


def case(out_f, in_f, n, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed + 1000 * out_f + in_f)
    w = torch.randn(out_f, in_f, generator=g).to(torch.bfloat16)
    x = torch.randn(n, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    return x, w, b


def reference(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def as_multiplied(x, path):
    """x as `path` multiplies it: AVX512-BF16 rounds each activation to bf16 (nearest even), AVX2 keeps fp32."""
    return x.to(torch.bfloat16).float() if path in ("avx512bf16", "amx") else x


@pytest.mark.parametrize("out_f,in_f", SHAPES)
def test_matches_float64_reference(out_f, in_f, path):
    for n in range(1, 21):
        for bias in (True, False):
            x, w, b = case(out_f, in_f, n, seed=n, bias=bias)
            y = kernels.linear_bf16(x, w, b, path=path)
            assert y.shape == (n, out_f) and y.dtype == torch.float32
            scale = 1 + (x.double().abs() @ w.double().abs().t()).max().item()
            # fp32 accumulation of in_f products of magnitude ~|x||w|, of x as the path rounds it
            err = (y.double() - reference(as_multiplied(x, path), w, b)).abs().max().item()
            assert err <= 1e-5 * scale, (out_f, in_f, n, bias)
            # and close to the unrounded product (bf16 activations: a relative 2^-9 each)
            assert (y.double() - reference(x, w, b)).abs().max().item() <= 2 ** -8 * scale


@pytest.mark.parametrize("out_f,in_f", SHAPES)
def test_order_invariant_bit_exact(out_f, in_f, path):
    """y[i] over n rows == the single-row call on row i, whatever n (past the 15- and 16-row chunks), row
    order and thread count."""
    x, w, b = case(out_f, in_f, 40)
    singles = torch.cat([kernels.linear_bf16(x[i:i + 1], w, b, threads=1, path=path) for i in range(40)])
    for n in [*range(1, 21), 31, 32, 33, 40]:
        for threads in (1, 2, 3):
            assert torch.equal(kernels.linear_bf16(x[:n], w, b, threads=threads, path=path), singles[:n]), (n, threads)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    assert torch.equal(kernels.linear_bf16(x[perm], w, b, path=path), singles[perm])
    xs = x.repeat(3, 1)  # a large n goes through the kernel 15 or 16 rows at a time: still bit-identical
    assert torch.equal(kernels.linear_bf16(xs, w, b, path=path), singles.repeat(3, 1))
    assert torch.equal(kernels.linear_bf16(x[:5], w, None, path=path),
                       torch.cat([kernels.linear_bf16(x[i:i + 1], w, None, path=path) for i in range(5)]))


@pytest.mark.parametrize("flags, want", [
    (SPR, "amx"),                                           # Sapphire / Emerald Rapids
    (SPR - {"amx_tile"}, "avx512bf16"),                     # (a hypervisor that hides the tiles)
    (ZEN5, "avx512bf16"),                                   # Zen 4 / 5
    (ZEN5 - {"avx512_bf16"}, "avx2"),                       # Skylake-X, Ice Lake: AVX512 without BF16
    ({"avx2", "fma", "f16c"}, "avx2"),                      # Zen 2 / 3, Haswell on
    ({"avx2", "f16c"}, "torch"),                            # no FMA
    ({"fp", "asimd", "bf16"}, "torch"),                     # ARM
    (set(), "torch"),                                       # no /proc/cpuinfo
])
def test_path_choice_from_cpu_flags(flags, want):
    assert kernels.choose_path(frozenset(flags)) == want


def test_forced_path(monkeypatch):
    assert kernels.choose_path(ZEN5, "avx2") == "avx2" and kernels.choose_path(ZEN5, "torch") == "torch"
    with pytest.raises(SpecdecError, match="lacks avx512_bf16; choose one of avx2, torch"):
        kernels.choose_path(ZEN5 - {"avx512_bf16"}, "avx512bf16")
    with pytest.raises(SpecdecError, match="lacks amx_bf16, amx_tile; choose one of avx512bf16, avx2, torch"):
        kernels.choose_path(ZEN5, "amx")
    assert kernels.choose_path(SPR, "avx512bf16") == "avx512bf16"
    with pytest.raises(SpecdecError, match="unknown matmul path"):
        kernels.choose_path(ZEN5, "amx512")
    monkeypatch.setenv("SPECDEC_MATMUL", "torch")
    assert kernels.matmul_path() == "torch" and not kernels.available()


def test_a_path_the_library_refuses_falls_to_the_next(monkeypatch):
    """A CPU whose flags list AMX on a Linux that refuses the tile registers (before 5.16), or a hypervisor that
    lists what it does not run: the next path the flags allow and the library runs, not straight to avx2."""
    class Lib:
        def __init__(self, runs):
            self.runs = runs

        def skinny_supported(self, isa):
            return int(isa in self.runs)

    class Kernel:
        state, reason = True, ""

        def __init__(self, runs):
            self.lib = Lib(runs)

        def get(self):
            return self.lib

    monkeypatch.delenv("SPECDEC_MATMUL", raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(SPR))
    for runs, want in [({1, 2, 3}, "amx"), ({1, 2}, "avx512bf16"), ({1}, "avx2"), (set(), "torch")]:
        monkeypatch.setattr(kernels, "_kernel", Kernel(runs))
        assert kernels.matmul_path() == want, runs


def test_a_model_keeps_the_path_it_was_loaded_with(monkeypatch, tiny_folder, path):
    monkeypatch.setenv("SPECDEC_MATMUL", path)
    model = load_transformer(tiny_folder, torch.bfloat16)
    assert matmul_path(model) == path and model.row_exact
    assert {m.path for m in model.modules() if isinstance(m, Linear)} == {path}
    monkeypatch.setenv("SPECDEC_MATMUL", "torch")  # later loads change, this model does not
    assert matmul_path(model) == path
    torch_model = load_transformer(tiny_folder, torch.bfloat16)
    assert matmul_path(torch_model) == "torch" and not torch_model.row_exact


def test_packed_layout_round_trip_and_same_bits(path):
    """The AVX512-BF16 and AMX paths' layout (`pack_bf16`): element [g, p, j, t] is W[16 g + j, 2 p + t], zero-padded to
    whole groups and pairs; unpacking gives W back; a packed weight and its [out, in] matrix give the same bits
    on every path (each converts to the layout its path takes)."""
    w = torch.randn(37, 45).to(torch.bfloat16)
    packed = kernels.pack_bf16(w)
    assert packed.shape == (3, 23, 16, 2) and packed[1, 4, 3, 1] == w[19, 9]
    assert packed[2, :, 5:].eq(0).all() and packed[:, 22, :, 1].eq(0).all()  # padding: outputs 37.., input 45
    assert torch.equal(kernels.unpack_bf16(packed, 37, 45), w)
    x, b = torch.randn(6, 45), torch.randn(37)
    assert torch.equal(kernels.linear_bf16(x, packed, b, path=path, out_features=37), kernels.linear_bf16(x, w, b, path=path))
    with pytest.raises(ValueError):
        kernels.linear_bf16(torch.randn(2, 47), packed, path=path)


@pytest.mark.parametrize("packing", ["avx512bf16", "amx"])
def test_a_model_on_a_packing_path_holds_its_weights_packed_once(tmp_path, monkeypatch, packing):
    """Loaded for "avx512bf16" or "amx", each projection's weight is the packed layout in place of the matrix (4-D,
    so nothing reads it as [out, in]); a tied table is packed once, shared by the LM head, and the embedding
    gathers the same rows from it as from the matrix."""
    if kernels.unavailable(packing):
        pytest.skip(f"{packing}: {kernels.unavailable(packing)}")
    assert kernels.packs(packing) and not kernels.packs("avx2")
    ids = torch.tensor([[0, 5, 17, VOCAB - 1]])
    for arch, tied in (("llama", False), ("qwen2", True)):
        folder = save_tiny(arch, tmp_path / arch)
        monkeypatch.setenv("SPECDEC_MATMUL", "avx2")
        plain = load_transformer(folder, torch.bfloat16)
        monkeypatch.setenv("SPECDEC_MATMUL", packing)
        model = load_transformer(folder, torch.bfloat16)
        assert model.layers[0].qkv.weight.dim() == 4 and model.lm_head.weight.dim() == 4
        assert (model.lm_head.weight is model.embed.weight) == tied and model.embed.weight.dim() == (4 if tied else 2)
        assert torch.equal(model.embed(ids), plain.embed(ids)) and torch.equal(model.embed.table(), plain.embed.weight)
        assert torch.equal(model.lm_head.matrix(), plain.lm_head.weight)
        for bad in (-1, VOCAB):  # as nn.Embedding: an id outside the vocabulary fails, packed or not
            with pytest.raises(IndexError):
                model.embed(torch.tensor([[bad]]))


def test_a_packed_table_refuses_the_ids_its_padding_rows_would_answer():
    """A packed table pads the vocabulary to whole groups of 16 rows: 100 ids hold 112 rows, so ids 100..111 index
    zeros without a word from torch. The lookup refuses them (and negatives) as nn.Embedding does, and gives
    the table's rows for the ids it holds. Pure torch: runs on any CPU."""
    from specdec.runtime.model import Embedding

    emb = Embedding(100, 6).to(torch.bfloat16)
    rows = emb.weight.detach().clone()
    emb.pack()
    assert emb.weight.shape[0] * 16 == 112
    ids = torch.tensor([[0, 15, 16, 99]])
    assert torch.equal(emb(ids), rows[ids]) and torch.equal(emb.table(), rows)
    for bad in (-1, 100, 111):
        with pytest.raises(IndexError, match="outside the vocabulary 0..99"):
            emb(torch.tensor([[3, bad]]))
    assert emb(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, 6)  # no ids: nothing to check


@needs_kernel
def test_leading_dims_and_noncontiguous_input():
    x, w, b = case(40, 24, 6)
    x3 = x.reshape(2, 3, 24)
    y = kernels.linear_bf16(x3, w, b)
    assert y.shape == (2, 3, 40) and torch.equal(y.reshape(6, 40), kernels.linear_bf16(x, w, b))
    xt = torch.randn(24, 5).t()  # not contiguous
    assert torch.equal(kernels.linear_bf16(xt, w), kernels.linear_bf16(xt.contiguous(), w))
    assert kernels.linear_bf16(torch.zeros(0, 24), w).shape == (0, 40)
    with pytest.raises(ValueError):
        kernels.linear_bf16(torch.zeros(2, 23), w)


def test_disabled_falls_back_to_torch(monkeypatch, tiny_folder):
    monkeypatch.setenv("SPECDEC_KERNEL", "0")
    assert not kernels.available() and "SPECDEC_KERNEL" in kernels.reason()
    x, w, b = case(77, 45, 5)
    assert torch.allclose(kernels.linear_bf16(x, w, b), reference(x, w, b).float(), atol=1e-4)
    assert resolve_dtype("auto") == (torch.bfloat16 if cpu_has_bf16_matmul() else torch.float32)
    model = load_transformer(tiny_folder, torch.bfloat16)  # today's bf16: every tensor in bf16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and not model.row_exact
    fp32 = load_transformer(tiny_folder, torch.float32)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    a = fp32(ids, fp32.new_cache(32)).logits
    out = model(ids, model.new_cache(32)).logits
    assert out.dtype == torch.float32 and (a - out).abs().max() < 0.1 * a.abs().max()


def test_failed_build_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels, "_kernel", kernels.Library(kernels.SOURCE, kernels.CFLAGS, kernels._declare, "unavailable; torch",
                                                             needs_avx2=True))
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.kernels"):
        assert not kernels.available()
        assert not kernels.available()
        x, w, b = case(13, 8, 3)
        assert torch.allclose(kernels.linear_bf16(x, w, b), reference(x, w, b).float(), atol=1e-4)
    if kernels.cpu_supported():
        assert "no-such-compiler" in kernels.reason()
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1


@needs_kernel
def test_build_is_cached_and_atomic(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_kernel", kernels.Library(kernels.SOURCE, kernels.CFLAGS, kernels._declare, "unavailable; torch",
                                                             needs_avx2=True))
    assert kernels.available()
    path = kernels.library_path()
    assert path.parent == tmp_path / "kernels" and path.exists()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left behind
    x, w, b = case(33, 20, 4)
    want = reference(as_multiplied(x, kernels.matmul_path()), w, b).float()
    assert torch.allclose(kernels.linear_bf16(x, w, b), want, atol=1e-4)


def test_a_local_header_is_part_of_the_librarys_name(tmp_path):
    """ops.c and attention.c include vexp.h: a changed header must build new libraries, not load old ones."""
    (tmp_path / "k.c").write_text('#include <math.h>\n#include "h.h"\nint f(void) { return H; }\n')
    (tmp_path / "h.h").write_text("#define H 1\n")
    before = kernels.library_path(tmp_path / "k.c", ["-O2"])
    (tmp_path / "h.h").write_text("#define H 2\n")
    assert kernels.library_path(tmp_path / "k.c", ["-O2"]) != before


# --- a tiny model in bf16 on the kernel ------------------------------------------------------------

def test_model_layout_and_whole_forward_bit_exact(tiny_folder, path, monkeypatch):
    monkeypatch.setenv("SPECDEC_MATMUL", path)
    model = load_transformer(tiny_folder, torch.bfloat16)
    assert model.row_exact and model.dtype == torch.bfloat16 and model.compute_dtype == torch.float32
    for name, p in model.named_parameters():
        want = torch.bfloat16 if name.endswith(("qkv.weight", "o.weight", "gate_up.weight", "down.weight",
                                                "lm_head.weight", "embed.weight")) else torch.float32
        assert p.dtype == want, name
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(64)
    assert cache.k[0].dtype == torch.float16  # the exact CPU path's KV cache (`--kv-dtype auto`)
    model(ids[:, :8], cache)  # prefill
    chain = model(ids[:, 8:], cache).logits  # a 16-position chain after a context
    cache = model.new_cache(64)
    model(ids[:, :8], cache)
    singles = torch.cat([model(ids[:, i:i + 1], cache).logits for i in range(8, 24)], 1)
    assert torch.equal(chain, singles)


@pytest.fixture(scope="module", params=[p for p in kernels.PATHS if p != "torch"])
def bf16_env(tmp_path_factory, request):
    why = kernels.unavailable(request.param)
    if why:
        pytest.skip(f"{request.param}: {why}")
    target_dir = save_tiny("llama", tmp_path_factory.mktemp("target"), seed=0)
    draft_dir = save_tiny("llama", tmp_path_factory.mktemp("draft"), seed=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_MATMUL", request.param)
        env = dict(target=load_transformer(target_dir, torch.bfloat16), tok=Tokenizer(target_dir),
                   draft=load_transformer(draft_dir, torch.bfloat16))
    assert matmul_path(env["target"]) == request.param
    return env


PROMPTS = ["def add(a, b): return a + b. def add(a, b): return", "the cat sat on the mat. the cat", "xyz"]


@pytest.mark.parametrize("k", [1, 4, 8])
def test_bf16_greedy_speculation_equals_plain(bf16_env, k):
    env = bf16_env

    def run(ids, drafter=None, policy=None):
        return list(decode(env["target"], env["tok"], ids, Request(max_new_tokens=40), drafter, policy))[-1].result

    for text in PROMPTS:
        ids = env["tok"].encode(text, chat=False)
        plain = run(ids)
        for drafter in (PromptLookup(), DraftModel(env["draft"], VOCAB, VOCAB)):
            spec = run(ids, drafter, FixedK(k))
            assert spec.token_ids == plain.token_ids and spec.text == plain.text
            assert spec.target_forwards <= plain.target_forwards
