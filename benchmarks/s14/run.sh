#!/bin/sh
# Session 14 (Intel Xeon with AMX, lscpu.txt): every figure in BENCHMARKS.md "Session 14", one command at a time,
# nothing else running. From the repository root.
B=benchmarks/s14
# the AMX-INT8 decoding path that was tried and not kept: apply the patch, build, time one matrix per ISA
#   git apply $B/amx_int8_decode.patch
#   .venv/bin/python $B/qgemm_isas.py q4k 8960 1536 1; .venv/bin/python $B/qgemm_isas.py q4k 8960 1536 2
#   git checkout specdec/runtime/kernels/
# Q4_K's block sums in two chains: the previous kernel against this one on the 1.5B's parts
git show 1255c9e:specdec/runtime/kernels/qgemm.c > /tmp/qgemm_prev.c
.venv/bin/python benchmarks/kernel/qgemm_parts.py /tmp/qgemm_prev.c specdec/runtime/kernels/qgemm.c \
    --model qwen2.5-coder-1.5b --n 1,2,3,4,8
.venv/bin/python benchmarks/kernel/qgemm_parts.py /tmp/qgemm_prev.c specdec/runtime/kernels/qgemm.c \
    --model qwen2.5-coder-1.5b --n 1,2,4,8,16
.venv/bin/specdec probe --model qwen2.5-coder-1.5b --dtype q4 > $B/probe-qwen1.5b-q4.txt
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,recycling \
    --prompts humanevalfix --limit 5 --no-progress --out $B/qwen1.5b-humanevalfix-q4
gcc -O2 $B/amx_tile_costs.c -o /tmp/amx_tile_costs && /tmp/amx_tile_costs > $B/amx-tile-costs.txt
# the server: three modes interleaved per level, 3 runs a level, 4 x concurrency requests a level (the new default)
# (serve-smollm2-carry: the same command at a36c524, before the exploration change; serve-smollm2: the final code)
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 3 \
    --max-tokens 64 --prompts spec-bench --out $B/serve-smollm2
# session 13's picker (commit 1255c9e) under the same steady-load protocol
git worktree add -f /tmp/base 1255c9e
(cd /tmp/base && PYTHONPATH=/tmp/base $OLDPWD/.venv/bin/python -c "import sys; from specdec.cli import main; sys.exit(main())" \
    loadtest --serve auto,never --model smollm2-135m --concurrency 8,16 --requests 64 --repeat 3 --max-tokens 64 \
    --prompts spec-bench --out $OLDPWD/$B/serve-smollm2-before)
# at one client: how many asks the model's grants refuse
PYTHONPATH=. .venv/bin/python $B/b1_grants.py
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4,8 \
    --max-tokens 32 --prompts spec-bench --timeout 900 --out $B/serve-qwen1.5b
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4 \
    --repeat 2 --max-tokens 32 --prompts spec-bench --timeout 900 --out $B/serve-qwen1.5b-final
