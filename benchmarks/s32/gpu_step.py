"""Session 32: our step on a GPU for Qwen2.5-Coder-1.5B's shapes (random weights: timing needs the shapes, not the
weights; the GGUF is too big for the device tool), bf16, eager (SPECDEC_CUDA_GRAPHS=0) and replaying CUDA graphs,
against transformers' generate (plain greedy, 128 new tokens forced), and one forward over n positions, each timing
waiting for the GPU (session 31's script timed widths without waiting).

    python benchmarks/s32/gpu_step.py cuda [smollm2|qwen1.5b]
"""
import os, statistics, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from specdec.runtime.loader import load_transformer

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
shape = sys.argv[2] if len(sys.argv) > 2 else "qwen1.5b"
if shape == "qwen1.5b":
    cfg = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    cls = Qwen2ForCausalLM
else:
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    cls = LlamaForCausalLM
V = cfg.vocab_size
torch.manual_seed(0)
t0 = time.perf_counter()
hf = cls(cfg).to(torch.bfloat16).eval()
hf.save_pretrained("/tmp/rand")
print(f"{shape}: random model made and saved in {time.perf_counter() - t0:.1f} s", flush=True)
sync = (lambda: torch.cuda.synchronize()) if dev.startswith("cuda") else (lambda: None)
ours = load_transformer("/tmp/rand", torch.bfloat16, dev)
prompt = torch.randint(3, V - 10, (1, 32))


def our_run(new=128):
    cache = ours.new_cache(512)
    out = ours.prefill(prompt[0].tolist(), cache)
    t = int(out.logits[0, -1].argmax())
    t0 = time.perf_counter()
    for _ in range(new):
        t = int(ours(torch.tensor([[t]]), cache).logits[0, -1].argmax())
    return (time.perf_counter() - t0) / new


def our_width(n, reps=20):
    cache = ours.new_cache(512)
    ours.prefill(prompt[0].tolist(), cache)
    x = torch.randint(3, V - 10, (1, n))
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        ours(x, cache)
        sync()
        ts.append(time.perf_counter() - t0)
        cache.rewind(n)
    return statistics.median(ts)


hfm = hf.to(dev)


def hf_run(new=128):
    x = prompt.to(dev)
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        hfm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                     pad_token_id=cfg.eos_token_id)
        sync()
    return (time.perf_counter() - t0) / new


def mode(graphs):
    os.environ["SPECDEC_CUDA_GRAPHS"] = "1" if graphs else "0"


mode(True)
first = our_run()  # a fresh pool: the first request captures its graph
print(f"graphs, first request (captures width 1): {first * 1e3:.2f} ms per token", flush=True)
mode(False); our_run(8); hf_run(8)
for rep in range(3):
    mode(False); a = our_run()
    mode(True); g = our_run()
    b = hf_run()
    print(f"ms per token: ours eager {a * 1e3:.2f}, ours graphs {g * 1e3:.2f}, HF generate {b * 1e3:.2f}; "
          f"graphs / eager speedup {a / g:.2f}, HF / ours graphs {b / g:.2f}", flush=True)
for graphs in (False, True):
    mode(graphs)
    widths = {n: our_width(n) for n in (1, 2, 3, 4, 8, 16, 32, 64)}
    print(f"ours {'graphs' if graphs else 'eager'}, one forward: "
          + ", ".join(f"n={n} {t * 1e3:.2f} ms ({t / widths[1]:.2f})" for n, t in widths.items()), flush=True)
