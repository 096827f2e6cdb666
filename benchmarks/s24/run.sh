#!/usr/bin/env bash
# Session 24 (Intel Xeon with AMX, family 6 model 167, as session 23), run one at a time with nothing else on the
# machine, from the repository root.
set -euo pipefail
B=benchmarks/s24
lscpu > $B/lscpu.txt
# #13: session 23's loadtest repeated with auto starting on never where the batch fills the budget line
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --waves 2 \
    --repeat 15 --max-tokens 64 --prompts spec-bench --out $B/serve-smollm2-w2r15
# the same after auto's buckets that start on never explore one step in 64 (commit dcb00bc)
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --waves 2 \
    --repeat 15 --max-tokens 64 --prompts spec-bench --out $B/serve-smollm2-w2r15-settled
