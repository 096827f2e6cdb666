#!/bin/bash
# Session 32, fourth device call: `specdec serve --device cuda` (new): the engine's GPU test, then a loadtest that
# starts a GPU server per mode on a tiny model (a smoke test of the whole path: HTTP, batching, graphs).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/home
timeout 70 python3 -m pytest -q -p no:cacheprovider -rs tests/test_device.py -k "server_engine or graphs or every_method" 2>&1 | tail -6 | tee $OUT/test_device.txt
python3 -c "
import json
from tests.tiny import save_tiny
save_tiny('qwen2', '/tmp/tiny')
with open('/tmp/short.jsonl', 'w') as f:  # the tiny model's context is 256 positions
    for i, t in enumerate(['abc abc abc', 'hello hello', 'the cat sat on the mat', 'one two one two', 'x y z x y z']):
        f.write(json.dumps({'question_id': i, 'category': 'short', 'turns': [t]}) + '\\n')
" && \
timeout 110 python3 -m specdec.cli loadtest --serve auto,always,never --model /tmp/tiny --device cuda --dtype fp32 --budget 4 \
  --method recycling --concurrency 1,4 --requests 8 --max-tokens 24 --prompts /tmp/short.jsonl --out $OUT/loadtest 2>&1 | tail -25 | tee $OUT/loadtest.txt
