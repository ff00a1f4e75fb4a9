"""A pool serves tool calling with vLLM's parser for its model's family; a ChatML model whose own
template cannot show tools gets one that shows them and otherwise renders as its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from appliance.errors import SettingsError
from appliance.tool_calling import tool_calling
from finetune.token_count import chat_template, special_tokens

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": CITY}}
CHATS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather?"}],
]


def render(template: str, messages: list[dict[str, object]], model: Path, **extra: object) -> str:
    config = json.loads((model / "tokenizer_config.json").read_text())
    rendered, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                        **special_tokens(config), **extra)  # type: ignore[arg-type]
    return str(rendered[0])


def checkpoint(tmp_path: Path, model_type: str, template: str = "{% if tools %}{{ tools }}{% endif %}") -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return tmp_path


@pytest.mark.parametrize(("model_type", "parser"), [("qwen3", "hermes"), ("qwen3_moe", "hermes"),
                                                     ("llama", "llama3_json"), ("deepseek_v3", "deepseek_v3"),
                                                     ("kimi_k2", "kimi_k2"), ("glm4_moe", "glm45"),
                                                     ("gpt_oss", "openai"), ("mistral", "mistral")])
def test_a_family_gets_its_parser_and_keeps_its_own_template(tmp_path: Path, model_type: str, parser: str) -> None:
    found = tool_calling(checkpoint(tmp_path, model_type), "auto")
    assert found is not None and found.parser == parser and found.template is None
    assert found.args(tmp_path / "t.jinja") == ["--enable-auto-tool-choice", "--tool-call-parser", parser]


def test_a_model_of_no_known_family_and_no_chatml_template_serves_no_automatic_choice(tmp_path: Path) -> None:
    assert tool_calling(checkpoint(tmp_path, "gpt2"), "auto") is None
    assert tool_calling(checkpoint(tmp_path, "llama", "{{ messages }}"), "auto") is None  # a template without tools
    assert tool_calling(checkpoint(tmp_path, "qwen3"), "none") is None
    assert tool_calling(checkpoint(tmp_path, "gpt2"), "hermes") is not None
    with pytest.raises(SettingsError, match="tool_parser 'hermes2': one of auto, none, deepseek_v3"):
        tool_calling(checkpoint(tmp_path, "gpt2"), "hermes2")


def test_the_demo_model_gets_a_template_that_shows_tools_and_otherwise_renders_as_its_own(demo_model: Path,
                                                                                           tmp_path: Path) -> None:
    assert tool_calling(demo_model, "auto") is None  # a ChatML template without tools: named only
    found = tool_calling(demo_model, "hermes")
    assert found is not None and found.parser == "hermes" and found.template is not None
    assert found.args(tmp_path / "t.jinja")[-2:] == ["--chat-template", str(tmp_path / "t.jinja")]
    own = chat_template(demo_model, json.loads((demo_model / "tokenizer_config.json").read_text()))
    assert own is not None
    for chat in CHATS:
        assert render(found.template, chat, demo_model) == render(own, chat, demo_model)
    asked = render(found.template, CHATS[1], demo_model, tools=[WEATHER])
    assert asked.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and json.dumps(WEATHER) in asked
    assert asked.count("Be brief.") == 1
    assert asked.endswith("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    turn = [*CHATS[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"}]
    looped = render(found.template, turn, demo_model, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in looped
    assert "<|im_start|>user\n<tool_response>\n12 C\n</tool_response><|im_end|>" in looped
