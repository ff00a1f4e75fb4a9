"""Training rows that offer tools (finetune.tool_rows): normalised as OpenAI's chat format has them,
every call checked against its function's schema as the gateway checks a model's calls, and every
bad row refused naming its line, turn and call; scanned for sensitive data in calls and results
too. Their tokens (finetune.chat_tokens): every assistant turn learned (its text and calls) and
nothing else, in the template the pool serves tool calls with, counted at import as trained.
Episodes that passed export as such rows (`rl episodes export`), each the conversation the driver
asked with."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from appliance import cli
from appliance.artifacts import artifact_store
from appliance.errors import Invalid
from appliance.home import Home
from appliance.rl import episodes
from appliance.rl.episodes import Episode, ToolStep, Turn, conversation
from appliance.settings import ComplianceSettings, Settings
from appliance.tool_calling import tool_calling, tool_template
from finetune.chat_tokens import IGNORED, token_rows
from finetune.datasets import Row, normalise, read, scan
from finetune.rl.agent import SYSTEM
from finetune.rl.environment import TOOL_SCHEMAS
from finetune.token_count import token_counter
from finetune.tool_rows import tool_chat
from tests.support.models import tiny_llama

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 20}}, "required": ["path"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "submit", "parameters": {"type": "object", "properties": {}}}}]
MARK = "TOOL-OUTPUT-NEVER-LEARNED"


def call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    return {**({"id": call_id} if call_id else {}), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def chat(**changes: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You fix code."}, {"role": "user", "content": "Fix calc.py."},
                {"role": "assistant", "content": "Reading it.", "tool_calls": [call("read_file", '{"path": "calc.py"}',
                                                                                      "c1")]},
                {"role": "tool", "tool_call_id": "c1", "content": f"def add(a, b): return a - b  # {MARK}"},
                {"role": "assistant", "content": None, "tool_calls": [call("submit", {})]},
                {"role": "tool", "content": f"submitted {MARK}"},
                {"role": "assistant", "content": "Fixed."}]
    return {"messages": messages, "tools": TOOLS, **changes}


def test_a_row_is_normalised_as_openai_s_format_has_it() -> None:
    row = normalise(chat())
    assistant = [m for m in row["messages"] if m["role"] == "assistant"]
    assert assistant[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_4_0", "type": "function", "function": {"name": "submit", "arguments": "{}"}}]}
    assert [m.get("tool_call_id") for m in row["messages"] if m["role"] == "tool"] == ["c1", "call_4_0"]
    assert row["tools"][1] == {"type": "function", "function": {"name": "submit", "parameters": {
        "type": "object", "properties": {}}}}
    assert normalise(json.loads(json.dumps(row))) == row  # stored and read again: the same


def with_message(index: int, message: Any) -> dict[str, Any]:
    row = chat()
    row["messages"][index] = message
    return row


BAD = [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": []},
     "'tools' must be a non-empty list"),
    (chat(tools={"type": "function"}), "'tools' must be a non-empty list"),
    (chat(tools=[TOOLS[0]] * 65), "over 64"),
    (chat(tools=[TOOLS[0], TOOLS[0]]), "tools[1].function.name: a second function named 'read_file'"),
    (chat(tools=[{"type": "function", "function": {"name": "read\u2010file"}}]), "tools[0].function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "read\nfile"}}]), "tools[0].function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "x" * 65}}]), "tools[0].function.name"),
    (chat(tools=[{"type": "code", "function": {"name": "x"}}]), "tools[0]: must be"),
    (chat(tools=[{"type": "function", "function": {"name": "x", "parameters": {"patternProperties": {}}}}]),
     "tools[0].function.parameters: patternProperties is not supported"),
    (chat(tools=[{"type": "function", "function": {"name": "x", "parameters": {"$ref": "http://x/s.json"}}}]),
     "may refer only inside itself"),
    (chat(tools=[{"type": "function", "function": {"name": "x", "description": ["a"]}}]), "description: must be text"),
    (with_message(2, {"role": "assistant", "tool_calls": [call("rm_rf", "{}")]}),
     "message 3: tool call 1: names 'rm_rf', which is not among the row's tools"),
    (with_message(2, {"role": "assistant", "tool_calls": [call("read_file", '{"path": ')]}),
     "message 3: tool call 1 (read_file): its arguments are not JSON"),
    (with_message(2, {"role": "assistant", "tool_calls": [call("read_file", '{"path": "a", "path": "b"}')]}),
     "an object with a key twice"),
    (with_message(2, {"role": "assistant", "tool_calls": [call("read_file", '{"path": NaN}')]}), "not JSON"),
    (with_message(2, {"role": "assistant", "tool_calls": [call("read_file", '{"path": "' + "a" * 21 + '"}')]}),
     "do not match the schema of read_file: at $.path: fails maxLength 20"),
    (with_message(2, {"role": "assistant", "tool_calls": [call("read_file", "[1]")]}), "not a JSON object"),
    (with_message(2, {"role": "assistant", "tool_calls": []}), "tool_calls must be a non-empty list"),
    (with_message(2, {"role": "assistant", "tool_calls": [call("submit", "{}", "x" * 201)]}), "id must be text"),
    (with_message(2, {"role": "assistant", "content": 5, "tool_calls": [call("submit", "{}")]}),
     "content must be text or null"),
    (with_message(3, {"role": "tool", "tool_call_id": "c9", "content": "x"}),
     "message 4: tool_call_id 'c9' names no unanswered call"),
    (with_message(3, {"role": "tool", "tool_call_id": "c1", "content": ["x"]}), "content must be text"),
    (with_message(1, {"role": "tool", "content": "x"}), "message 2: a tool result with no call before it"),
    (with_message(1, {"role": "function", "content": "x"}), "role 'function' is not one of"),
    (with_message(2, {"role": "system", "content": "x"}), "a system message may only come first"),
    (with_message(0, {"role": "assistant", "content": "x"}), "a chat starts with a system or user turn"),
    (with_message(6, "Fixed."), "message 7: must be an object"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
     "a tool call or result in a row that offers no 'tools'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y",
                                                      "tool_calls": [call("submit", "{}")]}]},
     "a tool call or result in a row that offers no 'tools'"),
    ({"text": "x", "tools": TOOLS}, "'tools' are offered in chat rows ('messages') only"),
    (with_message(1, {"role": "user", "content": "x", "tool_calls": [call("submit", "{}")]}),
     "message 2: only an assistant turn makes tool calls"),
    (with_message(2, {"role": "assistant", "tool_calls": [call("submit", "{}", "x"), call("submit", "{}", "x")]}),
     "tool call 2: id 'x' is another call's of the same turn"),
    # Schemas whose check would multiply or hide what the walk refuses (as the gateway refuses them).
    (chat(tools=[{"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": {
        "a": {"$id": "urn:inner", "$defs": {"l": {"type": "string"}}, "$ref": "#/$defs/l"}}}}}]),
     "an $id below the schema's root is not supported"),
    (chat(tools=[{"type": "function", "function": {"name": "x", "parameters": {
        "$schema": "http://json-schema.org/draft-03/schema#", "extends": {"patternProperties": {"^(a+)+$": {}}}}}}]),
     "$schema 'http://json-schema.org/draft-03/schema#': one of"),
]


@pytest.mark.parametrize(("row", "said"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_row_is_refused_naming_where(row: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError) as refused:
        normalise(row)
    assert said in str(refused.value)


def test_a_file_s_bad_rows_are_named_by_line(tmp_path: Path) -> None:
    path = tmp_path / "episodes.jsonl"
    bad = with_message(2, {"role": "assistant", "tool_calls": [call("rm_rf", "{}")]})
    path.write_text(json.dumps(chat()) + "\n\n" + json.dumps(bad) + "\n")
    rows, problems = read(path)
    assert [row.line for row in rows] == [1]
    assert problems == [(3, "messages: message 3: tool call 1: names 'rm_rf', which is not among the row's tools")]


def test_calls_and_results_are_scanned_and_redacted_keeping_calls_json() -> None:
    row = with_message(2, {"role": "assistant", "tool_calls": [
        call("read_file", json.dumps({"path": "alice@example.com"}), "c1")]})
    row["messages"][3]["content"] = "owner: bob@example.com"
    rows = [Row(1, normalise(row))]
    with pytest.raises(Invalid, match="sensitive data found"):
        scan(rows, scanner_of("block"), "block")
    redacted, counts = scan(rows, scanner_of("redact"), "redact")
    messages = redacted[0].example["messages"]
    arguments = json.loads(messages[2]["tool_calls"][0]["function"]["arguments"])
    assert "@" not in arguments["path"] and "bob@example.com" not in messages[3]["content"]
    assert sum(counts.values()) == 2
    assert redacted[0].example["tools"] == rows[0].example["tools"]


@pytest.mark.parametrize("place", ["description", "enum", "name", "call id", "result id"])
def test_sensitive_data_in_what_redaction_cannot_change_is_found_and_refused_under_redact(place: str) -> None:
    """Tools are shown to the model in every prompt, names and ids are in what it learns: they are
    scanned too, and under redact a finding there refuses the row (redacting it would change the calls)."""
    secret = "bob@example.com"
    tools = json.loads(json.dumps(TOOLS))
    row = chat(tools=tools)
    if place == "description":
        tools[0]["function"]["description"] = f"Ask {secret}."
    elif place == "enum":
        tools[0]["function"]["parameters"]["properties"]["mode"] = {"enum": [secret]}
    elif place == "name":
        tools[1]["function"]["name"] = "AKIAIOSFODNN7EXAMPLE"
        row["messages"][4]["tool_calls"][0]["function"]["name"] = "AKIAIOSFODNN7EXAMPLE"
    elif place == "call id":
        row["messages"][2]["tool_calls"][0]["id"] = secret
        row["messages"][3]["tool_call_id"] = secret
    else:
        row["messages"][5]["tool_call_id"] = "call_4_0"
        row["messages"][4]["tool_calls"][0]["id"] = secret
        row["messages"][5]["tool_call_id"] = secret
    rows = [Row(1, normalise(row))]
    with pytest.raises(Invalid, match="sensitive data found"):
        scan(rows, scanner_of("block"), "block")
    with pytest.raises(Invalid, match="redaction cannot change"):
        scan(rows, scanner_of("redact"), "redact")
    assert scan(rows, scanner_of("allow"), "allow")[0] == rows


def test_redaction_reaches_the_keys_of_a_call_s_arguments() -> None:
    tools = [{"type": "function", "function": {"name": "put", "parameters": {"type": "object"}}}]
    row = {"tools": tools, "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [
        call("put", json.dumps({"bob@example.com": "x"}))]}]}
    [redacted], counts = scan([Row(1, normalise(row))], scanner_of("redact"), "redact")
    assert "bob@example.com" not in json.dumps(redacted.example) and counts


@pytest.mark.parametrize("line", [
    '{"messages": [{"role": "user", "content": "a\\ud800"}, {"role": "assistant", "content": "b"}]}',
    '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
])
def test_lone_surrogates_and_deep_nesting_are_bad_lines_not_crashes(tmp_path: Path, line: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(line + "\n")
    [(number, said)] = read(path)[1]
    assert number == 1 and ("surrogate" in said or "nested too deeply" in said)


def test_a_line_separator_inside_a_string_is_no_end_of_line(tmp_path: Path) -> None:
    """Exported episodes keep U+2028 and the like raw (JSON allows them in strings)."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a\u2028b\u0085c"},
                                             {"role": "assistant", "content": "d\u2029e"}]}, ensure_ascii=False) + "\n")
    rows, problems = read(path)
    assert problems == [] and rows[0].example["messages"][0]["content"] == "a\u2028b\u0085c"


def scanner_of(action: str) -> Any:
    from appliance.sensitive import scanner_from

    return scanner_from(ComplianceSettings(training_data=action))


def learned(tokenizer: Any, ids: list[int], labels: list[int]) -> list[str]:
    spans: list[list[int]] = [[]]
    for token, label in zip(ids, labels, strict=True):
        if label == IGNORED:
            spans.append([]) if spans[-1] else None
        else:
            assert label == token
            spans[-1].append(token)
    return [tokenizer.decode(span) for span in spans if span]


def test_every_assistant_turn_is_learned_and_nothing_else(demo_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    row = normalise(chat())
    [(ids, labels)] = token_rows(tokenizer, demo_model, [row], 4096)
    assert learned(tokenizer, ids, labels) == [
        'Reading it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "calc.py"}}\n</tool_call><|im_end|>\n',
        '\n<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call><|im_end|>\n',
        "Fixed.<|im_end|>\n"]
    assert MARK in tokenizer.decode(ids) and "<tools>" in tokenizer.decode(ids)  # shown with its tools
    assert tool_template(demo_model) == tool_calling(demo_model, "hermes").template  # as its pool serves tools
    assert token_counter(demo_model)(row) == len(ids)  # counted at import as the trainer tokenizes it
    plain = {"messages": [m for m in row["messages"] if m["role"] in ("user", "system")][:2] + [
        {"role": "assistant", "content": "First."}, {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Second."}]}
    [(ids, labels)] = token_rows(tokenizer, demo_model, [plain], 4096)
    assert learned(tokenizer, ids, labels) == ["Second.<|im_end|>\n"]  # a chat without tools: its last answer
    [(whole, labels)] = token_rows(tokenizer, demo_model, [row], 4096)
    [(cut, _)] = token_rows(tokenizer, demo_model, [row], len(whole) - 1)
    assert cut == whole[:-1]
    first = next(i for i, label in enumerate(labels) if label != IGNORED)  # after the tools shown
    with pytest.raises(Invalid, match=f"1 of 2 rows have nothing to learn within their first {first} tokens"):
        token_rows(tokenizer, demo_model, [plain, row], first)


def test_a_model_that_cannot_show_tools_is_refused(tmp_path: Path, demo_model: Path) -> None:
    from transformers import AutoTokenizer

    model = tiny_llama(tmp_path / "tiny", demo_model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(Invalid, match="shows no tools and is not ChatML"):
        token_rows(AutoTokenizer.from_pretrained(model), model, [normalise(chat())], 4096)
    with pytest.raises(Invalid, match="shows no tools and is not ChatML"):
        token_counter(model)(normalise(chat()))


def passed_episode(**changes: Any) -> Episode:
    turns = [Turn(content="Let me look.", completion_tokens=9, tools=[
        ToolStep(call_id="c1", name="read_file", arguments='{"path": "calc.py"}', output="1: def add(a, b):",
                 ok=True, seconds=0.1)]),
        Turn(content="", completion_tokens=5, tools=[], refused="its call failed the schema"),
        Turn(content="", completion_tokens=7, tools=[
            ToolStep(call_id="c2", name="submit", arguments="{}", output="submitted", ok=True, seconds=0.1)])]
    return Episode(**{"task": "calc-add", "model": "m", "turns": turns, "ended": "submitted", "reason": "done",
                      "reward": 1.0, "tests_passed": 2, "tests_total": 2, "workspace_sha256": "ab" * 32,
                      "seconds": 3.0, "system": SYSTEM, "opening": "Fix calc.py.", **changes})


def test_passed_episodes_export_as_rows_data_add_takes(home: Home, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_HOME", str(home.root))
    artifacts = artifact_store(Settings().artifacts, home)
    kept = passed_episode()
    for episode in (kept, passed_episode(ended="steps"), passed_episode(tests_passed=1),
                    passed_episode(model="other")):
        episodes.keep(episode, artifacts, home)
    runner = CliRunner()
    out = tmp_path / "rows.jsonl"
    exported = runner.invoke(cli.app, ["rl", "episodes", "export", "--out", str(out), "--model", "m"])
    assert exported.exit_code == 0, exported.output
    assert "1 of 3 episodes passed" in exported.output
    assert os.stat(out).st_mode & 0o777 == 0o600
    [line] = out.read_text().splitlines()
    row = normalise(json.loads(line))  # what `data add` takes
    assert kept.messages() == conversation(SYSTEM, "Fix calc.py.", kept.turns)  # what the driver asked with
    assert row == normalise({"messages": kept.messages(), "tools": TOOL_SCHEMAS})
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "user", "assistant", "tool"]
    again = runner.invoke(cli.app, ["rl", "episodes", "export", "--out", str(out)])
    assert isinstance(again.exception, Invalid) and "cannot make it" in str(again.exception)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    linked = runner.invoke(cli.app, ["rl", "episodes", "export", "--out", str(tmp_path / "link")])
    assert isinstance(linked.exception, Invalid) and not (tmp_path / "elsewhere").exists()
    none = runner.invoke(cli.app, ["rl", "episodes", "export", "--out", str(tmp_path / "n.jsonl"), "--model", "x"])
    assert isinstance(none.exception, Invalid) and "nothing to export" in str(none.exception)


def test_an_episode_kept_before_openings_were_recorded_says_so() -> None:
    with pytest.raises(Invalid, match="run it again"):
        passed_episode(system=None, opening=None).messages()


def test_the_tool_template_and_the_tool_schemas_make_one_consistent_row() -> None:
    """The environment's own tools pass the row check (the gateway checks them the same way)."""
    row = tool_chat([{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [
        call("run_tests", "{}")]}], TOOL_SCHEMAS)
    assert [t["function"]["name"] for t in row["tools"]] == [t["function"]["name"] for t in TOOL_SCHEMAS]
