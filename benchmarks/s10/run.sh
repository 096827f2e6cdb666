#!/bin/bash
# Session 10 benchmarks (AMD Zen 4, 2 vCPU): token recycling against prompt lookup and lookahead, with llama.cpp
# on the same file. Run on a quiet machine, sequentially, from the repository root: bash benchmarks/s10/run.sh
# Needs: specdec pull qwen2.5-coder-1.5b smollm2-135m; pip install -e '.[compare]'
set -x
export PATH=$PWD/.venv/bin:$PATH
O=benchmarks/s10; mkdir -p $O
lscpu > $O/lscpu.txt
# #14: our q4 methods against llama.cpp's plain decoding on the same GGUF, HumanEvalFix dev x5
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,lookahead,recycling \
  --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-humanevalfix > $O/qwen1.5b-humanevalfix.log 2>&1
# (after recycling's lookup order: a lookup matching 2+ tokens first, a 1-token match after the recycled paths)
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,lookahead,recycling \
  --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-humanevalfix-2 > $O/qwen1.5b-humanevalfix-2.log 2>&1
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,recycling \
  --prompts spec-bench --limit 1 --max-new-tokens 64 --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-specbench > $O/qwen1.5b-specbench.log 2>&1
specdec bench --model smollm2-135m --methods plain,prompt-lookup,recycling,eagle \
  --prompts spec-bench --limit 1 --max-new-tokens 128 --no-progress --out $O/smollm2-specbench > $O/smollm2-specbench.log 2>&1
# (final: a recurring text's lookup chain goes k deep, past the tree's N nodes) #14 again, twice; Spec-Bench; SmolLM2
for i in 3 4; do
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,lookahead,recycling \
  --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-humanevalfix-$i > $O/qwen1.5b-humanevalfix-$i.log 2>&1
done
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,recycling \
  --prompts spec-bench --limit 1 --max-new-tokens 64 --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-specbench-2 > $O/qwen1.5b-specbench-2.log 2>&1
specdec bench --model smollm2-135m --methods plain,prompt-lookup,recycling,eagle \
  --prompts spec-bench --limit 1 --max-new-tokens 128 --no-progress --out $O/smollm2-specbench-2 > $O/smollm2-specbench-2.log 2>&1
# #14's full run: our q4 methods, our bf16 and q8 plain, transformers bf16 and llama.cpp on the same file, one run
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --plain-dtypes bf16,q8 --methods plain,prompt-lookup,lookahead,recycling \
  --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-hf --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-humanevalfix-all > $O/qwen1.5b-humanevalfix-all.log 2>&1
# the offline replay of recycling's design choices (tokens per forward, nothing timed)
python benchmarks/s10/recycling_replay.py 20 > $O/recycling-replay.txt 2> $O/recycling-replay.log
# Spec-Bench in one run: our q4 methods, our bf16 and q8 plain, transformers bf16 and llama.cpp
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --plain-dtypes bf16,q8 --methods plain,prompt-lookup,recycling \
  --prompts spec-bench --limit 1 --max-new-tokens 64 --compare-hf --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-specbench-all > $O/qwen1.5b-specbench-all.log 2>&1
# #14 once more on the final code (run 5)
specdec bench --model qwen2.5-coder-1.5b --dtype q4 --methods plain,prompt-lookup,lookahead,recycling \
  --prompts humanevalfix --limit 5 --max-new-tokens 128 --compare-llamacpp \
  --no-progress --out $O/qwen1.5b-humanevalfix-5 > $O/qwen1.5b-humanevalfix-5.log 2>&1
