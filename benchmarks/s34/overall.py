"""Overall tok/s and ratios over every category of a `specdec bench` results.json: python overall.py DIR"""
import json, sys
from collections import defaultdict
recs = json.load(open(sys.argv[1] + "/results.json"))["records"]
tok, sec = defaultdict(int), defaultdict(float)
for r in recs:
    tok[r["method"]] += r["new_tokens"]; sec[r["method"]] += r["seconds"]
base = {m: tok[m] / sec[m] for m in tok}
for m in tok:
    line = f"{m:24s} {tok[m]:5d} tokens {sec[m]:7.1f} s {base[m]:6.1f} tok/s  x plain {sec['plain'] / sec[m]:.2f} (wall time)"
    if "llamacpp-plain" in tok:
        line += f"  x llama.cpp plain {base[m] / base['llamacpp-plain']:.2f} (tok/s)"
    print(line)
