#!/bin/bash
# Session 31, second device call: assemble SmolLM2's GGUF, convert it into the store as smollm2-135m (so the shipped
# Medusa and EAGLE heads are found by name), then probe and bench it on the GPU (bf16 and fp32), HF generate beside.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECDEC_HOME=${SPECDEC_HOME:-/tmp/home}
D=${D:-cuda}; N=${N:-128}; L=${L:-6}; O=/tmp/res; mkdir -p $O
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
  timeout $limit "$@" > $O/$name.txt 2> >(tr '\r' '\n' | grep -v "^\s*$" | tail -5 > $O/$name.err); echo "rc $? ($(($(date +%s) - t)) s)" | tee -a $O/log.txt; cat $O/$name.txt | tail -30; }
run probe-bf16 60 $S probe --model smollm2-135m --dtype bf16 --device $D
run hef-bf16 150 $S bench --model smollm2-135m --device $D --dtype bf16 --prompts humanevalfix --limit $L --max-new-tokens $N \
  --methods plain,prompt-lookup,lookahead,recycling,medusa,eagle@chain,eagle@dynamic --compare-hf --no-progress --out $O/hef-bf16
run sb-bf16 100 $S bench --model smollm2-135m --device $D --dtype bf16 --prompts spec-bench --limit 1 --max-new-tokens $N \
  --methods plain,prompt-lookup,lookahead,recycling,medusa,eagle@dynamic --compare-hf --no-progress --out $O/sb-bf16
run probe-fp32 40 $S probe --model smollm2-135m --dtype fp32 --device $D
run hef-fp32 70 $S bench --model smollm2-135m --device $D --dtype fp32 --prompts humanevalfix --limit $((L - 2)) --max-new-tokens $N \
  --methods plain,prompt-lookup,lookahead,recycling,medusa,eagle@dynamic --no-progress --out $O/hef-fp32
cp -r $SPECDEC_HOME/probe $O/ 2>/dev/null
tar czf $OUT/results.tgz -C /tmp res
cp $O/log.txt $OUT/
