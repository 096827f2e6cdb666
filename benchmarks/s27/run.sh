#!/bin/bash
# Session 27 (AMD EPYC Zen 4, family 25 model 17; lscpu.txt): the commands behind BENCHMARKS.md "Session 27",
# one at a time with nothing else running.
set -e
B=benchmarks/s27
lscpu > $B/lscpu.txt
.venv/bin/specdec probe --model smollm2-135m | tee $B/probe-smollm2-135m-q4.txt
.venv/bin/specdec probe --model qwen2.5-coder-1.5b --dtype q4 | tee $B/probe-qwen2.5-coder-1.5b-q4.txt
# seeded sampling: deterministic drafts held to plain sampling's tokens ("tokens = plain"), transformers in the run
.venv/bin/specdec bench --model smollm2-135m --methods plain,prompt-lookup,recycling,lookahead,medusa,eagle \
    --prompts humanevalfix --limit 5 --max-new-tokens 128 --temperature 0.8 --top-k 50 --seed 1 --compare-hf \
    --no-progress --out $B/smollm2-humanevalfix-sampled
.venv/bin/specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,recycling,lookahead \
    --prompts humanevalfix --limit 3 --max-new-tokens 128 --temperature 0.8 --top-k 50 --seed 1 --compare-hf \
    --no-progress --out $B/qwen1.5b-humanevalfix-q4-sampled
# sampled decoding before (9f5414f, a worktree in /tmp/s27-base) and after this session's sampling, alternating
C="--model smollm2-135m --methods plain,prompt-lookup,recycling --prompts humanevalfix --limit 5 --max-new-tokens 128 --temperature 0.8 --seed 1 --no-progress"
git worktree add /tmp/s27-base 9f5414f
for r in 1 2 3; do
  (cd /tmp/s27-base && python -m specdec.cli bench $C --out /tmp/ab-base-$r > /dev/null 2>&1)
  grep "| code_edit" /tmp/ab-base-$r/results.md | cut -d'|' -f3,7,8,12 | tr '\n' ' '; echo " <- base $r"
  .venv/bin/python -m specdec.cli bench $C --out /tmp/ab-new-$r > /dev/null 2>&1
  grep "| code_edit" /tmp/ab-new-$r/results.md | cut -d'|' -f3,7,8,12 | tr '\n' ' '; echo " <- new $r"
done | tee $B/sampling-ab-smollm2.txt
git worktree remove --force /tmp/s27-base
.venv/bin/specdec serve --model smollm2-135m --port 8765 & sleep 20; .venv/bin/python benchmarks/s27/seeded_server.py | tee $B/seeded-server.txt; kill -INT %1
.venv/bin/python benchmarks/s27/eagle_chain_ab.py | tee $B/eagle-chain-ab.txt  # EAGLE's chain under sampling: drawn from q vs top-1
