"""HTTP for collect.backend=server: JSON over the standard library with retries and backoff, and the start-up
probe that checks every server is there and serves the configured model. Retried: a refused or dropped connection,
a timeout, an unreadable reply, HTTP 429 and 5xx (the faults of a busy, restarting or dying server); not any other 4xx.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from pipeline.errors import PipelineError

# GET /v1/models `owned_by` -> the engine whose extra request fields we may send
OWNERS = {"llamacpp": "llamacpp", "vllm": "vllm", "sglang": "sglang"}
PROBE_TIMEOUT = 30.0  # seconds for the start-up GET /v1/models: a server that is up answers it at once
RETRY_AFTER_CAP = 60.0  # seconds: a 429's Retry-After is honoured up to this


class ServerDown(Exception):
    """A request that failed every try with a fault the server may recover from (see the module docstring)."""


class Rejected(Exception):
    """The server refused the request itself (4xx other than 429): retrying would give the same answer."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


def _error_message(body: bytes) -> str:
    """The `error.message` of an OpenAI-style error body, else its first 200 characters."""
    text = body.decode(errors="replace")
    try:
        error = json.loads(text).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        return str(message or text)[:300]
    except (ValueError, AttributeError):
        return text.strip()[:200] or "no body"


@dataclass
class Client:
    """One server's base URL with the fault handling of collect.server (timeout per try, retries, backoff)."""
    url: str
    timeout: float
    retries: int
    backoff: float

    def get(self, path: str) -> dict:
        return self._call(urllib.request.Request(self.url + path), path)

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return self._call(request, path)

    def _call(self, request: urllib.request.Request, path: str) -> dict:
        last = "no try made"
        for attempt in range(self.retries + 1):
            wait = self.backoff * 2 ** attempt
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                message = _error_message(e.read())
                if e.code != 429 and e.code < 500:
                    raise Rejected(e.code, message) from None
                last = f"HTTP {e.code}: {message}"
                with contextlib.suppress(TypeError, ValueError):  # no Retry-After, or not in seconds
                    wait = max(wait, min(float(e.headers.get("Retry-After")), RETRY_AFTER_CAP))
            except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout,
                    http.client.HTTPException, ValueError) as e:  # ValueError: a reply cut off mid-JSON
                last = str(getattr(e, "reason", None) or e) or type(e).__name__
            if attempt < self.retries:
                time.sleep(wait)
        raise ServerDown(f"{self.url}{path} failed {self.retries + 1} tries (last: {last})")


# ----------------------------------------------------------------------------- the start-up probe

@dataclass(frozen=True)
class Served:
    """What one server serves, from its GET /v1/models: the model id to request, the engine, its context."""
    url: str
    model: str
    engine: str             # llamacpp | vllm | sglang | openai
    n_ctx: int | None       # tokens of context per request (prompt + completion), when the server says


def probe(urls: tuple[str, ...], model: str | None, engine: str) -> list[Served]:
    """Every server answers GET /v1/models and serves `model` (None: exactly one model), else one line naming the
    server and the fix; run before anything is written, so a bad URL or name costs nothing."""
    served = []
    for url in urls:
        client = Client(url, PROBE_TIMEOUT, retries=0, backoff=0.0)
        try:
            listing = client.get("/v1/models")
        except (ServerDown, Rejected) as e:
            raise PipelineError(f"collect.server: {url} does not answer GET /v1/models ({e}): start the server or fix "
                                "collect.server.urls") from None
        served.append(_served(url, listing, model, engine))
    names = {s.model for s in served}
    if len(names) > 1:
        raise PipelineError(f"collect.server.urls serve different models {sorted(names)}: set collect.server.model "
                            "to the one to collect from, served by every URL")
    return served


def _served(url: str, listing: dict, model: str | None, engine: str) -> Served:
    entries = [entry for entry in listing.get("data") or [] if isinstance(entry, dict) and entry.get("id")]
    names = {entry["id"]: entry for entry in entries}
    for entry in entries:
        names.update({alias: entry for alias in entry.get("aliases") or []})
    if model is None:
        if len(entries) != 1:
            raise PipelineError(f"collect.server: {url} serves {len(entries)} models {sorted(names)}: set "
                                "collect.server.model to the target's name")
        chosen, name = entries[0], entries[0]["id"]
    elif model in names:
        chosen, name = names[model], model
    else:
        raise PipelineError(f"collect.server: {url} serves {sorted(names)}, not collect.server.model={model!r}: fix "
                            "the name (or the URL)")
    kind = engine if engine != "auto" else OWNERS.get(str(chosen.get("owned_by")), "openai")
    meta = chosen.get("meta") or {}
    n_ctx = meta.get("n_ctx") or chosen.get("max_model_len")  # llama-server | vLLM and SGLang
    return Served(url, name, kind, int(n_ctx) if n_ctx else None)
