#!/usr/bin/env bash
# Session 16 (AMD EPYC Zen 4, family 25 model 17, 2 vCPU; lscpu.txt). Run from the repository root, one at a time,
# nothing else running. Raw output beside this file.
set -x
# the three speculation modes with the bounded prefill (session 15's --prefill-stall 4), code at d13a7d3
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 3 \
    --max-tokens 64 --prompts spec-bench --out benchmarks/s16/serve-smollm2
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4,8,16 \
    --max-tokens 32 --timeout 900 --out benchmarks/s16/serve-qwen1.5b
# in-process engines, no HTTP (modes alternating in rounds): C = 2 and 8
PYTHONPATH=. .venv/bin/python benchmarks/s16/engine_ab.py smollm2-135m 2 8 12
PYTHONPATH=. .venv/bin/python benchmarks/s16/engine_ab.py smollm2-135m 8 6 24
# with auto's own measure on /metrics and paired p99 (commit "serve: auto's own paired measure ...")
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 6 \
    --max-tokens 64 --prompts spec-bench --out benchmarks/s16/serve-smollm2-r6
# the model's grants: predicted accepted tokens against realized, drafting after the grant (old) and before it
PYTHONPATH=. .venv/bin/python benchmarks/s16/calib.py 8 48 old
PYTHONPATH=. .venv/bin/python benchmarks/s16/calib.py 1 16 old
PYTHONPATH=. .venv/bin/python benchmarks/s16/calib.py 8 48
PYTHONPATH=. .venv/bin/python benchmarks/s16/engine_ab.py smollm2-135m 8 8 24 model,model-after,never
# drafting before the grant (commit "serve: a cheap drafter ...")
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 6 \
    --max-tokens 64 --prompts spec-bench --out benchmarks/s16/serve-smollm2-draftfirst
# the final code (a chain that does not pay gets the longest prefix that does)
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 6 \
    --max-tokens 64 --prompts spec-bench --out benchmarks/s16/serve-smollm2-final
# a chain's longest paying prefix against all or none, in process (run after the final loadtest)
PYTHONPATH=. .venv/bin/python benchmarks/s16/engine_ab.py smollm2-135m 2 8 12 model,model-whole,never
# the 1.5B with the final code
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4 \
    --repeat 2 --max-tokens 32 --timeout 900 --out benchmarks/s16/serve-qwen1.5b-final
# #16 lead: SmolLM2 bf16, where a 16-position forward's time goes (matmuls alone, then the whole forward under perf)
.venv/bin/python benchmarks/kernel/kernel_ab.py specdec/runtime/kernels/skinny.c specdec/runtime/kernels/skinny.c \
    --model smollm2-135m --n 1,16
PYTHONPATH=. .venv/bin/python benchmarks/s16/fwd_smollm2_bf16.py
for n in 1 16; do PYTHONPATH=. perf record -q -g -o /tmp/perf$n.data .venv/bin/python benchmarks/s16/fwd_smollm2_bf16.py $n; done
