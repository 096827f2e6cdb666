#!/usr/bin/env bash
# Session 17 (AMD EPYC Zen 4, family 25 model 17, 2 vCPU; lscpu.txt). Run from the repository root, one at a time,
# nothing else running. "old" is the code at 031c3ae checked out beside (git worktree add /tmp/old 031c3ae).
set -x
# the bf16 kernel alone, the previous skinny.c (A) against this session's (B), the models' shapes from memory
git show 031c3ae:specdec/runtime/kernels/skinny.c > /tmp/skinny_main.c
PYTHONPATH=. .venv/bin/python benchmarks/kernel/kernel_ab.py /tmp/skinny_main.c specdec/runtime/kernels/skinny.c \
    --model smollm2-135m --n 1,2,4,8,16,64 --reps 11           # ab-smollm2.txt
PYTHONPATH=. .venv/bin/python benchmarks/kernel/kernel_ab.py /tmp/skinny_main.c specdec/runtime/kernels/skinny.c \
    --model qwen2.5-coder-1.5b --n 1,4,8,16 --reps 5           # ab-qwen1.5b.txt
# the probe, old and new alternating (probe-*-ab.txt)
for r in 1 2 3; do for d in /tmp/old .; do (cd $d && PYTHONPATH=$d $OLDPWD/.venv/bin/python -m specdec.cli probe \
    --model smollm2-135m --dtype bf16 --paths used --repeats 7); done; done
for r in 1 2; do for d in /tmp/old .; do (cd $d && PYTHONPATH=$d $OLDPWD/.venv/bin/python -m specdec.cli probe \
    --model qwen2.5-coder-1.5b --dtype bf16 --paths used --repeats 3); done; done
# the methods against transformers' generate, new code; then the same command on the old code (…-before)
.venv/bin/specdec bench --model smollm2-135m --dtype bf16 --methods plain,prompt-lookup,lookahead --prompts humanevalfix \
    --limit 5 --max-new-tokens 128 --compare-hf --out benchmarks/s17/smollm2-humanevalfix-bf16
(cd /tmp/old && PYTHONPATH=/tmp/old $OLDPWD/.venv/bin/python -m specdec.cli bench --model smollm2-135m --dtype bf16 \
    --methods plain,prompt-lookup,lookahead --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-hf \
    --out $OLDPWD/benchmarks/s17/smollm2-humanevalfix-bf16-before)
.venv/bin/specdec bench --model smollm2-135m --dtype bf16 --methods plain,prompt-lookup,lookahead,recycling \
    --prompts spec-bench --limit 1 --max-new-tokens 128 --compare-hf --out benchmarks/s17/smollm2-specbench-bf16
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype bf16 --methods plain,prompt-lookup,lookahead \
    --prompts humanevalfix --limit 3 --max-new-tokens 128 --compare-hf --out benchmarks/s17/qwen1.5b-humanevalfix-bf16
# exact attention: a KV head's query heads split across threads only while a thread would be idle (attention-ab.txt)
git show 031c3ae:specdec/runtime/kernels/attention.c > /tmp/attention_old.c
for a in "--model smollm2-135m --dtype q4 --context 256" "--model smollm2-135m --dtype q4 --context 1024" \
         "--model smollm2-135m --dtype bf16 --context 256" "--model qwen2.5-coder-1.5b --dtype q4 --context 256 --sweeps 8 --steps 8"; do
    PYTHONPATH=. .venv/bin/python benchmarks/kernel/step_ab.py attention /tmp/attention_old.c \
        specdec/runtime/kernels/attention.c --n 1 $a   # session 17 ran benchmarks/s17/attention_ab.py (git show 4e3981f:...)
done
# the final code's probe, every path (probe-smollm2-bf16-final.txt)
for r in 1 2; do .venv/bin/specdec probe --model smollm2-135m --dtype bf16 --repeats 7; done
# the server's three modes with the final code (#13; serve-smollm2/)
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 3 \
    --max-tokens 64 --prompts spec-bench --out benchmarks/s17/serve-smollm2
