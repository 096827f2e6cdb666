"""specdec.tokenizer on the tiny character-level tokenizer: EOS ids, the chat wrapping, special tokens in decode."""

from __future__ import annotations

import json

import pytest

from specdec.errors import SpecdecError
from specdec.tokenizer import Tokenizer
from tests.tiny import save_tiny_tokenizer


@pytest.fixture
def folder(tmp_path):
    save_tiny_tokenizer(tmp_path)
    return tmp_path


def _config(folder, **changes):
    path = folder / "tokenizer_config.json"
    tc = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            tc.pop(k, None)
        else:
            tc[k] = v
    path.write_text(json.dumps(tc))


@pytest.mark.parametrize("gen, want", [(None, {2}), ([2, 5], {2, 5}), (7, {2, 7}), ([], {2})])
def test_eos_ids_are_the_tokenizers_and_the_generation_configs(folder, gen, want):
    """EOS ids: the tokenizer's eos token plus generation_config.json's eos_token_id (an int or a list)."""
    if gen is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": gen}))
    assert Tokenizer(folder).eos_ids == frozenset(want)


def test_chat_is_the_default_and_ends_with_the_generation_prompt(folder):
    """With a template, encode wraps the text as a user turn plus the assistant's generation prompt, no BOS on top."""
    tok = Tokenizer(folder)
    ids = tok.encode("hi")
    assert ids == tok.encode("hi", chat=True) != tok.encode("hi", chat=False)
    assert tok.decode(ids) == "<user>hi<assistant>" and 1 not in ids


def test_a_chat_prompt_gets_no_bos_beyond_the_templates(folder):
    """A tokenizer that adds BOS to raw text does not add it again to a rendered chat template."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.processors import TemplateProcessing

    raw = RawTokenizer.from_file(str(folder / "tokenizer.json"))
    raw.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw.save(str(folder / "tokenizer.json"))
    tok = Tokenizer(folder)
    assert tok.encode("hi", chat=False)[0] == 1
    assert 1 not in tok.encode("hi", chat=True)


def test_chat_without_a_template_is_one_clear_error(folder):
    """No chat template: chat=True says to use --no-chat; the default is raw text."""
    _config(folder, chat_template=None)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok = Tokenizer(folder)
    assert not tok.has_chat_template and tok.decode(tok.encode("hi")) == "hi"
    with pytest.raises(SpecdecError, match="no chat template: use --no-chat"):
        tok.encode("hi", chat=True)


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_drops_special_tokens(folder, clean_up):
    """Decoded text has no <s> or </s>, through the Rust decoder and through transformers' (clean-up) decode."""
    _config(folder, clean_up_tokenization_spaces=clean_up)
    tok = Tokenizer(folder)
    assert (tok._decoder is None) == clean_up == tok.cleans_up_spaces
    assert tok.decode([1] + tok.encode("ab", chat=False) + [2]) == "ab"
