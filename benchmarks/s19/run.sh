#!/usr/bin/env bash
# Session 19 (AMD Zen 4, family 25 model 17), run one at a time with nothing else on the machine, from the
# repository root. "s18" is the code at a13c6d4 (session 18's end).
set -euo pipefail
lscpu > benchmarks/s19/lscpu.txt
K="PYTHONPATH=. .venv/bin/python benchmarks/s19/kv_ab.py"
# the fp16 KV cache against fp32: quality, one decoding step, the server's packed forward
(eval $K quality smollm2-135m; eval $K quality qwen2.5-coder-1.5b) | tee benchmarks/s19/kv-quality.txt
(eval $K step smollm2-135m 256,1024,2048,4096; eval $K step qwen2.5-coder-1.5b 256,1024,4096) \
    | tee benchmarks/s19/kv-step.txt
(for a in "16 128 0" "16 352 0" "16 1024 0" "16 352 3" "8 352 0"; do eval $K batch smollm2-135m $a; done
 eval $K batch qwen2.5-coder-1.5b 8 352 0) | tee benchmarks/s19/kv-batch.txt
eval $K engine 16 6 48 never; eval $K engine 16 6 48 auto
# the attention kernel alone: session 18's source against this one, over fp32 and fp16 caches
git show a13c6d4:specdec/runtime/kernels/attention.c > /tmp/attention_s18.c
for shape in 9,3,64 12,2,128; do for kv in fp32 fp16; do
    PYTHONPATH=. .venv/bin/python benchmarks/s19/attention_ab.py /tmp/attention_s18.c \
        specdec/runtime/kernels/attention.c --shape $shape --isa avx512 --kv $kv
done; done | tee benchmarks/s19/attention-ab.txt
# #13: the server's three modes (a fresh probe first: the kernel sources changed)
.venv/bin/specdec probe --model smollm2-135m --dtype q4
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 3 \
    --max-tokens 64 --prompts spec-bench --out benchmarks/s19/serve-smollm2
# against llama.cpp on the same GGUF (llama-cpp-python built natively; a fresh 1.5B probe first)
.venv/bin/pip install --no-cache-dir llama-cpp-python==0.3.36   # what `pip install -e ".[compare]"` installs
.venv/bin/specdec probe --model qwen2.5-coder-1.5b --dtype q4
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,lookahead,recycling \
    --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-llamacpp --no-progress \
    --out benchmarks/s19/qwen1.5b-humanevalfix-q4
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,recycling \
    --prompts spec-bench --limit 1 --max-new-tokens 64 --compare-llamacpp --no-progress \
    --out benchmarks/s19/qwen1.5b-specbench-q4
# #13 on the 1.5B: all levels once, then 1-2 clients twice
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2,4,8,16 \
    --max-tokens 32 --timeout 900 --out benchmarks/s19/serve-qwen1.5b
.venv/bin/specdec loadtest --serve auto,always,never --model qwen2.5-coder-1.5b --dtype q4 --concurrency 1,2 \
    --repeat 2 --max-tokens 32 --timeout 900 --out benchmarks/s19/serve-qwen1.5b-low
# #16: the SmolLM2 bf16 probe with the final code (probe-smollm2-bf16.txt)
.venv/bin/specdec probe --model smollm2-135m --dtype bf16 --repeats 7
