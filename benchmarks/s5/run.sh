#!/bin/bash
# Session 5 benchmarks: run on a quiet machine, sequentially. Usage: bash bench5.sh (from the repo root)
set -x
export PATH=/work/main/.venv/bin:$PATH
O=benchmarks/s5; mkdir -p $O
lscpu > $O/lscpu.txt
specdec probe --model qwen2.5-coder-1.5b --dtype q4 > $O/probe-qwen1.5b-q4.txt 2>&1
specdec probe --model smollm2-135m --dtype q4 > $O/probe-smollm2-q4.txt 2>&1
specdec probe --model smollm2-135m --dtype bf16 > $O/probe-smollm2-bf16.txt 2>&1
specdec probe --model qwen2.5-coder-1.5b --dtype bf16 > $O/probe-qwen1.5b-bf16.txt 2>&1
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,lookahead,hybrid --draft qwen2.5-coder-0.5b --prompts humanevalfix --limit 3 --max-new-tokens 128 --compare-llamacpp --no-progress --out $O/qwen1.5b-humanevalfix-q4 > $O/qwen1.5b-humanevalfix-q4.log 2>&1
specdec bench --model smollm2-135m --methods plain,prompt-lookup,medusa,eagle --prompts spec-bench --limit 1 --max-new-tokens 128 --no-progress --out $O/smollm2-specbench-eagle > $O/smollm2-specbench-eagle.log 2>&1
specdec bench --model smollm2-135m --methods plain,eagle --tree chain --prompts spec-bench --limit 1 --max-new-tokens 128 --no-progress --out $O/smollm2-specbench-eagle-chain > $O/smollm2-specbench-eagle-chain.log 2>&1
specdec bench --model smollm2-135m --methods plain,prompt-lookup,medusa,eagle --prompts humanevalfix --limit 5 --max-new-tokens 128 --no-progress --out $O/smollm2-humanevalfix-eagle > $O/smollm2-humanevalfix-eagle.log 2>&1
specdec bench --model smollm2-135m --methods plain,prompt-lookup,medusa,eagle --prompts spec-bench --limit 1 --max-new-tokens 128 --temperature 0.7 --no-progress --out $O/smollm2-specbench-eagle-t07 > $O/smollm2-specbench-eagle-t07.log 2>&1
specdec bench --model qwen2.5-coder-1.5b --dtype bf16 --methods plain,prompt-lookup,lookahead --prompts humanevalfix --limit 3 --max-new-tokens 128 --compare-hf --no-progress --out $O/qwen1.5b-humanevalfix-bf16 > $O/qwen1.5b-humanevalfix-bf16.log 2>&1
echo done
