#!/bin/bash
# Session 7 benchmarks: run on a quiet machine, sequentially, from the repository root: bash benchmarks/s7/run.sh
# (the GPU training run itself: benchmarks/s7/device_smoke.sh, then device_train.sh, on a lent H200)
set -x
export PATH=$PWD/.venv/bin:$PATH
O=benchmarks/s7; mkdir -p $O
lscpu > $O/lscpu.txt
# the EAGLE head trained in session 6 on this CPU, for the old-against-new rows
OLD=/tmp/eagle-s6; mkdir -p $OLD
git show d3b6890:specdec/heads/smollm2-135m/eagle/config.json > $OLD/config.json
git show d3b6890:specdec/heads/smollm2-135m/eagle/model.safetensors > $OLD/model.safetensors
M=plain,prompt-lookup,medusa,eagle@chain,eagle@dynamic
specdec bench --model smollm2-135m --methods $M --prompts spec-bench --limit 1 --max-new-tokens 128 --no-progress --out $O/smollm2-specbench > $O/smollm2-specbench.log 2>&1
specdec bench --model smollm2-135m --methods $M --prompts spec-bench --limit 1 --max-new-tokens 128 --temperature 0.7 --no-progress --out $O/smollm2-specbench-t07 > $O/smollm2-specbench-t07.log 2>&1
specdec bench --model smollm2-135m --methods $M --prompts humanevalfix --limit 5 --max-new-tokens 128 --no-progress --out $O/smollm2-humanevalfix > $O/smollm2-humanevalfix.log 2>&1
specdec bench --model smollm2-135m --methods $M --prompts humanevalfix --limit 5 --max-new-tokens 128 --temperature 0.7 --no-progress --out $O/smollm2-humanevalfix-t07 > $O/smollm2-humanevalfix-t07.log 2>&1
specdec bench --model smollm2-135m --methods eagle@chain,eagle@dynamic --heads $OLD --prompts spec-bench --limit 1 --max-new-tokens 128 --no-progress --out $O/smollm2-specbench-oldhead > $O/smollm2-specbench-oldhead.log 2>&1
specdec bench --model smollm2-135m --methods eagle@chain,eagle@dynamic --k 4 --prompts spec-bench --limit 1 --max-new-tokens 128 --no-progress --out $O/smollm2-specbench-k4 > $O/smollm2-specbench-k4.log 2>&1
# α of the new head on Spec-Bench answers written by the target on this CPU (features fp32 and q4)
python - <<'PY'
import json
rows = [json.loads(l) for l in open("data/spec_bench/dev.jsonl")]
with open("/tmp/specbench-prompts.jsonl", "w") as f:
    f.writelines(json.dumps({"messages": [{"role": "user", "content": r["turns"][0]}]}) + "\n" for r in rows)
PY
python benchmarks/s7/eval_alpha.py /tmp/specbench-prompts.jsonl 0 6000 2>/dev/null > $O/eval_alpha_specbench.json
# the server, three modes interleaved per level
specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --requests 32 --max-tokens 64 --prompts spec-bench --out $O/serve-smollm2 > $O/serve-smollm2.log 2>&1
specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4,8,16 --requests 16 --max-tokens 48 --prompts humanevalfix --timeout 900 --out $O/serve-qwen1.5b > $O/serve-qwen1.5b.log 2>&1
echo done
