"""specdec: a speculative-decoding engine.

Draft, then verify: a cheap source proposes tokens, the target model checks them all in
one forward pass, and exact rejection sampling keeps its output distribution unchanged
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling").
"""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import specdec` stays cheap for the CLI
    if name == "LLM":
        from specdec.api import LLM

        return LLM
    if name in ("GenerationOptions", "LookaheadConfig"):
        from specdec import options

        return getattr(options, name)
    if name == "SpecdecError":
        from specdec.errors import SpecdecError

        return SpecdecError
    raise AttributeError(name)
