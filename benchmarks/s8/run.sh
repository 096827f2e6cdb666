#!/bin/bash
# Session 8 benchmarks on an AMD Zen 4 (the CPU class issues #14 and #16 were filed on): run on a quiet machine,
# sequentially, from the repository root: bash benchmarks/s8/run.sh
# Needs: specdec pull qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m; pip install -e '.[compare]'
set -x
export PATH=$PWD/.venv/bin:$PATH
O=benchmarks/s8; mkdir -p $O
lscpu > $O/lscpu.txt
# the probe per path (bf16 measures every path this CPU has) and per quantized dtype
for m in qwen2.5-coder-1.5b smollm2-135m; do
  for d in bf16 q8 q4; do specdec probe --model $m --dtype $d > $O/probe-$m-$d.txt 2>&1; done
done
# #14 in one run: our q4 (plain and speculation), our bf16 and q8 plain, transformers bf16, llama.cpp on the same file
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --plain-dtypes bf16,q8 --methods plain,prompt-lookup,lookahead,hybrid \
  --draft qwen2.5-coder-0.5b --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-hf --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-humanevalfix > $O/qwen1.5b-humanevalfix.log 2>&1
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --plain-dtypes bf16 --methods plain,prompt-lookup,lookahead \
  --prompts spec-bench --limit 1 --max-new-tokens 64 --compare-hf --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-specbench > $O/qwen1.5b-specbench.log 2>&1
# SmolLM2: EAGLE's chain (auto on this budget) and prompt lookup, alone and as a hybrid
specdec bench --model smollm2-135m --methods plain,prompt-lookup,eagle,hybrid --sources prompt-lookup,eagle \
  --prompts spec-bench --limit 1 --max-new-tokens 128 --no-progress --out $O/smollm2-specbench > $O/smollm2-specbench.log 2>&1
# the server with the final arm picker, three modes interleaved per level
specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --requests 32 --max-tokens 64 \
  --prompts spec-bench --out $O/serve-smollm2 > $O/serve-smollm2.log 2>&1
specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4,8,16 --requests 16 \
  --max-tokens 48 --prompts humanevalfix --timeout 900 --out $O/serve-qwen1.5b > $O/serve-qwen1.5b.log 2>&1
echo done
# (added after the server could draft with EAGLE) the server's two drafters, the same 16 first turns, one run each
specdec loadtest --serve auto,always,never --method eagle --model smollm2-135m --concurrency 1,4 --requests 16 \
  --max-tokens 64 --prompts spec-bench --out $O/serve-smollm2-eagle > $O/serve-smollm2-eagle.log 2>&1
specdec loadtest --serve auto,always,never --method prompt-lookup --model smollm2-135m --concurrency 1,4 --requests 16 \
  --max-tokens 64 --prompts spec-bench --out $O/serve-smollm2-pl16 > $O/serve-smollm2-pl16.log 2>&1
# the SmolLM2 race again after the chain's logsumexp went (d5e1b43)
specdec bench --model smollm2-135m --methods plain,prompt-lookup,eagle,hybrid --sources prompt-lookup,eagle \
  --prompts spec-bench --limit 1 --max-new-tokens 128 --no-progress --out $O/smollm2-specbench-final > $O/smollm2-specbench-final.log 2>&1
