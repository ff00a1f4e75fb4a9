"""Errors the gateway answers with, in OpenAI's error shape.

GatewayError          root: status, OpenAI error type and code, extra headers
 +-- AuthError        401 with WWW-Authenticate (bad or missing token) or 403 (missing role)
 +-- ModelNotFound    404 naming the models the caller may use

`from_core` is the one table from the core's errors (appliance.errors) to HTTP; `engine_error`
the one translation of an engine's (vLLM's) error bodies into the same shape, `code` a string;
`validation_error` the one for a body that does not validate (pydantic's errors).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from appliance.errors import ApplianceError, Conflict, Invalid, NotFound, QuotaExceeded, Unavailable
from serve.summaries import cap_text

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

MAX_LISTED_MODELS = 20  # a model_not_found error names at most this many models
MAX_ENGINE_MESSAGE_BYTES = 1024


class GatewayError(Exception):
    """An error with an HTTP status that the client caused or should retry."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """{"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error's body with its status and headers."""
        from serve.responses import SafeJSONResponse  # here: the batch worker shares these types, not FastAPI
        return SafeJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class AuthError(GatewayError):
    """A token was missing, invalid (401) or lacked a role (403); `reason` labels the metric."""

    def __init__(self, reason: str, message: str, *, status: int = 401) -> None:
        headers = {}
        if status == 401:
            # RFC 6750 section 3: no error code when the request carried no token at all.
            error = "" if reason == "missing_token" else ' error="invalid_token",'
            headers["WWW-Authenticate"] = f'Bearer realm="appliance",{error} error_description="{message}"'
        kind = {401: "authentication_error", 403: "permission_error"}.get(status, "service_unavailable")
        if status == 503:
            headers["Retry-After"] = "5"
        super().__init__(status, message, type=kind, code=reason, headers=headers)
        self.reason = reason


class ModelNotFound(GatewayError):
    """No model (or no tier of it) by the name asked for; the message names those the caller may use."""

    def __init__(self, what: str, usable: Iterable[str]) -> None:
        self.what = what
        self.usable = sorted(set(usable))
        super().__init__(404, self._message(), code="model_not_found")  # OpenAI names no param here

    def _message(self) -> str:
        if not self.usable:
            return f"{self.what}; no model is available to you"
        shown = self.usable[:MAX_LISTED_MODELS]
        more = f" and {len(self.usable) - len(shown)} more" if len(self.usable) > len(shown) else ""
        return f"{self.what}; models available to you: {', '.join(shown)}{more}"

    def for_caller(self, usable: Iterable[str], may_use: Callable[[str], bool]) -> ModelNotFound:
        """The same error for one caller: also naming `usable` (what only they may use, such as
        adapters), leaving out what they may not (an API key's model limit)."""
        return ModelNotFound(self.what, [name for name in [*self.usable, *usable] if may_use(name)])


# The core's error families and what the gateway answers for them (status, OpenAI error type).
CORE_ERRORS: tuple[tuple[type[ApplianceError], int, str], ...] = (
    (Invalid, 400, "invalid_request_error"),
    (NotFound, 404, "invalid_request_error"),
    (Conflict, 409, "invalid_request_error"),
    (QuotaExceeded, 429, "rate_limit_error"),
    (Unavailable, 503, "service_unavailable"),
)


def from_core(exc: ApplianceError) -> GatewayError:
    """The gateway's answer to an error from the core: its family's status, its own code; an
    error of no family is the server's fault (500)."""
    for family, status, kind in CORE_ERRORS:
        if isinstance(exc, family):
            headers = {"Retry-After": "5" if status == 503 else "60"} if status in (429, 503) else None
            return GatewayError(status, exc.message, type=kind, code=exc.code, headers=headers)
    return GatewayError(500, exc.message, type="server_error", code=exc.code)


# vLLM's error types (its exception names, or HTTP reason phrases) -> (OpenAI error type, code),
# keyed by the name lowercased without spaces and without the "Error" suffix.
ENGINE_TYPES: dict[str, tuple[str, str]] = {
    "badrequest": ("invalid_request_error", "invalid_value"),
    "unprocessableentity": ("invalid_request_error", "invalid_value"),
    "notfound": ("not_found_error", "not_found"),
    "methodnotallowed": ("invalid_request_error", "method_not_allowed"),
    "notimplemented": ("invalid_request_error", "not_supported"),
    "toomanyrequests": ("rate_limit_error", "engine_overloaded"),
    "internalserver": ("server_error", "engine_error"),
    "serviceunavailable": ("service_unavailable", "engine_unavailable"),
}
# Parameters vLLM names that are no field of the request: the prompt's length, counted by the engine.
ENGINE_ONLY_PARAMS = frozenset({"input_tokens", "input_text"})
# An absolute file path (two segments at least, not part of a URL); the gateway's own routes are no files.
FILE_PATH = re.compile(r"(?<![\w.:/~-])/(?!v1/|admin/)[\w.@+-]+(?:/[\w.@+-]+)+/?")
VALIDATION_DUMP = re.compile(r"^\d+ validation errors?:")
DUMP_MESSAGE = re.compile(r"""'msg': (?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)")""")
CONTEXT_EXCEEDED = "maximum context length"


def engine_error(status: int, body: object) -> GatewayError:
    """The gateway's error for an engine's error answer with HTTP `status` and parsed JSON `body`
    (anything else, such as a plain-text 500, gets a message of its own): OpenAI's types, a string
    code, the engine's message kept but in one line and without file paths."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {"message": f"the engine failed (HTTP {status})" if status >= 500 else
                 f"the engine refused the request (HTTP {status})"}
    kind, code = _engine_kind(status, error.get("type"))
    message = _one_line(str(error.get("message") or "the engine refused the request"))
    param = _engine_param(error.get("param"))
    if VALIDATION_DUMP.match(message):
        message = _first_validation_error(message, param)
    if CONTEXT_EXCEEDED in message:
        code = "context_length_exceeded"  # OpenAI's code for a prompt (and output) past the context
    return GatewayError(status, cap_text(scrub_paths(message), MAX_ENGINE_MESSAGE_BYTES), type=kind, code=code,
                        param=param)


def stream_error(event: dict[str, Any]) -> dict[str, Any]:
    """An engine's error event inside an SSE stream (`{"error": {...}}`, its HTTP status as `code`)
    in the gateway's shape."""
    error = event.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    return engine_error(status, event).body()


def scrub_paths(text: str) -> str:
    """`text` with every absolute file path replaced by `<path>` (the server's layout is not the
    client's business; the engine names its model by its served name)."""
    return FILE_PATH.sub("<path>", text)


def _engine_kind(status: int, engine_type: object) -> tuple[str, str]:
    """(OpenAI type, code) for the engine's error type; by status when the type is unknown."""
    key = re.sub(r"\s+", "", str(engine_type or "")).lower().removesuffix("error")
    return ENGINE_TYPES.get(key) or _by_status(status)


def _by_status(status: int) -> tuple[str, str]:
    if status == 404:
        return ENGINE_TYPES["notfound"]
    if status == 429:
        return ENGINE_TYPES["toomanyrequests"]
    if status == 503:
        return ENGINE_TYPES["serviceunavailable"]
    return ENGINE_TYPES["internalserver"] if status >= 500 else ENGINE_TYPES["badrequest"]


def _engine_param(param: object) -> str | None:
    """The request field vLLM names (its validation errors say `body.<field>`), or None."""
    if not isinstance(param, str) or not param:
        return None
    field = param.removeprefix("body.")
    return None if field in ENGINE_ONLY_PARAMS or field == "body" else field


def _first_validation_error(message: str, param: str | None) -> str:
    """A one-line message from vLLM's dump of pydantic errors: the first error's text, its field named."""
    found = DUMP_MESSAGE.search(message)
    text = next((group for group in found.groups() if group is not None), "") if found else ""
    return f"'{param or 'body'}': {text or 'invalid value'}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


# Pydantic error types -> OpenAI's codes for them; any other type is an invalid value.
VALIDATION_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter",
                    "json_invalid": "invalid_json"}
# Segments pydantic puts in an error's location that name no field: a union's member ("str",
# "list[str]", "literal['a','b']") or a validator ("function-after[...]").
TYPE_SEGMENT = re.compile(r"^(?:str|int|float|bool|bytes|none|dict|list)$|[\[(]")


def validation_error(errors: Sequence[Mapping[str, Any]], status: int) -> GatewayError:
    """An error naming the first bad field as a dotted path (`tools.0.function.name`) and what is
    wrong with it in one line (never echoing its value); a union's alternatives are told together."""
    if not errors:
        return GatewayError(status, "the body is invalid", code="invalid_value", param="body")
    first = errors[0]
    if first.get("type") == "json_invalid":  # its location is a character offset, not a field
        return GatewayError(status, _bad_json(first), code="invalid_json", param="body")
    field_name = _field_path(first.get("loc", ()))
    alternatives = [error for error in errors if _field_path(error.get("loc", ())) == field_name]
    if first.get("type") == "extra_forbidden":
        message = f"unknown field '{field_name}'"
    else:
        message = f"'{field_name}': " + "; or ".join(dict.fromkeys(str(error.get("msg", "invalid"))
                                                                  for error in alternatives))
    others = len({_field_path(error.get("loc", ())) for error in errors}) - 1
    more = f" (and {others} more)" if others else ""
    return GatewayError(status, cap_text(_one_line(message) + more, 512), code=_validation_code(first),
                        param=cap_text(field_name))


def _field_path(location: Sequence[object]) -> str:
    """The dotted path of the field an error is about: list positions kept, union members dropped."""
    parts = [str(part) for position, part in enumerate(location) if not (position == 0 and part == "body")
             and (isinstance(part, int) or not TYPE_SEGMENT.search(str(part)))]
    return ".".join(parts) or "body"


def _validation_code(error: Mapping[str, Any]) -> str:
    kind = str(error.get("type", ""))
    if kind in VALIDATION_CODES:
        return VALIDATION_CODES[kind]
    return "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"


def _bad_json(error: Mapping[str, Any]) -> str:
    location = error.get("loc", ())
    reason = error.get("ctx", {}).get("error", "invalid")
    return f"the body is not valid JSON ({reason} at character {location[-1] if location else '?'})"
