#!/usr/bin/env bash
# Session 26 (AMD EPYC Zen 4, family 25 model 17, AVX512-VNNI/BF16, no AMX), run one at a time with nothing else on
# the machine, from the repository root. The "tried" diffs apply to the sources of commit b3f8335.
set -euo pipefail
B=benchmarks/s26
lscpu > $B/lscpu.txt
# #16, the q4 path on this class: the instruction's peak, the tile alone, the model's matmuls by part
gcc -O2 $B/vnni_peak.c -o /tmp/vnni_peak && /tmp/vnni_peak | tee $B/vnni-peak.txt
gcc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp -I specdec/runtime/kernels $B/qgemm_tile.c -o /tmp/qgemm_tile
for g in 1 40 4000; do /tmp/qgemm_tile $g; done | tee $B/qgemm-tile.txt
cp specdec/runtime/kernels/amx.h /tmp/ && cp specdec/runtime/kernels/qgemm.c /tmp/qgemm_base.c
for t in one-pass prefetch-l2; do  # tried and not kept: B / A of the matmuls alone
  patch -o /tmp/qgemm_$t.c specdec/runtime/kernels/qgemm.c $B/tried-qgemm-$t.diff
  .venv/bin/python benchmarks/kernel/qgemm_parts.py /tmp/qgemm_base.c /tmp/qgemm_$t.c --model qwen2.5-coder-1.5b \
      --n 1,8,16,64 --reps 7 | tee $B/qgemm-parts-$t.txt
done
# exact attention, rows of one request sharing their blocks' K and V loads (tried and not kept)
cp specdec/runtime/kernels/{amx.h,vexp.h} /tmp/ && cp specdec/runtime/kernels/attention.c /tmp/attention_base.c
patch -o /tmp/attention_rows.c specdec/runtime/kernels/attention.c $B/tried-attention-rows.diff
for h in 9,3,64 12,2,128; do
  PYTHONPATH=. .venv/bin/python $B/attention_ab.py /tmp/attention_base.c /tmp/attention_rows.c --heads $h
done | tee $B/attention-rows.txt
# #13: auto and never in one process at 16 requests of the 1.5B: where the steps' time goes
PYTHONPATH=. .venv/bin/python $B/auto_steps.py --model qwen2.5-coder-1.5b --c 16 --rounds 2 | grep -v '%|' \
    | tee $B/auto-steps-qwen1.5b-c16.txt
# the mission's comparison on this class: llama.cpp on the same Q4_K_M file (llama-cpp-python built natively)
.venv/bin/pip install --no-cache-dir llama-cpp-python==0.3.36   # what `pip install -e ".[compare]"` installs
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,lookahead,recycling \
    --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-llamacpp --no-progress \
    --out $B/qwen1.5b-humanevalfix-q4
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,recycling \
    --prompts spec-bench --limit 1 --max-new-tokens 64 --compare-llamacpp --no-progress \
    --out $B/qwen1.5b-specbench-q4
# the L2 prefetch hint in whole forwards (step-ab-prefetch-l2.txt)
for m in qwen2.5-coder-1.5b smollm2-135m; do
  PYTHONPATH=. .venv/bin/python benchmarks/kernel/step_ab.py qgemm /tmp/qgemm_base.c /tmp/qgemm_prefetch-l2.c \
      --model $m --dtype q4 --n 1,4,8,16 --sweeps 16 --steps 8
done | tee $B/step-ab-prefetch-l2.txt
