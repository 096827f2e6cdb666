#!/bin/bash
# Session 31, third device call: the GPU tests again (early exit's verify forward fixed), then where a GPU step's
# time goes (`gpu_step.py`: ours against transformers' generate on a SmolLM2-shaped model, torch's profiler).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/home
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_device.py 2>&1 | tail -40 | tee $OUT/test_device.txt
timeout 240 python3 .dev/s/gpu_step.py cuda 2>&1 | grep -v USDT | tee $OUT/gpu_step.txt
