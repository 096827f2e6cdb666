"""Validation α per draft position of an EAGLE head on held-out self-distilled data, measured on this CPU:
the target (fp32) answers ShareGPT user turns the GPU run never read (the tail of the prompt file), then
the head is scored on features from the fp32 target and from the q4 runtime (what `--dtype q4` drafts on).
Usage: eval_alpha.py PROMPTS.jsonl.gz FIRST_PROMPT TOKENS [HEAD_DIR]"""

import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

from specdec.drafters.eagle_head import EagleHead
from specdec.runtime.loader import load_transformer
from specdec.store import resolve
from specdec.tokenizer import Tokenizer
from specdec.training import corpus, hidden_cache
from specdec.training.eagle import Documents, TrainSettings, Trainer
from specdec.training.heads import SHIPPED
from specdec.training.regenerate import first_turn_prompts, regenerate

prompts_file, first, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
head = EagleHead.load(sys.argv[4] if len(sys.argv) > 4 else SHIPPED / "smollm2-135m" / "eagle").float().eval()
folder = resolve("smollm2-135m")
tok, fp32 = Tokenizer(folder), load_transformer(folder, torch.float32)
docs = itertools.islice(corpus.file_documents([prompts_file]), first, None)
answers = list(regenerate(fp32, first_turn_prompts(docs, tok, 1024), 512, set(tok.eos_ids), 8, tokens))
layers = head.cfg.aux_layers
s = TrainSettings(val_fraction=1.0, batch_tokens=4096)
report = {"prompts_from": first, "documents": len(answers), "tokens": sum(map(len, answers))}
with tempfile.TemporaryDirectory() as tmp:
    for dtype in ("fp32", "q4"):
        model = fp32 if dtype == "fp32" else load_transformer(folder, "q4")
        cache = hidden_cache.build(model, iter(answers), Path(tmp) / dtype, 10**9, {"d": dtype}, progress=False,
                                   layers=layers)
        spans = Documents(cache, 0.5).spans
        report[dtype] = Trainer(head, fp32.embed.weight.detach().float(), cache, s).evaluate(spans)
print(json.dumps(report, indent=1))
