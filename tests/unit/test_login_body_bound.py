"""Every published login route refuses a body past its bound without reading it: by its
Content-Length before the app asks for a byte of it (a client that sends its headers and then
nothing gets its 413), and a chunked body as soon as what arrived passes the bound, the rest never
asked for; nothing reaches Keycloak, and the connection closes."""

from __future__ import annotations

import asyncio

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.types import Message

from serve.identity_proxy import RESOURCE_ROUTE, ROUTES, Route
from tests.unit.test_identity_proxy import CLIENT, FORM, noting, published

# A concrete path under /realms/appliance/ for each route's pattern (the one a pattern stands for).
CONCRETE = {"login-actions/[a-z-]+": "login-actions/authenticate",
            r"\.well-known/openid-configuration": ".well-known/openid-configuration"}


def path_of(route: Route) -> str:
    if route is RESOURCE_ROUTE:
        return "/resources/abc12/login/keycloak.v2/css/styles.css"
    return f"/realms/appliance/{CONCRETE.get(route.path.pattern, route.path.pattern)}"


def request(route: Route, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[Message, int]:
    """`route` asked through the published app, its body given in `chunks` as the app asks for
    them: the answer's start and how many chunks the app asked for."""
    seen: list[httpx.Request] = []
    app = published(noting(seen))
    pending = list(chunks)
    asked = 0
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal asked
        asked += 1
        if not pending:
            raise AssertionError("the app asked for more than the client sent")
        return {"type": "http.request", "body": pending.pop(0), "more_body": bool(pending)}

    async def send(message: Message) -> None:
        sent.append(message)

    path = path_of(route)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": route.method,
             "scheme": "https", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": CLIENT.encode(), "client": ("203.0.113.5", 40000), "server": ("llm.bank.test", 8443),
             "headers": [(b"host", b"llm.bank.test:8443"), (b"content-type", FORM["content-type"].encode()),
                         *headers]}
    asyncio.run(app(scope, receive, send))
    assert seen == [], "a refused body reached Keycloak"
    return sent[0], asked


EVERY_ROUTE = st.sampled_from([*ROUTES, RESOURCE_ROUTE])


@settings(max_examples=60, deadline=None)
@given(route=EVERY_ROUTE, past=st.integers(1, 1 << 40))
def test_a_declared_length_past_the_bound_is_refused_before_a_byte_is_asked_for(route: Route, past: int) -> None:
    """Headers with Content-Length past the bound, and nothing after them: the 413 comes from the
    headers alone (the app never asks for the body, which a client sending nothing never gives)."""
    start, asked = request(route, [(b"content-length", str(route.max_body + past).encode())], [])
    assert start["status"] == 413 and asked == 0
    assert (b"connection", b"close") in start["headers"]


@settings(max_examples=60, deadline=None)
@given(route=EVERY_ROUTE, sizes=st.lists(st.integers(1, 9000), min_size=1, max_size=40), extra=st.integers(1, 9000))
def test_a_chunked_body_is_cut_at_the_bound(route: Route, sizes: list[int], extra: int) -> None:
    """A body without a length, in chunks of any size: the app stops asking at the chunk that
    passes the bound, however much more the client would send."""
    while sum(sizes) <= route.max_body:
        sizes.append(extra)
    chunks = [b"a" * size for size in sizes] + [b"a" * 65536] * 4  # more the app must never ask for
    start, asked = request(route, [(b"transfer-encoding", b"chunked")], chunks)
    passing = next(index for index in range(len(sizes)) if sum(sizes[:index + 1]) > route.max_body)
    assert start["status"] == 413 and asked == passing + 1
    assert (b"connection", b"close") in start["headers"]
