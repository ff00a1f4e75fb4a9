"""A dataset row's tokens as the model will see them (its chat template applied to chats), counted
without loading transformers' models and torch: the model's fast tokenizer (`tokenizer.json`,
the `tokenizers` library) and its chat template rendered by transformers' own renderer with the
special tokens its tokenizer configuration names, as `apply_chat_template` does. `data add` spent
about 10 s of its 12 importing AutoTokenizer (torch with it); this starts in about a second.

A checkpoint without `tokenizer.json` (a slow, sentencepiece-only tokenizer) is counted through
AutoTokenizer, which converts it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from appliance.errors import Invalid
from appliance.tool_calling import tool_template

Counter = Callable[[dict[str, Any]], int]
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def token_counter(model_dir: Path) -> Counter:
    """Tokens of a row (chat, preference or text) as `model_dir`'s tokenizer and template make them."""
    config_file, tokenizer_file = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if not config_file.is_file() and not tokenizer_file.is_file():
        raise Invalid(f"{model_dir}: no tokenizer to measure rows with",
                      hint="give --model a checkpoint directory with its tokenizer")
    if not tokenizer_file.is_file():
        return _through_transformers(model_dir)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = chat_template(model_dir, config)
    special = special_tokens(config)

    def chat_tokens(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> int:
        from transformers.utils.chat_template_utils import render_jinja_template

        if template is None:
            raise Invalid(f"{model_dir}: no chat template to apply to chat rows",
                          hint="import the rows as text, or give --model a chat model")
        rendered, _ = render_jinja_template(  # type: ignore[str-unpack]  # annotated str; returns (list, indices)
            [messages], tools=tools, chat_template=tool_template(model_dir) if tools else template, **special)
        return len(tokenizer.encode(rendered[0], add_special_tokens=False).ids)

    def count(example: dict[str, Any]) -> int:
        if "messages" in example:
            return chat_tokens(example["messages"], example.get("tools"))
        if "chosen" in example:  # the prompt with the longer of its two answers
            return max(chat_tokens(example["prompt"] + example[side]) for side in ("chosen", "rejected"))
        return len(tokenizer.encode(example["text"]).ids)

    return count


def longest_row(model_dir: Path, splits: Iterable[bytes]) -> int:
    """Tokens of the longest row of JSON-lines splits as `model_dir`'s tokenizer makes them: the
    widest a batch of them is padded to, which sizes a training job's activations."""
    count = token_counter(model_dir)
    return max((count(json.loads(line)) for split in splits for line in split.splitlines() if line.strip()),
               default=1)


def chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """The template transformers would use: chat_template.jinja, else the configuration's (its
    `default` where it names several)."""
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    found = config.get("chat_template")
    if isinstance(found, list):
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    return found if isinstance(found, str) else None


def special_tokens(config: dict[str, Any]) -> dict[str, Any]:
    """The special tokens a template may name (`bos_token` ...), as the tokenizer's configuration
    gives them: a string, or an added token's `content`."""
    found: dict[str, Any] = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        found["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    return found


def _through_transformers(model_dir: Path) -> Counter:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    def count(example: dict[str, Any]) -> int:
        if "messages" in example:
            tools = example.get("tools")
            return len(tokenizer.apply_chat_template(example["messages"], tools=tools, tokenize=True, return_dict=False,
                                                     chat_template=tool_template(model_dir) if tools else None))
        if "chosen" in example:
            return max(len(tokenizer.apply_chat_template(example["prompt"] + example[side], tokenize=True,
                                                         return_dict=False))
                       for side in ("chosen", "rejected"))
        return len(tokenizer(example["text"]).input_ids)

    return count
