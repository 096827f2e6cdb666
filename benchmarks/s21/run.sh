#!/usr/bin/env bash
# Session 21 (Intel Xeon with AMX, family 6 model 167), run one at a time with nothing else on the machine, from the
# repository root.
set -euo pipefail
B=benchmarks/s21
lscpu > $B/lscpu.txt
# exact attention alone: fp16 cache (AVX512) against the bf16 cache on AMX tiles
PYTHONPATH=. .venv/bin/python benchmarks/s21/attention_amx.py | tee $B/attention-amx.txt
# the forward's cost per n, the bf16 cache (AMX attention) and the fp16 cache alternating in one process
PYTHONPATH=. .venv/bin/python benchmarks/s21/kv_ab.py smollm2-135m bf16 256 21 | tee $B/kv-ab-smollm2.txt
PYTHONPATH=. .venv/bin/python benchmarks/s21/kv_ab.py qwen2.5-coder-1.5b bf16 256 9 | tee $B/kv-ab-qwen1.5b.txt
# quality: perplexity and top-1 agreement with fp32 weights, each cache dtype
(for kv in fp16 bf16; do .venv/bin/specdec quality --model smollm2-135m --dtype bf16 --ref fp32 --kv-dtype $kv; done) \
    2>&1 | grep -v "%|" | tee $B/quality-smollm2.txt
# #16: the probe with the default (bf16 weights on AMX: the bf16 cache)
.venv/bin/specdec probe --model smollm2-135m --dtype bf16 --repeats 9 2>&1 | grep -v "probe:" | tee $B/probe-smollm2-bf16.txt
# the methods, the bf16 cache (auto) and the fp16 cache, transformers' `generate` in the first run
for kv in auto fp16; do
  .venv/bin/specdec bench --model smollm2-135m --dtype bf16 --kv-dtype $kv \
      --methods plain,prompt-lookup,recycling,lookahead,medusa,eagle@chain,eagle@dynamic --prompts spec-bench --limit 1 \
      $( [ $kv = auto ] && echo --compare-hf ) --no-progress --out $B/smollm2-specbench-bf16-kv$kv
done
# greedy equality of the other drafters with the bf16 cache (not a timing)
.venv/bin/specdec bench --model smollm2-135m --dtype bf16 --methods plain,early-exit,hybrid,draft --draft smollm2-135m \
    --prompts humanevalfix --limit 3 --max-new-tokens 64 --no-progress --out $B/smollm2-humanevalfix-bf16-others
