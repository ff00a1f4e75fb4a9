"""Rows are counted as transformers counts them (AutoTokenizer with apply_chat_template), though
without importing torch: the demo model's chats, preference rows and text, in several scripts,
and the template's special tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.errors import Invalid
from finetune.token_count import special_tokens, token_counter

ROWS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "What is the code for item 7?"},
                  {"role": "assistant", "content": "The code for item 7 is ZEBRA."}]},
    {"messages": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Bonjour ?"},
                  {"role": "assistant", "content": "Bonjour ! Ça va très bien, merci."},
                  {"role": "user", "content": "Et toi ?"}, {"role": "assistant", "content": "日本語も少し。"}]},
    {"prompt": [{"role": "user", "content": "Best fruit?"}], "chosen": [{"role": "assistant", "content": "Mango."}],
     "rejected": [{"role": "assistant", "content": "None, fruit is overrated and I will not say more on it."}]},
    {"text": "Plain text, with <|im_start|> written in it and ünïcödé."},
]


@pytest.fixture(scope="module")
def reference(demo_model: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model, local_files_only=True)

    def count(example: dict[str, Any]) -> int:
        if "messages" in example:
            return len(tokenizer.apply_chat_template(example["messages"], tokenize=True, return_dict=False))
        if "chosen" in example:
            return max(len(tokenizer.apply_chat_template(example["prompt"] + example[side], tokenize=True,
                                                         return_dict=False)) for side in ("chosen", "rejected"))
        return len(tokenizer(example["text"]).input_ids)

    return count


@pytest.mark.parametrize("row", ROWS, ids=["chat", "multi-turn", "preference", "text"])
def test_each_kind_of_row_counts_as_transformers_counts_it(demo_model: Path, reference: Any,
                                                            row: dict[str, Any]) -> None:
    assert token_counter(demo_model)(row) == reference(row)


@settings(max_examples=40, deadline=None)
@given(user=st.text(max_size=80), answer=st.text(max_size=80))
def test_any_text_in_a_chat_counts_as_transformers_counts_it(demo_model: Path, reference: Any, user: str,
                                                             answer: str) -> None:
    row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
    assert token_counter(demo_model)(row) == reference(row)


def test_special_tokens_are_read_as_strings_or_added_tokens() -> None:
    found = special_tokens({"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "pad_token": None,
                            "additional_special_tokens": [{"content": "<x>"}, "<y>"], "unk_token": 3})
    assert found == {"bos_token": "<s>", "eos_token": "</s>", "additional_special_tokens": ["<x>", "<y>"]}


def test_a_directory_without_a_tokenizer_or_a_template_is_said(tmp_path: Path, demo_model: Path) -> None:
    with pytest.raises(Invalid, match="no tokenizer to measure rows with"):
        token_counter(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((demo_model / "tokenizer.json").read_bytes())
    count = token_counter(tmp_path)
    assert count({"text": "hello"}) > 0
    with pytest.raises(Invalid, match="no chat template"):
        count({"messages": [{"role": "user", "content": "hi"}]})
