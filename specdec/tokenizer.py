"""Text <-> token ids for a model folder, chat templates, and incremental detokenization for streaming."""

from __future__ import annotations

from pathlib import Path

from specdec.errors import SpecdecError
from specdec.runtime.config import read_json


class Tokenizer:
    def __init__(self, folder: str | Path):
        from transformers import AutoTokenizer

        folder = Path(folder)
        try:
            self.hf = AutoTokenizer.from_pretrained(folder)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds, some over several lines
            raise SpecdecError(f"{folder}: cannot load the tokenizer ({' '.join(str(e).split())})") from None
        self.eos_ids = self._eos_ids(folder)
        # the Rust tokenizer decodes as transformers' `decode` does where that adds no clean-up, without its Python
        # layers: a stream decodes twice a token, each call a few microseconds warm and tens after a forward
        self._decoder = (self.hf.backend_tokenizer if getattr(self.hf, "is_fast", False)
                         and not getattr(self.hf, "clean_up_tokenization_spaces", True) else None)
        # transformers' clean-up (" ." -> ".", " 'm" -> "'m") may drop a space a later token follows: a stream
        # holds back the last characters' spaces (`Stopper.new_text`)
        self.cleans_up_spaces = self._decoder is None and bool(getattr(self.hf, "clean_up_tokenization_spaces", False))

    def _eos_ids(self, folder: Path) -> frozenset[int]:
        ids = set()
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        gen = folder / "generation_config.json"
        if gen.exists():
            eos = read_json(gen).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return frozenset(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt; `chat` (default: when the model has a chat template) wraps it as one
        user turn followed by the assistant's generation prompt."""
        if chat is None:
            chat = self.has_chat_template
        if chat:
            if not self.has_chat_template:
                raise SpecdecError("this model has no chat template: use --no-chat")
            text = self.hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
            return self.hf.encode(text, add_special_tokens=False)
        return self.hf.encode(text)

    def decode(self, ids: list[int]) -> str:
        if self._decoder is not None:
            return self._decoder.decode(ids, skip_special_tokens=True)
        return self.hf.decode(ids, skip_special_tokens=True)
