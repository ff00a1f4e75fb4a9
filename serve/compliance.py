"""Live compliance filtering: the sensitive-data scanner (appliance.sensitive) on every prompt
before the engine sees it and on every answer before the client does, as the caller's roles'
policy says (`compliance` settings):

- `block` (prompts): the request is refused, 400 `sensitive_data`, naming the kind and the field,
  never the text;
- `redact`: each finding is replaced by its kind (`[PAYMENT_CARD]`), in the prompt before it is
  relayed and in the answer before it goes out, a streamed one included: text that could still be
  the start of a finding is held back until the next chunk settles it;
- `flag`: it goes through, and the request's audit record says what was found;
- `allow`: nothing.

Every string a request sends but the model's name is screened, and every JSON number, as a template
renders it (`str`: 4111111111111111, 4111111111111111.0): a number holding a finding is blocked like
a string, or under `redact` replaced by its redacted rendering, a string ("[PAYMENT_CARD]"; its type
changes). What cannot be screened is not let through: a prompt of token ids is refused, an answer
or stream event that cannot be parsed is not sent on. A choice's logprobs (they would show the text
redaction hides) are left out wherever the filter held back or replaced its text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from appliance.errors import SettingsError
from appliance.roles import Role
from appliance.sensitive import Scanner, StreamRedactor, replaced, scanner_from
from appliance.settings import DEFAULT_ANSWERS, DEFAULT_PROMPTS, ComplianceSettings, RolePolicy, SensitiveAction
from serve.errors import GatewayError

APPLIANCE_ROLES = {str(role) for role in Role}
GENEROSITY = ("block", "redact", "flag", "allow")  # a user holding several roles gets the most generous
# The answer's generated strings (vLLM names its reasoning `reasoning`, older versions `reasoning_content`).
ANSWER_TEXT = ("content", "reasoning", "reasoning_content", "text", "refusal", "arguments", "name")
STREAMED_TEXT = ANSWER_TEXT[:5]  # and each tool call's name and arguments
DESCRIBED = {"payment_card": "a payment card number", "iban": "an IBAN", "secret": "a secret (an API key or token)",
             "email": "an e-mail address", "phone": "a phone number", "national_id": "a national identifier"}
MARKS = {"block": "blocked", "redact": "redacted", "flag": "flagged"}
BUILT_IN_DEFAULTS = {"prompts": DEFAULT_PROMPTS, "answers": DEFAULT_ANSWERS}


@dataclass(frozen=True)
class Policy:
    """One caller's actions by kind, for prompts and for answers."""

    prompts: dict[str, SensitiveAction]
    answers: dict[str, SensitiveAction]

    @staticmethod
    def acting(actions: dict[str, SensitiveAction], *wanted: str) -> set[str]:
        return {kind for kind, action in actions.items() if action in wanted}


@dataclass
class Marks:
    """What the filter did to one request, for its audit record: "prompt.email" -> "flagged"."""

    done: dict[str, str] = field(default_factory=dict)

    def add(self, where: str, kinds: set[str], action: str) -> None:
        for kind in kinds:
            self.done[f"{where}.{kind}"] = MARKS[action]


class Compliance:
    """The scanner and the policies, built once at the gateway's start (SettingsError there for a
    policy naming a kind no detector finds, or a plug-in that is not installed)."""

    def __init__(self, settings: ComplianceSettings) -> None:
        self.settings = settings
        self.scanner = scanner_from(settings)
        known = self.scanner.kinds
        for where, policy in (("default", settings.default), *settings.roles.items()):
            for part in (policy.prompts, policy.answers):
                if unknown := set(part) - known:
                    raise SettingsError(f"compliance.{where if where == 'default' else 'roles.' + where}: no detector "
                                        f"finds {sorted(unknown)}", hint=f"kinds: {sorted(known)}")

    def policy(self, roles: Iterable[str]) -> Policy:
        """The caller's: for each kind, the most generous action among the policies of the roles it
        holds (the appliance's roles and those with a policy; one without a policy of its own has
        the default)."""
        default = self.settings.default
        held: list[RolePolicy | None] = [self.settings.roles.get(role) for role in roles
                                         if role in self.settings.roles or role in APPLIANCE_ROLES]
        held = held or [None]
        chosen: dict[str, dict[str, SensitiveAction]] = {"prompts": {}, "answers": {}}
        for part in chosen:
            for kind in self.scanner.kinds:
                # A kind a policy does not name: the default policy's, else the built-in default's
                # (a default table naming only e-mail still blocks cards), else flag.
                fallback = getattr(default, part).get(kind) or BUILT_IN_DEFAULTS[part].get(kind, "flag")
                actions = [(getattr(role, part) if role else {}).get(kind) or fallback for role in held]
                chosen[part][kind] = max(actions, key=GENEROSITY.index)
        return Policy(**chosen)

    def screen_prompt(self, payload: dict[str, Any], fields: tuple[str, ...], policy: Policy, marks: Marks) -> None:
        """Block, redact (in `payload`) or flag what the prompt-shaping `fields` hold; refuse a prompt
        of token ids (it cannot be screened)."""
        # The strictest action's kinds first: a flagged finding never hides a blocked one it overlaps.
        ranked = [policy.acting(policy.prompts, action) for action in ("block", "redact", "flag")]
        if not any(ranked):
            return
        found: dict[str, set[str]] = {}
        for name in fields:
            if name in payload:
                if name == "prompt" and _token_ids(payload[name]):
                    marks.done["prompt.token_ids"] = MARKS["block"]
                    raise GatewayError(400, "a prompt of token ids cannot be screened for sensitive data under your "
                                       "role's compliance policy; send text", code="sensitive_data", param="prompt")
                for path, text in _texts(payload[name], name, self.scanner.redact):
                    for finding in self.scanner.findings_by_rank(text, ranked):
                        found.setdefault(finding.kind, set()).add(path)
        for action in ("flag", "block"):
            marks.add("prompt", {kind for kind in found if policy.prompts[kind] == action}, action)
        blocked = sorted(kind for kind in found if policy.prompts[kind] == "block")
        if blocked:
            kind = blocked[0]
            raise GatewayError(400, f"the prompt holds {DESCRIBED.get(kind, kind)} ({sorted(found[kind])[0]}), "
                               "which your role may not send", code="sensitive_data", param=sorted(found[kind])[0])
        redacted = {kind for kind in found if policy.prompts[kind] == "redact"}
        marks.add("prompt", redacted, "redact")
        for name in fields:
            if redacted and name in payload:
                payload[name] = _rewritten(payload[name], lambda text: self.scanner.redact(text, redacted))

    def answer_filter(self, policy: Policy, marks: Marks) -> AnswerFilter | None:
        redacted = policy.acting(policy.answers, "redact")
        flagged = policy.acting(policy.answers, "flag")
        if not redacted and not flagged:
            return None
        return AnswerFilter(self.scanner, redacted, flagged, self.settings.hold_chars, marks)


class AnswerFilter:
    """Redacts and flags one answer: whole (`answer`) or as its stream's events go by (`event`,
    then `finish` before the end marker). What it found is marked as soon as it is settled, so a
    stream cut short still has its marks."""

    def __init__(self, scanner: Scanner, redacted: set[str], flagged: set[str], hold_chars: int,
                 marks: Marks) -> None:
        self.scanner = scanner
        self.redacted = redacted
        self.flagged = flagged
        self.hold_chars = hold_chars
        self.marks = marks
        self.streams: dict[tuple[Any, str], tuple[StreamRedactor, StreamRedactor]] = {}  # redacting, flagging
        self.last: dict[str, Any] = {}

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        """A whole answer's choices, redacted (a changed choice loses its logprobs)."""
        def screened(text: str) -> str:
            found = self.scanner.findings_by_rank(text, [self.redacted, self.flagged])  # redacting first
            self.marks.add("answer", {f.kind for f in found if f.kind in self.flagged}, "flag")
            redacting = [f for f in found if f.kind in self.redacted]
            self.marks.add("answer", {f.kind for f in redacting}, "redact")
            return replaced(text, redacting)

        if isinstance(body.get("choices"), list):
            choices = []
            for choice in body["choices"]:
                screened_choice = _rewritten(choice, screened, ANSWER_TEXT)
                if screened_choice != choice and isinstance(screened_choice, dict):
                    screened_choice.pop("logprobs", None)
                choices.append(screened_choice)
            body["choices"] = choices
        return body

    def event(self, event: dict[str, Any]) -> dict[str, Any]:
        """One streamed event, its text settled so far redacted (the rest held back); a choice's
        held text goes out with the event that finishes it."""
        choices = event.get("choices")
        if not isinstance(choices, list):
            return event
        self.last = event
        for position, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", position)
            part: dict[str, Any] = choice["delta"] if isinstance(choice.get("delta"), dict) else choice
            changed = False
            for key, holder in _text_places(part):
                out = self._feed((index, key), holder[_leaf(key)])
                changed = changed or out != holder[_leaf(key)]
                holder[_leaf(key)] = out
            if choice.get("finish_reason") is not None:
                for held_index, key in list(self.streams):
                    if held_index == index and (rest := self._flush((held_index, key))):
                        _append(part, key, rest)
                        changed = True
            if changed:
                choice.pop("logprobs", None)
        return event

    def finish(self) -> list[dict[str, Any]]:
        """Events carrying what is still held (a stream that ended without finishing its choices),
        to go out before its end marker; a stream cut before that marker loses what was held."""
        events = []
        for index, key in list(self.streams):
            if rest := self._flush((index, key)):
                if key == "text":
                    choice: dict[str, Any] = {"index": index, "text": rest}
                else:
                    choice = {"index": index, "delta": {}}
                    _append(choice["delta"], key, rest)
                events.append({**{k: v for k, v in self.last.items() if k in ("id", "object", "created", "model")},
                               "choices": [choice]})
        return events

    def _feed(self, where: tuple[Any, str], text: str) -> str:
        if where not in self.streams:
            self.streams[where] = (StreamRedactor(self.scanner, self.redacted, self.hold_chars),
                                   StreamRedactor(self.scanner, self.flagged, self.hold_chars))
        redacting, flagging = self.streams[where]
        flagging.feed(text)
        out = redacting.feed(text)
        self._mark(redacting, flagging)
        return out

    def _flush(self, where: tuple[Any, str]) -> str:
        redacting, flagging = self.streams[where]
        flagging.flush()
        out = redacting.flush()
        self._mark(redacting, flagging)
        return out

    def settle(self) -> None:
        """Mark what was found in a stream that ended early (its client left): what the flagging
        still held is settled (nothing more goes out)."""
        for _, flagging in self.streams.values():
            flagging.flush()
            self.marks.add("answer", flagging.found, "flag")

    def _mark(self, redacting: StreamRedactor, flagging: StreamRedactor) -> None:
        self.marks.add("answer", redacting.found, "redact")
        self.marks.add("answer", flagging.found, "flag")


def _text_places(part: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The generated strings of a streamed choice's part, each as (its stream's key, the dict
    holding it): content and the like, and each tool call's name and arguments ("tool:N:name")."""
    for key in STREAMED_TEXT:
        if isinstance(part.get(key), str):
            yield key, part
    calls = part.get("tool_calls")
    for position, call in enumerate(calls if isinstance(calls, list) else []):
        function = call.get("function") if isinstance(call, dict) else None
        for leaf in ("name", "arguments"):
            if isinstance(function, dict) and isinstance(function.get(leaf), str):
                yield f"tool:{call.get('index', position)}:{leaf}", function


def _leaf(key: str) -> str:
    return key.rsplit(":", 1)[-1]


def _append(part: dict[str, Any], key: str, rest: str) -> None:
    """Add held text back to a streamed choice's part, where its stream's key says."""
    if not key.startswith("tool:"):
        part[key] = (part.get(key) or "") + rest
        return
    _, index, leaf = key.split(":")
    calls = part.setdefault("tool_calls", [])
    call = next((c for c in calls if isinstance(c, dict) and str(c.get("index")) == index), None)
    if call is None:
        call = {"index": int(index) if index.isdigit() else index, "function": {}}
        calls.append(call)
    function = call.setdefault("function", {})
    function[leaf] = (function.get(leaf) or "") + rest


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _texts(value: Any, path: str, shown: Callable[[str], str]) -> Iterator[tuple[str, str]]:
    """Every string and number (as a template renders it) in a JSON value, the keys of its objects
    included, in order, with where it is ("messages[1].content"; a key in the path as `shown`
    makes it: a finding never named). Walked with a stack: however deep the value, each item costs
    the same."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            yield where, item
        elif _number(item):
            yield where, str(item)
        elif isinstance(item, list):
            stack.extend((f"{where}[{position}]", inner) for position, inner in reversed(list(enumerate(item))))
        elif isinstance(item, dict):
            for key, inner in reversed(item.items()):
                stack.append((f"{where}.{shown(str(key))}", inner))
                stack.append((f"{where} (a key)", str(key)))


def _rewritten(value: Any, change: Any, keys: tuple[str, ...] | None = None) -> Any:
    """`value` with each string changed, keys included (only values under `keys`, when given); with
    no `keys`, a number too, which becomes the string it was changed to if that differs."""
    if isinstance(value, str):
        return change(value) if keys is None else value
    if _number(value) and keys is None:
        return value if (changed := change(str(value))) == str(value) else changed
    if isinstance(value, list):
        return [_rewritten(item, change, keys) for item in value]
    if isinstance(value, dict):
        return {(change(key) if keys is None else key): (
            change(item) if keys is not None and key in keys and isinstance(item, str)
            else _rewritten(item, change, keys)) for key, item in value.items()}
    return value


def _token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and any(isinstance(item, (int, list)) for item in prompt)
