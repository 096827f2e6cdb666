"""Write ShareGPT's user turns, each as a one-turn conversation, as a gzipped jsonl (`--data` for `specdec train ... --regenerate` on a
machine without the dataset package): `python benchmarks/s7/device_prompts.py OUT.jsonl.gz [N]`."""

import gzip
import json
import sys

from specdec.training.corpus import sharegpt_conversations

out, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40000
seen, rows = set(), []
for msgs in sharegpt_conversations():
    for turn in msgs:
        if turn["role"] != "user" or len(turn["content"]) > 1500 or turn["content"] in seen:
            continue
        seen.add(turn["content"])
        rows.append(json.dumps({"messages": [turn]}, ensure_ascii=False))
    if len(rows) >= n:
        break
with gzip.open(out, "wt", encoding="utf-8") as f:
    f.write("\n".join(rows))
print(f"{len(rows)} prompts -> {out}")
