"""Tiny random-weight Llama and Qwen2 models, built offline in milliseconds, saved as HF folders."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96


def hf_config(kind: str, vocab: int = VOCAB, **sizes):
    """`sizes` overrides the tiny sizes (hidden_size=128 gives head dims of 32, which the AMX attention path takes)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    common.update(sizes)
    if kind == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
    raise ValueError(kind)


def build_hf(kind: str, seed: int = 0, vocab: int = VOCAB, **sizes):
    """A random-weight transformers model in fp32, eval mode (weights scaled up so logits are peaky enough to be interesting)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, vocab, **sizes), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.15 if p.dim() == 2 else 0.02)
    return model.eval()


def save_tiny(kind: str, folder: Path, seed: int = 0, vocab: int = VOCAB, **sizes) -> Path:
    model = build_hf(kind, seed, vocab, **sizes)
    model.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder)
    return Path(folder)


CHARS = [chr(c) for c in range(32, 32 + VOCAB - 3)]  # printable ASCII, one token per character
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def save_tiny_tokenizer(folder: Path) -> None:
    """A character-level tokenizer over the tiny vocabulary: 0 <unk>, 1 <s>, 2 </s>, then 93 ASCII characters."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
