"""`specdec export eagle`: write a model's EAGLE-3 head in the layout vLLM and SGLang load.

    specdec export eagle --model smollm2-135m --out smollm2-eagle3/     # the head --method eagle would use
    specdec export eagle --model qwen2.5-coder-1.5b --heads my-head/ --out qwen-eagle3/

The folder holds config.json (architectures ["LlamaForCausalLMEagle3"], the target's layer widths,
draft_vocab_size, the aux layer ids as both loaders read them) and model.safetensors (fc, midlayer.*, norm,
lm_head, d2t, t2d; `specdec.drafters.eagle_head`). Serve it next to the same target, e.g. with vLLM:
    vllm serve HuggingFaceTB/SmolLM2-135M-Instruct \\
        --speculative-config '{"method": "eagle3", "model": "smollm2-eagle3", "num_speculative_tokens": 4}'
`--heads DIR` of `specdec generate --method eagle` reads the folder back.
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("export", help="export trained heads for other engines (EAGLE-3 for vLLM/SGLang)",
                       description="Write trained drafting heads in another engine's checkpoint layout.")
    kinds = p.add_subparsers(dest="kind", metavar="KIND")
    e = kinds.add_parser(
        "eagle", help="an EAGLE-3 head in the layout vLLM's and SGLang's llama_eagle3 loaders read",
        description="Write the EAGLE-3 head that `--method eagle` would use for --model (or the one in --heads) "
                    "as config.json + model.safetensors for vLLM (speculative method eagle3) and SGLang "
                    "(--speculative-algorithm EAGLE3). Refuses heads made for another target and EAGLE-1 heads "
                    "(one fused layer: not the EAGLE-3 layout).",
        epilog="Example: specdec export eagle --model smollm2-135m --out smollm2-eagle3/")
    e.add_argument("--model", default="smollm2-135m", help="the target model (default smollm2-135m)")
    e.add_argument("--heads", default=None, metavar="DIR",
                   help="the head to export (default: the store's for --model, else the one shipped with specdec)")
    e.add_argument("--out", required=True, metavar="DIR", help="output folder")
    e.set_defaults(func=run_eagle)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_eagle(args) -> int:
    from specdec.bench.report import check_out
    from specdec.drafters.eagle import find_head
    from specdec.errors import SpecdecError
    from specdec.runtime.config import ModelConfig
    from specdec.store import resolve

    from specdec.options import check_setup

    out = check_out(args.out, ("config.json", "model.safetensors"))  # a folder that takes files, before loading
    check_setup(heads=args.heads)
    again = (out / "config.json").exists()
    if again or (out / "model.safetensors").exists():
        import json

        try:
            there = json.loads((out / "config.json").read_text())
        except (OSError, ValueError):
            there = None
        if not (isinstance(there, dict) and "LlamaForCausalLMEagle3" in (there.get("architectures") or [])):
            raise SpecdecError(f"--out {out} holds another model or head (its config.json is not an EAGLE-3 "
                               "export): choose an empty folder, or a folder written by `specdec export eagle`")
    folder = resolve(args.model, pull=True)
    head = find_head(args.model, folder, ModelConfig.from_folder(folder), args.heads)
    if len(head.cfg.aux_layers) != 3:
        raise SpecdecError(f"this is an EAGLE-{head.cfg.version} head fusing {len(head.cfg.aux_layers)} layer(s); "
                           "vLLM and SGLang load EAGLE-3 heads (3 layers): train one with "
                           f"`specdec train eagle --model {args.model} --version 3`")
    try:
        out = head.save(out)
    except OSError as e:
        raise SpecdecError(f"--out {out}: cannot write there ({e.strerror or e}): choose another folder") from None
    print(f"wrote {out}/config.json and model.safetensors (EAGLE-3, aux layers {list(head.cfg.aux_layers)}, "
          f"draft vocabulary {head.cfg.draft_vocab_size})" + (", replacing the export that was there" if again else ""))
    return 0
