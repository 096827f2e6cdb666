#!/usr/bin/env bash
# Session 13 (Intel Xeon, family 6 model 207, AMX-BF16/AMX-INT8, 2 vCPU): every timing of BENCHMARKS.md "Session 13",
# run one after the other with nothing else on the machine. From the repository root.
set -euo pipefail
B=benchmarks/s13
R=$(pwd)
lscpu > $B/lscpu.txt
# llama-cpp-python 0.3.36 as `pip install -e '.[compare]'` builds it (-march=native) dies of SIGILL in its AMX
# matmul (tilezero, ggml_backend_amx_mul_mat) on this machine; built natively without the AMX instructions it runs:
CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16 -DCMAKE_CXX_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16" \
    .venv/bin/pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36
# before: the previous commit (6ced05f) in a worktree, prompts prefilled on the integer kernel; an AVX512 build of
# llama.cpp without -march=native (-DGGML_NATIVE=OFF -DGGML_AVX512=ON ... -DGGML_AMX_*=OFF) beside it
git worktree add /tmp/base 6ced05f
(cd /tmp/base && PYTHONPATH=/tmp/base $R/.venv/bin/python -c "import sys; from specdec.cli import main; sys.exit(main())" \
    bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,recycling,lookahead --prompts humanevalfix \
    --limit 5 --compare-llamacpp --no-progress --out $R/$B/qwen1.5b-humanevalfix-q4-before)
# after: prompts prefilled on AMX tiles
.venv/bin/specdec probe --model qwen2.5-coder-1.5b --dtype q4 > $B/probe-qwen1.5b-q4.txt
.venv/bin/specdec probe --model smollm2-135m --dtype q4 > $B/probe-smollm2-q4.txt
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,recycling,lookahead \
    --prompts humanevalfix --limit 5 --compare-llamacpp --no-progress --out $B/qwen1.5b-humanevalfix-q4
# the server: three modes interleaved per level, 3 runs a level
.venv/bin/specdec loadtest --serve auto,always,never --model smollm2-135m --concurrency 1,2,4,8,16 --requests 16 --repeat 3 \
    --max-tokens 64 --prompts spec-bench --out $B/serve-smollm2
# where SmolLM2's bf16 forward at n = 16 goes (the whole forward against the attention kernel alone)
PYTHONPATH=. .venv/bin/python benchmarks/s13/forward_profile.py > $B/forward-profile-smollm2-bf16.txt
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,recycling --prompts spec-bench \
    --limit 1 --max-new-tokens 64 --compare-llamacpp --no-progress --out $B/qwen1.5b-specbench-q4
