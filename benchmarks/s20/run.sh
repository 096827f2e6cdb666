#!/usr/bin/env bash
# Session 20 (Intel Xeon with AMX, family 6 model 167), run one at a time with nothing else on the machine, from the
# repository root. "s19" is the code at 10d4a2e (session 19's end), checked out beside: git worktree add /tmp/s20/old 10d4a2e
set -euo pipefail
B=benchmarks/s20
lscpu > $B/lscpu.txt
# the matmuls alone: session 19's AMX path (W's rows as A tiles, outputs gathered) against this one, bf16 weights
# (kernel_ab.py gives a source whose AMX path takes packed weights its weights packed) and the q4 prefill path
git show 10d4a2e:specdec/runtime/kernels/skinny.c > /tmp/skinny_s19.c
git show 10d4a2e:specdec/runtime/kernels/amx.h > /tmp/amx.h
git show 10d4a2e:specdec/runtime/kernels/qgemm.c > /tmp/qgemm_s19.c
(for m in smollm2-135m qwen2.5-coder-1.5b; do
    .venv/bin/python benchmarks/kernel/kernel_ab.py /tmp/skinny_s19.c specdec/runtime/kernels/skinny.c \
        --path amx --path-b amx --model $m --n 1,4,8,16,64; done) | tee $B/ab-skinny-amx.txt
(.venv/bin/python benchmarks/kernel/qgemm_parts.py /tmp/qgemm_s19.c specdec/runtime/kernels/qgemm.c \
    --model qwen2.5-coder-1.5b --n 16,64,256 --isa amx --reps 5
 .venv/bin/python benchmarks/kernel/qgemm_parts.py /tmp/qgemm_s19.c specdec/runtime/kernels/qgemm.c \
    --model smollm2-135m --n 16,64,256 --isa amx --reps 7 --only q4,q8) | tee $B/ab-qgemm-amx-prefill.txt
# the probe, session 19's code and this one alternating (bf16: the AMX path the runtime uses)
# (python -m imports from the working directory: each version runs from its own checkout)
P() { (cd $1 && PYTHONPATH=. /work/main/.venv/bin/python -m specdec.cli probe --model $2 --dtype $3 --repeats 7 --paths used); }
(for i in 1 2; do for w in /tmp/s20/old /work/main; do echo "== $w"; P $w smollm2-135m bf16; P $w qwen2.5-coder-1.5b bf16
     P $w qwen2.5-coder-1.5b q4; done; done) 2>&1 | grep -v "probe:" | tee $B/probe-ab.txt
# #16: every path's curve with the final code
(.venv/bin/specdec probe --model smollm2-135m --dtype bf16 --repeats 7
 .venv/bin/specdec probe --model qwen2.5-coder-1.5b --dtype bf16 --repeats 5
 .venv/bin/specdec probe --model smollm2-135m --dtype q4 --repeats 7
 .venv/bin/specdec probe --model qwen2.5-coder-1.5b --dtype q4 --repeats 5) 2>&1 | grep -v "probe:" | tee $B/probes.txt
# the methods with this session's budgets, transformers' `generate` in the same run (#16)
.venv/bin/specdec bench --model smollm2-135m --dtype bf16 --methods plain,prompt-lookup,recycling,lookahead,medusa,eagle@chain,eagle@dynamic \
    --prompts spec-bench --limit 1 --compare-hf --no-progress --out $B/smollm2-specbench-bf16
.venv/bin/specdec bench --model smollm2-135m --dtype bf16 --methods plain,prompt-lookup,recycling,lookahead,medusa,eagle@chain,eagle@dynamic \
    --prompts humanevalfix --limit 5 --compare-hf --no-progress --out $B/smollm2-humanevalfix-bf16
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype bf16 --draft qwen2.5-coder-0.5b \
    --methods plain,prompt-lookup,recycling,lookahead,draft --prompts humanevalfix --limit 5 --compare-hf --no-progress \
    --out $B/qwen1.5b-humanevalfix-bf16
# against llama.cpp on the same GGUF (llama-cpp-python 0.3.36 built natively without the AMX instructions, whose
# kernels die of SIGILL here: benchmarks/s13/run.sh)
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,lookahead,recycling \
    --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-llamacpp --no-progress \
    --out $B/qwen1.5b-humanevalfix-q4
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,recycling \
    --prompts spec-bench --limit 1 --max-new-tokens 64 --compare-llamacpp --no-progress \
    --out $B/qwen1.5b-specbench-q4
# #13: the server's three modes (SmolLM2 q4, the server's default format): before auto's tie rule (c98c044), with it
# (2db375d), with exploration of the neighbouring arms only (the commit after it)
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 3 \
    --max-tokens 64 --prompts spec-bench --out $B/serve-smollm2
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 3 \
    --max-tokens 64 --prompts spec-bench --out $B/serve-smollm2-tie
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 3 \
    --max-tokens 64 --prompts spec-bench --out $B/serve-smollm2-neighbours
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4,8,16 \
    --max-tokens 32 --timeout 900 --out $B/serve-qwen1.5b
