#!/bin/bash
# Session 32, third device call: our step against transformers' generate on Qwen2.5-Coder-1.5B's shapes, then SmolLM2's
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/s32/gpu_step.py cuda qwen1.5b 2>&1 | grep -v Warning | tee $OUT/gpu_step_qwen.txt
timeout 100 python3 benchmarks/s32/gpu_step.py cuda smollm2 2>&1 | grep -v Warning | tee $OUT/gpu_step_smollm2.txt
