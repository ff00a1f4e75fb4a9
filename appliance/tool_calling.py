"""How a pool's engine serves OpenAI tool calling: vLLM's parser for the served model's family
(`--enable-auto-tool-choice --tool-call-parser NAME`), and for a ChatML model whose own template
cannot show tools (the demo model), a template that shows them in Hermes' format and otherwise
renders exactly as the model's own.

Families (config.json's `model_type`, where the model's own template shows tools), documented in
docs/serve/tools.md:
  qwen2, qwen2_moe, qwen3, qwen3_moe   -> hermes  (<tool_call>{...}</tool_call>)
  llama (3.1 and later)                -> llama3_json
  mistral, mixtral                     -> mistral
  deepseek_v3                          -> deepseek_v3 (kimi_k2 for Kimi K2's tokenizer)
  kimi_k2                              -> kimi_k2
  glm4_moe                             -> glm45
  gpt_oss                              -> openai
  granite                              -> granite
Any other: no automatic tool choice; `pools.NAME.tool_parser` names a parser. Named "hermes" for a
ChatML model whose template shows no tools (the demo model), the engine gets the appliance's ChatML
tool template too. (Not by default: a 135M model shown the tools starts copying their schemas.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from appliance.errors import Invalid, SettingsError

AUTO, NONE = "auto", "none"
ToolParser = Literal["hermes", "llama3_json", "mistral", "deepseek_v3", "kimi_k2", "glm45", "openai", "granite"]
PARSERS: tuple[str, ...] = get_args(ToolParser)
FAMILIES: dict[str, ToolParser] = {"qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
            "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral", "deepseek_v3": "deepseek_v3",
            "kimi_k2": "kimi_k2", "glm4_moe": "glm45", "gpt_oss": "openai", "granite": "granite"}
CHATML_START = "<|im_start|>"

# Shown in place of the model's own template when a request offers tools: Hermes' format, as
# Qwen2.5's template shows tools; a tool's result comes back inside <tool_response> in a user turn.
TOOLS_PART = Path(__file__).parent / "chatml_tools.jinja"


@dataclass(frozen=True)
class ToolCalling:
    """vLLM's parser for the pool's model, and the template to serve with (None: the model's own)."""

    parser: str
    template: str | None = None

    def args(self, template_file: Path) -> list[str]:
        """The engine's arguments; the template, where there is one, is read from `template_file`
        (the engine's launcher writes it there)."""
        found = ["--enable-auto-tool-choice", "--tool-call-parser", self.parser]
        return found + (["--chat-template", str(template_file)] if self.template is not None else [])


def tool_calling(model: Path, setting: str) -> ToolCalling | None:
    """What `pools.NAME.tool_parser` (auto, none or a parser's name) means for the checkpoint in
    `model`; None: no automatic tool choice."""
    if setting == NONE:
        return None
    own = _own_template(model) or ""
    if setting != AUTO:
        if setting not in PARSERS:
            raise SettingsError(f"tool_parser {setting!r}: one of auto, none, {', '.join(sorted(PARSERS))}")
        chatml = setting == "hermes" and CHATML_START in own and "tools" not in own
        return ToolCalling(setting, with_tools(own) if chatml else None)
    family = FAMILIES.get(str(_json(model / "config.json").get("model_type", "")))
    if family is not None and "tools" in own:  # its own template shows tools (SmolLM2 is a llama with ChatML)
        return ToolCalling(family)
    return None


def tool_template(model: Path) -> str:
    """The template a chat that offers tools is shown to `model` with, as its pool serves tool calls:
    its own where it shows tools (`tool_parser` auto), else the ChatML tool template where it is
    ChatML (`tool_parser = "hermes"`). Invalid for a model whose template can show neither."""
    own = _own_template(model) or ""
    if "tools" in own:
        return own
    if CHATML_START in own:
        return with_tools(own)
    raise Invalid(f"{model}: its chat template shows no tools and is not ChatML, so a chat that offers tools "
                  "cannot be rendered as its pool would serve it",
                  hint="give the model a chat template that shows tools (chat_template.jinja)")


def with_tools(own: str) -> str:
    """The model's own template for requests without tools; Hermes' tools part for those with."""
    return "{%- if tools -%}\n" + TOOLS_PART.read_text() + "{%- else -%}\n" + own + "\n{%- endif -%}\n"


def _own_template(model: Path) -> str | None:
    if (model / "chat_template.jinja").is_file():
        return (model / "chat_template.jinja").read_text()
    found = _json(model / "tokenizer_config.json").get("chat_template")
    return found if isinstance(found, str) else None


def _json(path: Path) -> dict[str, object]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
