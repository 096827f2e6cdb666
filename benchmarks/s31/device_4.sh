#!/bin/bash
# Session 31, fourth device call: CUDA graphs. The GPU tests (graphs against the eager forward, every method through
# them), then `gpu_step.py`: eager against graphs against transformers' generate on a SmolLM2-shaped model.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/home
timeout 90 python3 -m pytest -q -p no:cacheprovider -rs -x tests/test_device.py 2>&1 | tail -40 | tee $OUT/test_device.txt
timeout 130 python3 .dev/s/gpu_step.py cuda 2>&1 | grep -v USDT | tee $OUT/gpu_step.txt
