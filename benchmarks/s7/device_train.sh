#!/bin/bash
# Train the shipped SmolLM2 EAGLE-3 head on a lent GPU (session 7), self-distilled. The GGUF travels in two
# halves (the device tool carries 64 MiB a call): .dev/a (first call, copied to /tmp/w) and .dev/b (this call).
# Usage on the device: bash benchmarks/s7/device_train.sh DEVICE TOKENS EPOCHS SECONDS
set -e
DEVICE=${1:-cuda}; TOKENS=${2:-4000000}; EPOCHS=${3:-6}; SECONDS_MAX=${4:-420}
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD SPECDEC_HOME=${SPECDEC_HOME:-/tmp/home}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
M=$SPECDEC_HOME/models/smollm2-135m
if [ ! -f "$M/model.safetensors" ]; then
  cat /tmp/w/smollm2.gguf.a .dev/b/smollm2.gguf.b > /tmp/smollm2.gguf
  mkdir -p "$M" && cp .dev/b/model/* "$M/"
  python3 - "$M" <<'PY'
import sys, time
from pathlib import Path
from specdec.store.convert import read_gguf, field, _write_weights
from specdec.training.heads import fingerprint
t = time.time(); r = read_gguf(Path("/tmp/smollm2.gguf"))
print(_write_weights(r, "llama", int(field(r, "llama.attention.head_count")), int(field(r, "llama.attention.head_count_kv")),
                     Path(sys.argv[1]) / "model.safetensors", False), f"{time.time() - t:.1f} s")
print("fingerprint", fingerprint(sys.argv[1]))
PY
fi
python3 -c "import torch; print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
set +e
timeout -s INT "$SECONDS_MAX" python3 -m specdec.cli train eagle --model smollm2-135m --device "$DEVICE" --regenerate \
  --data .dev/b/prompts.jsonl.gz --tokens "$TOKENS" --epochs "$EPOCHS" --batch-tokens 32768 --ttt-steps 6 \
  --lr 1e-3 --checkpoint-every 100 --out /tmp/eagle 2>&1 | tr '\r' '\n' | grep -v "^\s*$" | awk 'NR % 20 == 1 || /alpha|Error|error|Traceback|File|head for/' | tee "$OUTDIR/train.log"
python3 benchmarks/s7/device_collect.py /tmp/eagle "$OUTDIR"
