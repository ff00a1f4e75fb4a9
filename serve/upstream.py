"""The engines behind the gateway: which pool serves a model, and relaying to it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from appliance.home import Home
from appliance.settings import Settings
from serve.engine import model_dir
from serve.errors import GatewayError


@dataclass(frozen=True)
class Pool:
    name: str
    model: str
    base_url: str


def pools_from_settings(settings: Settings, home: Home) -> list[Pool]:
    """One upstream per engine pool, named by the model clients ask for."""
    return [Pool(name=p.name, model=p.served_model_name or model_dir(p, home).name,
                 base_url=f"http://{settings.network.bind}:{p.port}") for p in settings.pools]


class Upstreams:
    """Routes a model name to its pool and relays requests with the engine's key."""

    def __init__(self, pools: list[Pool], http: httpx.AsyncClient, engine_key: str) -> None:
        self.pools = pools
        self._by_model = {pool.model: pool for pool in pools}
        self._http = http
        self._headers = {"Authorization": f"Bearer {engine_key}"}

    def route(self, model: object) -> Pool:
        if not isinstance(model, str) or not model:
            raise GatewayError(400, "'model' is required and must be a string", code="missing_model")
        pool = self._by_model.get(model)
        if pool is None:
            raise GatewayError(404, f"model {model!r} does not exist", code="model_not_found")
        return pool

    async def send(self, pool: Pool, path: str, body: bytes, request_id: str) -> httpx.Response:
        """POST to the pool; the response is streamed. A down engine is a 503 at once."""
        request = self._http.build_request(
            "POST", f"{pool.base_url}{path}", content=body,
            headers={**self._headers, "Content-Type": "application/json", "X-Request-Id": request_id})
        try:
            return await self._http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise GatewayError(503, f"engine pool {pool.name!r} is not reachable; retry shortly",
                               type="service_unavailable", code="engine_unavailable",
                               headers={"Retry-After": "5"}) from exc
        except httpx.HTTPError as exc:
            raise GatewayError(502, f"engine pool {pool.name!r} failed: {type(exc).__name__}",
                               type="upstream_error", code="engine_error") from exc

    async def models(self) -> list[dict]:
        """Every pool's /v1/models entries; pools that do not answer are left out."""
        data: list[dict] = []
        for pool in self.pools:
            try:
                response = await self._http.get(f"{pool.base_url}/v1/models", headers=self._headers)
                response.raise_for_status()
                data.extend(response.json().get("data", []))
            except (httpx.HTTPError, ValueError):
                continue
        return data

    async def healthy(self, pool: Pool) -> bool:
        try:
            return (await self._http.get(f"{pool.base_url}/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False


def usage_of(body: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens from a non-streamed OpenAI response body."""
    try:
        usage = json.loads(body).get("usage") or {}
    except (ValueError, AttributeError):
        return 0, 0
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def text_of(choices: object) -> str:
    """The generated text in OpenAI `choices` (message, delta or completion text)."""
    parts = []
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        for key in ("message", "delta"):
            content = (choice.get(key) or {}).get("content")
            if isinstance(content, str):
                parts.append(content)
        if isinstance(choice.get("text"), str):
            parts.append(choice["text"])
    return "".join(parts)


async def relay_stream(response: httpx.Response, on_first_token: Callable[[], None],
                       on_usage: Callable[[int, int], None],
                       on_text: Callable[[str], None]) -> AsyncIterator[bytes]:
    """Pass SSE bytes through as they arrive; note the first token, the text and the final usage.

    When the client goes away, the server cancels this generator; closing the upstream response
    then makes vLLM abort the request, freeing the engine.
    """
    first = True
    pending = b""
    try:
        async for chunk in response.aiter_raw():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                try:
                    event = json.loads(line[len(b"data: "):])
                except ValueError:
                    continue
                text = text_of(event.get("choices"))
                if text:
                    if first:
                        first = False
                        on_first_token()
                    on_text(text)
                if event.get("usage"):
                    on_usage(int(event["usage"].get("prompt_tokens") or 0),
                             int(event["usage"].get("completion_tokens") or 0))
            yield chunk
    finally:
        await response.aclose()
