#!/usr/bin/env bash
# Session 23 (Intel Xeon with AMX, family 6 model 167), run one at a time with nothing else on the machine, from the
# repository root.
set -euo pipefail
B=benchmarks/s23
lscpu > $B/lscpu.txt
# the modes in one process at two requests, rounds alternating (session 22's script)
PYTHONPATH=. .venv/bin/python benchmarks/s22/modes_ab.py 2 6 12 model:0.2,model:0,always,auto,never | tee $B/modes-c2.txt
# #13: the server's three modes over HTTP, short levels (2 waves) and 15 paired runs each, so that every paired
# ratio has a 95% interval
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --waves 2 \
    --repeat 15 --max-tokens 64 --prompts spec-bench --out $B/serve-smollm2-w2r15
# auto's picker over time at 4 requests in one process (no HTTP): when it switches, what it measures
PYTHONPATH=. .venv/bin/python benchmarks/s23/picker_trace.py 4 8 16 | tee $B/picker-trace-c4.txt
# the same on the 1.5B (q4), 6 paired runs a level (the fewest with an interval: their smallest and largest)
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4,8,16 \
    --waves 2 --repeat 6 --max-tokens 32 --timeout 900 --out $B/serve-qwen1.5b-w2r6
