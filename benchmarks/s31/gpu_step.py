"""Session 31: where a GPU step's time goes. A SmolLM2-135M-shaped Llama with random weights (timing needs the
shapes, not the weights), bf16 on DEVICE: our forward per step, eager (SPECDEC_CUDA_GRAPHS=0) and replaying CUDA
graphs, against transformers' generate (plain greedy, 128 new tokens forced); one forward over n positions; and
torch's profiler over five of our eager steps."""
import os, statistics, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from specdec.runtime.loader import load_transformer

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
small = len(sys.argv) > 2
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=4 if small else 30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                  rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
hf = LlamaForCausalLM(cfg).eval()
hf.save_pretrained("/tmp/rand")
sync = (lambda: torch.cuda.synchronize()) if dev.startswith("cuda") else (lambda: None)
ours = load_transformer("/tmp/rand", torch.bfloat16, dev)
prompt = torch.randint(3, 49152, (1, 32))

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
    x = torch.randint(3, 49152, (1, n)); ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); ours(x, cache); ts.append(time.perf_counter() - t0); cache.rewind(n)
    return statistics.median(ts)

hfm = hf.to(dev, torch.bfloat16)
def hf_run(new=128):
    x = prompt.to(dev)
    with torch.inference_mode():
        t0 = time.perf_counter()
        hfm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                     pad_token_id=2)
        sync()
    return (time.perf_counter() - t0) / new

def mode(graphs):
    os.environ["SPECDEC_CUDA_GRAPHS"] = "1" if graphs else "0"

t0 = time.perf_counter(); mode(True); first = our_run()  # a fresh pool: the first request captures its graph
print(f"graphs, first request (captures width 1): {first * 1e3:.2f} ms per token")
mode(False); our_run(8); hf_run(8)
rows = []
for rep in range(3):
    mode(False); eager = our_run()
    mode(True); graphed = our_run()
    rows.append((eager, graphed, hf_run()))
for a, g, b in rows:
    print(f"ms per token: ours eager {a * 1e3:.2f}, ours graphs {g * 1e3:.2f}, HF generate {b * 1e3:.2f}; "
          f"graphs / eager speedup {a / g:.2f}, HF / ours graphs {b / g:.2f}")
for graphs in (False, True):
    mode(graphs)
    print(f"ours {'graphs' if graphs else 'eager'}, one forward: "
          + ", ".join(f"n={n} {our_width(n) * 1e3:.2f} ms" for n in (1, 2, 4, 8, 16, 32, 64)))
mode(False)
from torch.profiler import ProfilerActivity, profile
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
cache = ours.new_cache(512); ours.prefill(prompt[0].tolist(), cache)
with profile(activities=acts) as prof:
    for _ in range(5):
        ours(torch.tensor([[5]]), cache)
ev = prof.key_averages()
print(f"5 steps: {sum(e.count for e in ev if e.key.startswith('aten::'))} aten calls, "
      f"{sum(e.count for e in ev if e.key in ('cudaLaunchKernel', 'cuLaunchKernel', 'cudaLaunchKernelExC'))} kernel launches")
print(ev.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))
