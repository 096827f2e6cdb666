"""llama.cpp's own decode step on a GGUF, outside `specdec bench` (no prefill, no Python sampling per token):
`Llama.eval` of one token after a 140-token prompt, median of 64, three times; then `Llama.generate` with the prompt
kept. Run: python benchmarks/s34/llamacpp_step.py ~/.cache/specdec/gguf/smollm2-135m.gguf
(the GGUF `specdec bench --compare-llamacpp` fetched; llama-cpp-python 0.3.36, CMAKE_ARGS="-DGGML_NATIVE=ON")."""
import sys, time, statistics
from llama_cpp import Llama
m = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
ids = m.tokenize(b"def fibonacci(n):\n    " * 20)[:256]
for trial in range(3):
    m.reset(); m.eval(ids)
    ts = []
    for i in range(64):
        t = time.perf_counter(); m.eval([ids[i % 50]]); ts.append(time.perf_counter() - t)
    print(f"eval one token: median {statistics.median(ts)*1e3:.2f} ms")
m.reset(); m.eval(ids)
t = time.perf_counter(); n = 0
for tok in m.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
    n += 1
    if n >= 128: break
print(f"generate: {n / (time.perf_counter() - t):.1f} tok/s (prefill of {len(ids)} included, the prefix kept)")
