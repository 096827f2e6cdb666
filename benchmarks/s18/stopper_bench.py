"""The Stopper's text over a long generation: push 8000 tokens of SmolLM2's tokenization of README.md one by one,
printing the cumulative seconds at 500, 2000, 4000 and 8000 tokens, and check the final text is a whole decode.
`--whole` decodes everything at every token (the code before session 18). Run from the repository root:
PYTHONPATH=. .venv/bin/python benchmarks/s18/stopper_bench.py [--whole]"""
import sys
import time

from specdec.decode import Request, Stopper
from specdec.store import model_dir
from specdec.tokenizer import Tokenizer

tok = Tokenizer(model_dir("smollm2-135m"))
ids = tok.encode(open("README.md").read(), chat=False)[:8000]
stopper = Stopper(tok, Request(max_new_tokens=len(ids) + 1))
stopper._whole = "--whole" in sys.argv
t, marks = time.perf_counter(), {}
for i, token in enumerate(ids):
    stopper.push(token)
    if i + 1 in (500, 2000, 4000, 8000):
        marks[i + 1] = round(time.perf_counter() - t, 3)
assert stopper.text == tok.decode(ids)
print(f"{'whole decodes' if stopper._whole else 'incremental'}: cumulative seconds at n tokens {marks}")
