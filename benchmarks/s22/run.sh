#!/usr/bin/env bash
# Session 22 (Intel Xeon with AMX, family 6 model 167), run one at a time with nothing else on the machine, from the
# repository root. "s21" is the code at 578c93a (session 21's end): git worktree add /tmp/s22/old 578c93a
set -euo pipefail
B=benchmarks/s22
lscpu > $B/lscpu.txt
# where a server step's time goes with prompts arriving (4 requests in flight; s21's code and this one)
for m in never always auto; do PYTHONPATH=. .venv/bin/python $B/step_times.py 4 $m 24; done | tee $B/step-times.txt
(cd /tmp/s22/old && for m in never always auto; do PYTHONPATH=. /work/main/.venv/bin/python /work/main/$B/step_times.py 4 $m 24; done) \
    | tee $B/step-times-s21.txt
# the modes in one process, rounds alternating (the picker's own estimates printed for auto)
PYTHONPATH=. .venv/bin/python $B/modes_ab.py 1 6 8 model:0.2,model:0,always,auto,never | tee $B/modes-c1.txt
PYTHONPATH=. .venv/bin/python $B/modes_ab.py 4 6 16 model:0.2,model:0,always,auto,never | tee $B/modes-c4.txt
PYTHONPATH=. .venv/bin/python $B/modes_ab.py 8 6 24 model:0.2,model:0,never | tee $B/modes-c8.txt
(cd /tmp/s22/old && PYTHONPATH=. /work/main/.venv/bin/python /work/main/$B/modes_ab.py 1 6 8 auto,always,never) \
    | tee $B/modes-c1-s21.txt  # s21's picker (a mean of log rates) at one request
# #13: the server's three modes over HTTP (SmolLM2 q4, the server's default format), three runs
for out in serve-smollm2 serve-smollm2-2; do
  .venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 3 \
      --max-tokens 64 --prompts spec-bench --out $B/$out
done
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 5 \
    --max-tokens 64 --prompts spec-bench --out $B/serve-smollm2-r5
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4,8,16 \
    --max-tokens 32 --timeout 900 --out $B/serve-qwen1.5b
