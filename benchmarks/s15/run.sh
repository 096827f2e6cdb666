#!/usr/bin/env bash
# Session 15 (AMD EPYC Zen 4, family 25 model 17, 2 vCPU; lscpu.txt). Run from the repository root, one at a time,
# nothing else running. Raw output of the loadtests beside this file (each folder holds the later of its two runs).
set -x
# the VNNI ceiling of one core (vpdpbusd zmm throughput) and the q4k kernel against it, weights in L2
gcc -O2 -mavx512f -mavx512bw -mavx512vnni -mavx512vl benchmarks/s15/vnni_peak.c -o /tmp/vnni_peak && /tmp/vnni_peak
OUT=1024 PYTHONPATH=. .venv/bin/python benchmarks/s15/qgemm_incache.py specdec/runtime/kernels/qgemm.c
OUT=256 PYTHONPATH=. .venv/bin/python benchmarks/s15/qgemm_incache.py specdec/runtime/kernels/qgemm.c
# the rows-innermost variant, tried and not kept (the patch applies to 39d1cff's qgemm.c)
cp specdec/runtime/kernels/qgemm.c /tmp/qgemm_a.c && cp /tmp/qgemm_a.c /tmp/qgemm_b.c && patch /tmp/qgemm_b.c benchmarks/s15/q4k_rows_innermost.patch
cp specdec/runtime/kernels/amx.h /tmp/
PYTHONPATH=. .venv/bin/python benchmarks/kernel/qgemm_parts.py /tmp/qgemm_a.c /tmp/qgemm_b.c --model qwen2.5-coder-1.5b --n 4,8,16 --reps 9
# the AVX2 path forced, against #16's figures for it (136, 171, 256, 423 ms at n = 1, 4, 8, 16 on a Zen 4)
SPECDEC_MATMUL=avx2 .venv/bin/specdec probe --model qwen2.5-coder-1.5b --dtype bf16 --paths used
.venv/bin/specdec probe --model smollm2-135m --dtype q4
.venv/bin/specdec probe --model smollm2-135m --dtype bf16
# the server's prefill stall: plain batching, two servers, loadtests alternating (stall 2, 0, 2, 0), then stall 4
for st in 2 0 4; do .venv/bin/specdec serve --model smollm2-135m --speculation never --prefill-stall $st --port $((8200 + st)) & done
sleep 25
for st in 2 0 2 0 4; do
  .venv/bin/specdec loadtest --url http://127.0.0.1:$((8200 + st)) --concurrency 1,4,8,16 --max-tokens 64 \
      --prompts spec-bench --out benchmarks/s15/serve-never-stall$st
done
kill %1 %2 %3
