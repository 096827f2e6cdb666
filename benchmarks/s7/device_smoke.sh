#!/bin/bash
# First device call of session 7: keep the GGUF's first half in /tmp/w for the second call, and run the whole
# GPU training path (regeneration, batched cache, training, evaluation, saving) on a tiny random model.
set -e
mkdir -p /tmp/w && cp .dev/a/smollm2.gguf.a /tmp/w/
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/smoke
python3 - <<'PY'
import json, time, torch
from pathlib import Path
from tests.tiny import save_tiny
from specdec.cli import main
from specdec.runtime.loader import load_transformer
from specdec.training.regenerate import greedy_batch
t = time.time()
print("torch", torch.__version__, torch.cuda.get_device_name())
folder = save_tiny("llama", Path("/tmp/smoke/tiny"), seed=3)
cpu, gpu = load_transformer(folder), load_transformer(folder, torch.float32, "cuda")
prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
a, b = greedy_batch(cpu, prompts, 20, {2}), greedy_batch(gpu, prompts, 20, {2})
print("greedy_batch cpu == cuda fp32:", a == b)
data = Path("/tmp/smoke/c.jsonl")
data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"count {i}"}]}) for i in range(40)))
rc = main(["train", "eagle", "--model", str(folder), "--device", "cuda", "--regenerate", "--data", str(data),
           "--tokens", "2000", "--epochs", "2", "--draft-vocab", "30", "--batch-tokens", "256", "--max-len", "60",
           "--out", "/tmp/smoke/e", "--quiet"])
print("train rc", rc, f"{time.time() - t:.1f} s")
PY
