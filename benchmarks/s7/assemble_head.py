"""Assemble the EAGLE-3 head trained on the lent GPU (session 7) from the pieces the device returned: the head
weights (two safetensors shards, fp16) and the checkpoint's training state, into the shipped folder.
The run was cut by the device budget at step 484 of 702 (Ctrl-C checkpoint), so the config is built here.
The last α point is this CPU's measure of the final head on held-out prompts (`eval_alpha.py`, its JSON).
Usage: assemble_head.py DEVICE_FILES EVAL_JSON OUT_DIR"""

import json

import sys
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdec.drafters.eagle_head import EagleConfig, EagleHead
from specdec.runtime.config import ModelConfig
from specdec.store import resolve
from specdec.training.eagle import TrainSettings, coverage_table  # noqa: F401 - the settings' shape
from specdec.training.heads import fingerprint

src, local, out = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
folder = resolve("smollm2-135m")
state = {**load_file(str(src / "model-layer.safetensors")), **load_file(str(src / "model-lm_head.safetensors"))}
ck = torch.load(src / "checkpoint_state.pt", weights_only=False)
s = TrainSettings(**ck["settings"])
cfg = EagleConfig.for_target(ModelConfig.from_folder(folder), "smollm2-135m", fingerprint(folder), version=3,
                             draft_vocab_size=s.draft_vocab)
head = EagleHead(cfg)
head.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in state.items()})
st = ck["state"]
device_set = "held-out 5% of the GPU run's self-distilled documents (bf16 features)"
history = [{**h, "set": device_set} for h in st["history"]]
history.append({"step": st["step"], "tokens_seen": st["tokens"], **local["fp32"],
                "set": f"{local['documents']} held-out ShareGPT prompts answered on this CPU ({local['tokens']} "
                       f"tokens, fp32 features; q4 features: {local['q4']['alpha']})"})
cfg.training = {
    **asdict(s), "objective": "direct next-token CE, training-time test",
    "steps": st["step"], "planned_steps": 702, "seconds": round(st["seconds"], 1), "tokens": 4_000_000,
    "device": "cuda (one NVIDIA H200, session 7); cut at step 484 of 702 by the device budget",
    "final_loss": st["loss"], "final_train_accuracy": [round(a, 4) for a in st["acc"]],
    "val": history[-1], "history": history,
    "data": {"sources": ["ShareGPT V3 user turns (benchmarks/s7/device_prompts.py)"], "max_len": 512,
             "regenerate": "greedy, first user turn: the target's own answers"},
}
head.half().save(out)
print(f"{out}: {sum(v.numel() for v in state.values()):,} values, val alpha {history[-1]['alpha']}")
