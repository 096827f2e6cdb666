#!/bin/bash
# Session 9 benchmarks (AMD Zen 4, 2 vCPU): after the fused layers (one C call per forward). Run on a quiet
# machine, sequentially, from the repository root: bash benchmarks/s9/run.sh
# Needs: specdec pull qwen2.5-coder-1.5b smollm2-135m; pip install -e '.[compare]'
set -x
export PATH=$PWD/.venv/bin:$PATH
O=benchmarks/s9; mkdir -p $O
lscpu > $O/lscpu.txt
# the probe: SmolLM2 bf16 (#16's 16-position aim) and q4, the 1.5B q4
for a in "smollm2-135m bf16" "smollm2-135m q4" "qwen2.5-coder-1.5b q4"; do
  set -- $a; specdec probe --model $1 --dtype $2 > $O/probe-$1-$2.txt 2>&1
done
# #14 in one run: our q4 (plain and speculation), our bf16 and q8 plain, transformers bf16, llama.cpp on the same file
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --plain-dtypes bf16,q8 --methods plain,prompt-lookup,lookahead \
  --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-hf --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-humanevalfix > $O/qwen1.5b-humanevalfix.log 2>&1
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,lookahead \
  --prompts spec-bench --limit 1 --max-new-tokens 64 --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-specbench > $O/qwen1.5b-specbench.log 2>&1
# SmolLM2: prompt lookup and EAGLE's chain, alone and as a hybrid, on the faster target step
specdec bench --model smollm2-135m --methods plain,prompt-lookup,eagle,hybrid --sources prompt-lookup,eagle \
  --prompts spec-bench --limit 1 --max-new-tokens 128 --no-progress --out $O/smollm2-specbench > $O/smollm2-specbench.log 2>&1
# the server, three modes interleaved per level
specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --requests 32 --max-tokens 64 \
  --prompts spec-bench --out $O/serve-smollm2 > $O/serve-smollm2.log 2>&1
echo done
# (after the probe's fixes, with its fresh curve cached) #14 again, the same command
for a in "smollm2-135m bf16" "smollm2-135m q4" "qwen2.5-coder-1.5b q4" "qwen2.5-coder-1.5b bf16"; do
  set -- $a; specdec probe --model $1 --dtype $2 > $O/probe-$1-$2.txt 2>&1
done
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --plain-dtypes bf16,q8 --methods plain,prompt-lookup,lookahead \
  --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-hf --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-humanevalfix-2 > $O/qwen1.5b-humanevalfix-2.log 2>&1
