#!/bin/bash
# Session 6 benchmarks: run on a quiet machine, sequentially, from the repository root: bash benchmarks/s6/run.sh
set -x
export PATH=/work/main/.venv/bin:$PATH
O=benchmarks/s6; mkdir -p $O
lscpu > $O/lscpu.txt
specdec probe --model qwen2.5-coder-1.5b --dtype q4 > $O/probe-qwen1.5b-q4.txt 2>&1
specdec probe --model smollm2-135m --dtype q4 > $O/probe-smollm2-q4.txt 2>&1
specdec probe --model smollm2-135m --dtype bf16 > $O/probe-smollm2-bf16.txt 2>&1
specdec probe --model qwen2.5-coder-1.5b --dtype bf16 > $O/probe-qwen1.5b-bf16.txt 2>&1
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,lookahead,hybrid,medusa --draft qwen2.5-coder-0.5b --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-llamacpp --no-progress --out $O/qwen1.5b-humanevalfix-q4 > $O/qwen1.5b-humanevalfix-q4.log 2>&1
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,lookahead --prompts spec-bench --limit 1 --max-new-tokens 64 --compare-llamacpp --no-progress --out $O/qwen1.5b-specbench-q4 > $O/qwen1.5b-specbench-q4.log 2>&1
specdec bench --model qwen2.5-coder-1.5b --dtype bf16 --methods plain,prompt-lookup --prompts humanevalfix --limit 3 --max-new-tokens 128 --compare-hf --no-progress --out $O/qwen1.5b-humanevalfix-bf16 > $O/qwen1.5b-humanevalfix-bf16.log 2>&1
# (run first, on its own: specdec bench --model smollm2-135m --methods plain,prompt-lookup,medusa,eagle --prompts spec-bench --limit 1 --max-new-tokens 128 --out $O/smollm2-specbench-eagle)
echo done
# the server, three modes interleaved per level
specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --requests 16 --max-tokens 64 --prompts spec-bench --out $O/serve-smollm2 > $O/serve-smollm2.log 2>&1
specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4,8,16 --requests 8 --max-tokens 48 --prompts humanevalfix --timeout 600 --out $O/serve-qwen1.5b > $O/serve-qwen1.5b.log 2>&1
