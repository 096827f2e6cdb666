"""Copy a trained EAGLE head out of the device in pieces under 16 MiB (the device tool's file limit): the
safetensors split in two shards (`EagleHead.load` reads every *.safetensors of a folder), or, when the run
was cut short, the checkpoint's head weights. Usage: device_collect.py HEAD_DIR OUT_DIR"""

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

src, out = Path(sys.argv[1]), Path(sys.argv[2])
if (src / "config.json").exists():
    state = load_file(str(src / "model.safetensors"))
    shutil.copy(src / "config.json", out / "config.json")
else:
    ck = torch.load(src / "checkpoint.pt", map_location="cpu", weights_only=False)
    state = {k: (v.half() if v.is_floating_point() else v) for k, v in ck["head"].items()}
    torch.save({"state": ck["state"], "settings": ck["settings"]}, out / "checkpoint_state.pt")
names = sorted(state)
big = [n for n in names if n.startswith("lm_head")]
save_file({n: state[n].contiguous() for n in big}, str(out / "model-lm_head.safetensors"))
save_file({n: state[n].contiguous() for n in names if n not in big}, str(out / "model-layer.safetensors"))
print("collected", [p.name for p in out.iterdir()])
