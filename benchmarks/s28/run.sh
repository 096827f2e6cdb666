#!/bin/bash
# Session 28 (AMD EPYC Zen 4, family 25 model 17; lscpu.txt): the commands behind BENCHMARKS.md "Session 28",
# one at a time with nothing else running.
set -e
B=benchmarks/s28
lscpu > $B/lscpu.txt
# the engine thread with and without the main thread's OpenMP pool released (SmolLM2 q4, never, alternating)
benchmarks/s28/release_ab.sh | tee $B/release-ab.txt
# #13 with a drafter that pays on code edits: token recycling, HumanEvalFix dev, the three modes interleaved
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --method recycling --prompts humanevalfix \
    --concurrency 1,2,4,8,16 --waves 2 --repeat 6 --max-tokens 64 --out $B/serve-smollm2-recycling
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --method recycling \
    --prompts humanevalfix --concurrency 1,4,16 --waves 2 --repeat 6 --max-tokens 32 --timeout 900 \
    --out $B/serve-qwen1.5b-recycling
# the 1.5B's two other levels, the same command
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --method recycling \
    --prompts humanevalfix --concurrency 2,8 --waves 2 --repeat 6 --max-tokens 32 --timeout 900 \
    --out $B/serve-qwen1.5b-recycling-2-8
