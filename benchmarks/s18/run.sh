#!/usr/bin/env bash
# Session 18 (AMD Zen 4, family 25 model 17), run one at a time with nothing else on the machine, from the
# repository root. "old" sources are the code at 4e3981f (session 17's end).
set -euo pipefail
lscpu > benchmarks/s18/lscpu.txt
# exact attention's score loop, the kernel alone (attention-ab.txt)
git show 4e3981f:specdec/runtime/kernels/attention.c > /tmp/attention_old.c
for shape in 9,3,64 12,2,128; do for isa in avx512 avx2; do
    PYTHONPATH=. .venv/bin/python benchmarks/s19/attention_ab.py /tmp/attention_old.c \
        specdec/runtime/kernels/attention.c --shape $shape --isa $isa
done; done
# ... and in a whole forward
PYTHONPATH=. .venv/bin/python benchmarks/kernel/step_ab.py attention /tmp/attention_old.c \
    specdec/runtime/kernels/attention.c --model smollm2-135m --dtype bf16 --n 1,16
PYTHONPATH=. .venv/bin/python benchmarks/kernel/step_ab.py attention /tmp/attention_old.c \
    specdec/runtime/kernels/attention.c --model smollm2-135m --dtype q4 --n 1,16
PYTHONPATH=. .venv/bin/python benchmarks/kernel/step_ab.py attention /tmp/attention_old.c \
    specdec/runtime/kernels/attention.c --model qwen2.5-coder-1.5b --dtype q4 --n 1,8 --sweeps 12 --steps 10
# prompt lookup's proposals and the argmax (lookup-bench.txt, argmax-bench.txt)
PYTHONPATH=. .venv/bin/python benchmarks/s18/lookup_bench.py
PYTHONPATH=. .venv/bin/python benchmarks/s18/argmax_bench.py
# the stop rule's text over 8000 tokens, incremental and whole (stopper-bench.txt)
for a in "" --whole; do PYTHONPATH=. .venv/bin/python benchmarks/s18/stopper_bench.py $a; done
# the Python-side changes, old and new code in one process
PYTHONPATH=. .venv/bin/python benchmarks/s18/decode_ab.py --dtype q4 --prompts spec-bench --limit 13
PYTHONPATH=. .venv/bin/python benchmarks/s18/engine_ab.py 16 8 32 auto    # engine-ab-16-auto.txt
PYTHONPATH=. .venv/bin/python benchmarks/s18/engine_ab.py 16 8 32 never   # engine-ab-16-never.txt
# where a batched step's time goes (the forward against the whole step, per mode)
PYTHONPATH=. .venv/bin/python benchmarks/s18/step_costs.py 16 48 4
# the model's grants against plain batching in process (session 16's script)
PYTHONPATH=. .venv/bin/python benchmarks/s16/engine_ab.py smollm2-135m 8 6 24 model,never,always
# the server's three modes (#13; serve-smollm2/)
.venv/bin/specdec probe --model smollm2-135m --dtype q4
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 3 \
    --max-tokens 64 --prompts spec-bench --out benchmarks/s18/serve-smollm2
# ... and once more with the final code (serve-smollm2-2/)
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --repeat 3 \
    --max-tokens 64 --prompts spec-bench --out benchmarks/s18/serve-smollm2-2
# #16's probes with the final code (probe-*.txt)
.venv/bin/specdec probe --model smollm2-135m --dtype bf16 --repeats 7
.venv/bin/specdec probe --model qwen2.5-coder-1.5b --dtype bf16
