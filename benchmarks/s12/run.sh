#!/usr/bin/env bash
# Session 12 (Intel Xeon, family 6 model 207, AMX-BF16/AMX-INT8, 2 vCPU): every timing of BENCHMARKS.md "Session 12",
# run one after the other with nothing else on the machine. From the repository root.
set -euo pipefail
B=benchmarks/s12
lscpu > $B/lscpu.txt
# the bf16 paths, one matmul shape set at a time (weights from memory), same source twice
.venv/bin/python benchmarks/kernel/kernel_ab.py specdec/runtime/kernels/skinny.c specdec/runtime/kernels/skinny.c \
    --path avx512bf16 --path-b amx --model smollm2-135m --n 1,2,4,8,16,32,64 --reps 9 > $B/ab-smollm2.txt
.venv/bin/python benchmarks/kernel/kernel_ab.py specdec/runtime/kernels/skinny.c specdec/runtime/kernels/skinny.c \
    --path avx512bf16 --path-b amx --model qwen2.5-coder-1.5b --layers 8 --n 1,4,8,16,32,64 --reps 5 > $B/ab-qwen1.5b.txt
# the probe: every bf16 path's curve, budget and prefill; q4 for reference
.venv/bin/specdec probe --model smollm2-135m --dtype bf16 > $B/probe-smollm2-bf16.txt
.venv/bin/specdec probe --model qwen2.5-coder-1.5b --dtype bf16 > $B/probe-qwen1.5b-bf16.txt
.venv/bin/specdec probe --model qwen2.5-coder-1.5b --dtype q4 > $B/probe-qwen1.5b-q4.txt
.venv/bin/specdec probe --model smollm2-135m --dtype q4 > $B/probe-smollm2-q4.txt
.venv/bin/specdec probe --model qwen2.5-coder-1.5b --dtype bf16 --paths used > $B/probe-qwen1.5b-bf16-amx-again.txt
# the methods with the new budget, against our plain decoding and transformers' generate, one run per model and set
.venv/bin/specdec bench --model smollm2-135m --dtype bf16 --methods plain,prompt-lookup,recycling,lookahead,medusa,eagle@chain,eagle@dynamic \
    --prompts spec-bench --limit 1 --compare-hf --no-progress --out $B/smollm2-specbench-bf16
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype bf16 --draft qwen2.5-coder-0.5b \
    --methods plain,prompt-lookup,recycling,lookahead,draft --prompts humanevalfix --limit 5 --compare-hf --no-progress \
    --out $B/qwen1.5b-humanevalfix-bf16
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --plain-dtypes bf16 --methods plain,prompt-lookup,recycling,lookahead \
    --prompts humanevalfix --limit 5 --no-progress --out $B/qwen1.5b-humanevalfix-q4
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype bf16 --methods plain,prompt-lookup,recycling,lookahead \
    --prompts spec-bench --limit 1 --max-new-tokens 64 --no-progress --out $B/qwen1.5b-specbench-bf16
.venv/bin/specdec bench --model smollm2-135m --dtype bf16 --methods plain,prompt-lookup,recycling,lookahead,medusa,eagle@chain,eagle@dynamic \
    --prompts humanevalfix --limit 5 --compare-hf --no-progress --out $B/smollm2-humanevalfix-bf16
