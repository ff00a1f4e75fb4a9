"""How a dataset row becomes what a trainer learns from, for both trainers (TRL's, one process or
DDP, and the sharded one): its input ids and their labels, IGNORED where nothing is learned.

- A chat: the model's chat template applied; the last assistant turn is learned, the turns before
  it are its context (as TRL's prompt/completion rows have it).
- A chat that offers tools (an agent's episode, finetune.tool_rows): shown with its tools in the
  template its pool serves tool calls with (appliance.tool_calling.tool_template), and every
  assistant turn is learned, its text and its calls; the system, user and tool turns are not (a
  tool's output is the world's answer, not the model's).
- Text: every token, and the end-of-sequence token after it.

A turn's tokens are those the template adds for it after the context before it, as the engine
would prompt the model there (the generation prompt); a template that renders a chat's start
differently once more turns follow cannot be learned from this way, and says so. Rows are cut at
max_length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance.errors import Invalid
from appliance.tool_calling import tool_template

IGNORED = -100  # a label that is not trained on
Tokens = tuple[list[int], list[int]]  # input ids, labels


def token_rows(tokenizer: Any, base: Path, rows: list[dict[str, Any]], max_length: int) -> list[Tokens]:
    """(input ids, labels) of each SFT row of a dataset for the model in `base`."""
    template = tool_template(base) if any("tools" in row for row in rows) else None
    found = [(ids[:max_length], labels[:max_length])
             for ids, labels in (_row(tokenizer, row, template) for row in rows)]
    if empty := sum(all(label == IGNORED for label in labels) for _, labels in found):
        raise Invalid(f"{empty} of {len(rows)} rows have nothing to learn within their first {max_length} tokens "
                      "(the answers come after them), so they would train nothing",
                      hint="raise --max-length, or shorten what comes before the answers")
    return found


def _row(tokenizer: Any, row: dict[str, Any], template: str | None) -> Tokens:
    if "text" in row:
        ids = tokenizer(row["text"]).input_ids
        if tokenizer.eos_token_id is not None:
            ids = [*ids, tokenizer.eos_token_id]
        return ids, list(ids)
    messages, tools = row["messages"], row.get("tools")
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    learned = assistant if tools else assistant[-1:]

    def rendered(turns: list[dict[str, Any]], prompt: bool) -> list[int]:
        found: list[int] = tokenizer.apply_chat_template(
            turns, tools=tools, chat_template=template if tools else None, tokenize=True,
            add_generation_prompt=prompt, return_dict=False)
        return found

    ids = rendered(messages[:learned[-1] + 1], False)
    labels = [IGNORED] * len(ids)
    for i in learned:
        context, through = rendered(messages[:i], True), rendered(messages[:i + 1], False)
        if through[:len(context)] != context or ids[:len(through)] != through:
            raise Invalid(f"the chat template renders the turns before assistant turn {i + 1} differently once it "
                          "follows them, so that turn's tokens cannot be told from its context")
        labels[len(context):len(through)] = ids[len(context):len(through)]
    return ids, labels

