"""Benchmarks: prompt sets (prompts.py), runners for our methods and transformers' (runner.py),
and reports (report.py). `specdec bench` (specdec/commands/bench.py) ties them together:

    specdec bench --model smollm2-135m --methods plain,prompt-lookup --prompts humanevalfix \\
        --limit 5 --compare-hf --out benchmarks/smollm2-humanevalfix
"""

from specdec.bench.prompts import BenchPrompt, load_prompts, resolve_prompts
from specdec.bench.report import markdown_table, summarize, write_outputs
from specdec.bench.runner import BenchSettings, hf_methods, our_methods, parse_methods, run_bench

__all__ = ["BenchPrompt", "BenchSettings", "hf_methods", "load_prompts", "markdown_table", "our_methods",
           "parse_methods", "resolve_prompts", "run_bench", "summarize", "write_outputs"]
