#!/usr/bin/env bash
# Session 25 (AMD EPYC Zen 4, family 25 model 17, AVX512-BF16, no AMX), run one at a time with nothing else on the
# machine, from the repository root.
set -euo pipefail
B=benchmarks/s25
lscpu > $B/lscpu.txt
git show fb30cf2:specdec/runtime/kernels/skinny.c > /tmp/skinny_s24.c   # the kernel before this session
# #16: the AVX512-BF16 kernel before / after in the whole forward (same logits checked), then on the matmuls alone
for m in smollm2-135m qwen2.5-coder-1.5b; do
  PYTHONPATH=. .venv/bin/python benchmarks/kernel/step_ab.py skinny /tmp/skinny_s24.c specdec/runtime/kernels/skinny.c \
      --model $m --dtype bf16 --n 1,2,4,8,16 --sweeps 10 --steps 8 | tee $B/step-ab-$m.txt
  .venv/bin/python benchmarks/kernel/kernel_ab.py /tmp/skinny_s24.c specdec/runtime/kernels/skinny.c --model $m \
      --n 1,4,8,16,64 --reps 7 | tee $B/kernel-ab-$m.txt
done
# the probe curves of every path, the budget, the step against the bandwidth bound, prefill
for m in smollm2-135m qwen2.5-coder-1.5b; do
  .venv/bin/specdec probe --model $m --dtype bf16 --paths all 2>&1 | grep -v '%|' | tee $B/probe-$m-bf16.txt
  .venv/bin/specdec probe --model $m --dtype q4 2>&1 | grep -v '%|' | tee $B/probe-$m-q4.txt
done
# the methods with this session's kernel against our plain decoding and transformers' generate, one run each
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype bf16 --methods plain,prompt-lookup,lookahead,recycling \
    --prompts humanevalfix --limit 3 --max-new-tokens 128 --compare-hf --no-progress --out $B/qwen1.5b-humanevalfix-bf16
.venv/bin/specdec bench --model smollm2-135m --dtype bf16 --methods plain,prompt-lookup,lookahead,recycling \
    --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-hf --no-progress --out $B/smollm2-humanevalfix-bf16
# #13 on this CPU class: the server's three modes over HTTP with intervals (sessions 23-24's command)
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --waves 2 \
    --repeat 15 --max-tokens 64 --prompts spec-bench --out $B/serve-smollm2-w2r15
# the same on the 1.5B (q4), 6 paired runs a level (session 23's command)
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4,8,16 \
    --waves 2 --repeat 6 --max-tokens 32 --timeout 900 --out $B/serve-qwen1.5b-w2r6
