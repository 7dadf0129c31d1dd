"""Async HTTP client for one SGLang (or sglang-jax) server: the endpoints RL needs.

    client = SGLangClient("http://127.0.0.1:30000", timeout_s=60, concurrency=16)
    body = await client.generate({"input_ids": [1, 5], "sampling_params": {...}, "return_logprob": True})

Errors are split by what the caller should do: ServerUnavailable (cannot connect, connection
dropped, timed out: take the server out of rotation, re-issue elsewhere), ServerHTTPError (the
server answered with an error status), MalformedResponse (not JSON: re-issue). Call from one event
loop; the session is created lazily inside it.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from cadence.actors.sglang.alignment import MalformedResponse
from cadence.actors.sglang.results import ServerHTTPError, ServerUnavailable

__all__ = ["MalformedResponse", "SGLangClient", "ServerHTTPError", "ServerUnavailable", "completion_request"]


def completion_request(input_ids: list[int], sampling_params: dict, rid: str | None = None) -> dict:
    """The /generate payload for one completion with its behavior logprobs (what the engine sends).

    logprob_start_len -1 asks for output logprobs only. sglang-jax 0.1.0rc0 then repeats them in
    completions longer than 50 tokens (parse_completion undoes that, checking it); its other path
    (logprob_start_len = the prompt's last position) returned the right count but wrong values at
    the first and last positions (measured: 0.1-0.5 off Cadence's model), so it is not used.
    """
    payload = {"input_ids": list(input_ids), "sampling_params": sampling_params, "return_logprob": True,
               "logprob_start_len": -1}
    if rid is not None:
        payload["rid"] = rid
    return payload


class SGLangClient:
    """One server's endpoints; ``concurrency`` bounds the open connections (requests in flight)."""

    def __init__(self, base_url: str, timeout_s: float = 120.0, concurrency: int = 16):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency, force_close=False),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, payload: Any = None, timeout_s: float | None = None) -> Any:
        """Sends one request; returns the decoded JSON body (or the text when it is not JSON)."""
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        for attempt in range(2):
            try:
                async with self._get_session().request(method, url, json=payload, timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status >= 400:
                        raise ServerHTTPError(url, resp.status, text)
                break
            except aiohttp.ServerDisconnectedError as e:
                # A pooled keep-alive connection the server already closed: one fresh try.
                if attempt == 1:
                    raise ServerUnavailable(f"{url}: {type(e).__name__}: {e}") from e
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
                raise ServerUnavailable(f"{url}: {type(e).__name__}: {e}") from e
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return text

    async def generate(self, payload: dict) -> dict:
        """POST /generate (non-streaming); raises MalformedResponse when the body is not a JSON object."""
        body = await self.request("POST", "/generate", payload)
        if not isinstance(body, dict):
            raise MalformedResponse(f"/generate returned {type(body).__name__}, not a JSON object: "
                                    f"{str(body)[:200]}")
        return body

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        """GET /health_generate (the server runs one tiny generation): True when it answers 200."""
        try:
            await self.request("GET", "/health_generate", timeout_s=timeout_s)
            return True
        except (ServerUnavailable, ServerHTTPError):
            return False

    async def health(self, timeout_s: float = 5.0) -> bool:
        """GET /health: True when the HTTP server is up (the model may still be warming)."""
        try:
            await self.request("GET", "/health", timeout_s=timeout_s)
            return True
        except (ServerUnavailable, ServerHTTPError):
            return False

    async def abort(self, rid: str | None = None) -> None:
        """POST /abort_request for one request id, or for all requests when rid is None."""
        payload = {"rid": rid} if rid is not None else {"rid": "", "abort_all": True}
        await self.request("POST", "/abort_request", payload)

    async def pause_generation(self, mode: str = "in_place") -> Any:
        """POST /pause_generation; mode "abort", "retract" or "in_place"."""
        return await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> Any:
        return await self.request("POST", "/continue_generation", {})

    async def flush_cache(self) -> Any:
        return await self.request("POST", "/flush_cache")

    async def update_weights_from_disk(self, model_path: str, version: int) -> dict:
        """POST /update_weights_from_disk (main sglang; sglang-jax 0.1.0rc0 answers 404).

        Raises ServerHTTPError on an error status, RuntimeError when the server reports failure.
        """
        return await self._rl_call("/update_weights_from_disk",
                                   {"model_path": model_path, "weight_version": str(version),
                                    "flush_cache": True, "abort_all_requests": False})

    async def server_info(self) -> dict:
        """GET /get_server_info: the server's arguments and state (tp_size, dp_size, weight_version, ...)."""
        body = await self.request("GET", "/get_server_info")
        if not isinstance(body, dict):
            raise MalformedResponse(f"{self.base_url}/get_server_info returned {str(body)[:200]}")
        return body

    async def _rl_call(self, path: str, payload: dict, timeout_s: float | None = None) -> dict:
        # Main SGLang answers these with {"success": ..., "message": ...}; a failure is also HTTP 400.
        body = await self.request("POST", path, payload, timeout_s=timeout_s)
        if not isinstance(body, dict) or not body.get("success", False):
            raise RuntimeError(f"{self.base_url}{path} failed: {body}")
        return body

    async def init_weights_update_group(self, payload: dict, timeout_s: float) -> dict:
        """POST /init_weights_update_group (main sglang): the server's ranks join the learner's group."""
        return await self._rl_call("/init_weights_update_group", payload, timeout_s)

    async def update_weights_from_distributed(self, payload: dict, timeout_s: float) -> dict:
        """POST /update_weights_from_distributed: receive one bucket broadcast from rank 0."""
        return await self._rl_call("/update_weights_from_distributed", payload, timeout_s)

    async def destroy_weights_update_group(self, group_name: str, timeout_s: float = 30.0) -> dict:
        return await self._rl_call("/destroy_weights_update_group", {"group_name": group_name}, timeout_s)
