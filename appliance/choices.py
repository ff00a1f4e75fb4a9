"""How many answers a completion or chat request asks the engine for: the one rule the gateway's
admission and the batch-worker's validation share (vLLM's engine has no `best_of`)."""

from __future__ import annotations


def prompt_count(prompt: object) -> int:
    """A completion's `prompt`: a list of strings, or of token-id lists, is that many prompts; a
    string, or one list of token ids, is one (a chat request is one prompt)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1
