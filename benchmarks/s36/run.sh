#!/usr/bin/env bash
# Session 36 (AMD EPYC Zen 4, family 25 model 17, AVX512-VNNI/BF16, no AMX), run one at a time with nothing else on
# the machine, from the repository root.
set -euo pipefail
B=benchmarks/s36
lscpu > $B/lscpu.txt
# the mission's comparison after session 34's q4 layout (fp16 scales beside the blocks): the 1.5B's own Q4_K_M file,
# our methods against llama.cpp (llama-cpp-python 0.3.36 built natively) and transformers' generate, one run each
M=plain,prompt-lookup,lookahead,recycling
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods $M --prompts humanevalfix --limit 5 \
    --max-new-tokens 128 --compare-llamacpp --compare-hf --no-progress --out $B/qwen1.5b-humanevalfix-q4
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods $M --prompts spec-bench --limit 1 \
    --max-new-tokens 64 --compare-llamacpp --compare-hf --no-progress --out $B/qwen1.5b-specbench-q4
# #13 at one and two SmolLM2 clients after session 35's fix (a tree round's acceptance by depth): session 34's command
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --method recycling --prompts humanevalfix \
    --concurrency 1,2 --waves 2 --repeat 6 --max-tokens 64 --out $B/serve-smollm2-recycling
