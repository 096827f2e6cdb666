#!/bin/bash
# Session 32, second device call: assemble SmolLM2's GGUF, convert it into the store as smollm2-135m (so the shipped
# Medusa and EAGLE heads are found by name), then probe and bench it on the GPU with CUDA graphs (s31 ran eager).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/home
N=128; O=/tmp/res; mkdir -p $O
[ -f /tmp/w/part_a ] || { echo "no /tmp/w/part_a: the machine is a fresh one"; exit 3; }
cat /tmp/w/part_a .dev/b/part_b > /tmp/w/smollm2-135m.gguf && cp /tmp/w/eagle.safetensors specdec/heads/smollm2-135m/eagle/model.safetensors
sha256sum /tmp/w/smollm2-135m.gguf | tee $O/sha.txt
t=$(date +%s)
python3 - <<'PY' 2>&1 | tee $O/convert.txt
import shutil, time
t = time.time()
from specdec.store import home, pull
f = pull("/tmp/w/smollm2-135m.gguf", progress=False)
(home() / "models").mkdir(parents=True, exist_ok=True)
shutil.move(str(f), str(home() / "models" / "smollm2-135m"))
print(f"converted in {time.time() - t:.1f} s")
PY
S="python3 -m specdec.cli"
run() { local name=$1 limit=$2; shift 2; echo "== $name ($(($(date +%s) - t)) s): $*" | tee -a $O/log.txt;
  timeout $limit "$@" > $O/$name.txt 2> >(tr '\r' '\n' | grep -v "^\s*$" | tail -5 > $O/$name.err); echo "rc $? ($(($(date +%s) - t)) s)" | tee -a $O/log.txt; tail -30 $O/$name.txt;
  tar czf $OUT/results.tgz -C /tmp res; cp $O/log.txt $OUT/; }
M=plain,prompt-lookup,lookahead,recycling,medusa,eagle@chain,eagle@dynamic
run probe-bf16 40 $S probe --model smollm2-135m --dtype bf16 --device cuda
run hef-bf16 130 $S bench --model smollm2-135m --device cuda --dtype bf16 --prompts humanevalfix --limit 6 --max-new-tokens $N \
  --methods $M --compare-hf --no-progress --out $O/hef-bf16
run hef-fp32 100 $S bench --model smollm2-135m --device cuda --dtype fp32 --prompts humanevalfix --limit 6 --max-new-tokens $N \
  --methods $M --compare-hf --no-progress --out $O/hef-fp32
run hef-bf16-n16 70 $S bench --model smollm2-135m --device cuda --dtype bf16 --prompts humanevalfix --limit 6 --max-new-tokens $N \
  --methods plain,recycling,medusa,eagle@dynamic --tree-nodes 16 --no-progress --out $O/hef-bf16-n16
run sb-bf16 90 $S bench --model smollm2-135m --device cuda --dtype bf16 --prompts spec-bench --limit 1 --max-new-tokens $N \
  --methods plain,prompt-lookup,lookahead,recycling,medusa,eagle@dynamic --compare-hf --no-progress --out $O/sb-bf16
cp -r $SPECDEC_HOME/probe $O/ 2>/dev/null
tar czf $OUT/results.tgz -C /tmp res
