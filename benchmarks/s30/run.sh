#!/bin/bash
# Session 30 (AMD EPYC Zen 4, family 25 model 17; lscpu.txt): the commands behind BENCHMARKS.md "Session 30",
# one at a time with nothing else running.
set -e
B=benchmarks/s30
lscpu > $B/lscpu.txt
# small calls right after a forward against warm
python benchmarks/s30/cold_calls.py | tee $B/cold-calls.txt
# a step's own work (before and after its forward) with the code before this session (2551b22) and after, alternating
git worktree add -f /tmp/base 2551b22
for r in 1 2; do for code in /tmp/base .; do PYTHONPATH=$code python benchmarks/s29/step_parts.py; done; done \
    | tee $B/step-parts-ab.txt
bash $B/step_ab.sh /tmp/base "$PWD" 4 | tee $B/step-ab.txt
# #13: the three modes with token recycling on code edits (as session 28), now with TPOT
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --method recycling --prompts humanevalfix \
    --concurrency 1,2,4,8,16 --waves 2 --repeat 6 --max-tokens 64 --out $B/serve-smollm2-recycling
