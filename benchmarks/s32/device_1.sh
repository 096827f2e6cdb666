#!/bin/bash
# Session 32, first device call: keep the GGUF's first part and the shipped EAGLE head in /tmp/w for the second
# call (the tool carries 64 MiB a call), then rerun the CUDA-graph GPU tests (the pool fixes made after s31's calls).
mkdir -p /tmp/w && cp .dev/a/part_a /tmp/w/ && cp .dev/a/eagle.safetensors /tmp/w/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/home
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)";
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee $OUT/env.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/test_device.py tests/test_cuda_graphs.py 2>&1 | tail -15 | tee $OUT/test_device.txt
