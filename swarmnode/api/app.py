"""The FastAPI app: an OpenAI-compatible API over the swarm, Prometheus metrics and the dashboard.

    GET  /v1/models                 the one model this server serves (id: its checkpoint folder's name)
    POST /v1/completions            text completion, streamed (SSE) or not
    POST /v1/chat/completions       chat completion through the model's chat template, streamed or not
    GET  /metrics                   Prometheus text format (`swarmnode.metrics.API_REGISTRY`)
    GET  /api/v1/state              the swarm's state as `swarmnode status --json` prints it, plus load
    GET  /                          the dashboard (static files under `static/`, no CDN)

Every error is OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`, with its HTTP status;
the server goes on serving after any of them. With API keys (`api.keys`), every `/v1/` request needs
`Authorization: Bearer KEY` of a key in the file (401 otherwise, saying what was wrong), and each generation
is admitted against its key's limits (`api.limits`: 429 with `Retry-After`); `/metrics`, the dashboard and its
`/api/v1/state` stay open (they show the swarm, not prompts): bind `--host` where only operators reach them,
or put them behind your proxy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from swarmnode import metrics
from swarmnode.api.keys import APIKey, KeyRing
from swarmnode.api.limits import Admission, Limits
from swarmnode.api.schemas import APIError, ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return f"{where}: {first.get('msg')}" + (f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""), param


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def create_app(engine, keys: KeyRing | None = None) -> FastAPI:
    """The app over an `Engine` (see `swarmnode.api.engine`); with `keys`, `/v1/` is for their holders only,
    within their limits."""
    from swarmnode.api.dashboard import mount_dashboard

    app = FastAPI(title="swarmnode", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    limits = Limits() if keys is not None else None
    _add_error_handlers(app)
    _add_key_check(app, keys)  # inside the request counter: refused requests are counted too
    _add_request_counter(app)
    _add_model_routes(app, engine)
    _add_completion_routes(app, engine, limits)
    _add_state_routes(app, engine)
    mount_dashboard(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answered OpenAI-shaped, with its HTTP status."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        logger.exception("request failed")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))


_KEY_HEADERS = ("x-api-key", "api-key", "openai-api-key")  # where keys are sent by mistake (Azure, Anthropic style)
_UNAUTHORIZED = {"WWW-Authenticate": 'Bearer realm="swarmnode"'}


def _caller(keys: KeyRing, headers) -> APIKey:
    """The key holder a request comes from, or `APIError` 401 saying what is wrong with its credentials."""
    how = "send it as 'Authorization: Bearer KEY' (OpenAI's clients do that with api_key=)"
    auth = headers.get("authorization")
    if auth is None:
        misplaced = next((h for h in _KEY_HEADERS if h in headers), None)
        if misplaced is not None:
            raise APIError(401, f"the API key was sent in the {misplaced!r} header, which this server does not "
                                f"read: {how}", code="invalid_api_key", headers=_UNAUTHORIZED)
        raise APIError(401, f"this server needs an API key: {how}; its operator gives out keys",
                       code="invalid_api_key", headers=_UNAUTHORIZED)
    scheme, _, value = auth.strip().partition(" ")
    value = value.strip()
    if scheme.lower() != "bearer" or not value:
        raise APIError(401, f"the Authorization header must be 'Bearer KEY', got the {scheme[:20]!r} scheme"
                            f"{'' if value else ' and no key'}", code="invalid_api_key", headers=_UNAUTHORIZED)
    key = keys.lookup(value)
    if key is None:
        shown = f"{value[:6]}...{value[-4:]}" if len(value) > 12 else "***"
        raise APIError(401, f"the API key {shown} is not valid on this server (unknown, or revoked)",
                       code="invalid_api_key", headers=_UNAUTHORIZED)
    return key


def _add_key_check(app: FastAPI, keys: KeyRing | None) -> None:
    """`/v1/` requests without a valid key are answered 401 before anything else runs."""
    if keys is None:
        return

    @app.middleware("http")
    async def _authenticate(request: Request, call_next):
        if not request.url.path.startswith("/v1/"):
            return await call_next(request)
        try:
            key = _caller(keys, request.headers)
        except APIError as exc:
            metrics.API_KEY_REQUESTS.labels("-", str(exc.status)).inc()
            return _error_response(exc)
        request.state.api_key = key
        response = await call_next(request)
        metrics.API_KEY_REQUESTS.labels(key.name, str(response.status_code)).inc()
        return response


def _admit(request: Request, limits: Limits | None, prompt_tokens: int) -> Admission | None:
    """The admission of a generation against its caller's key (None when the server has no keys)."""
    if limits is None:
        return None
    return limits.admit(request.state.api_key, prompt_tokens)


def _add_request_counter(app: FastAPI) -> None:
    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        path = request.url.path
        if path.startswith("/v1/") or path in ("/metrics", "/api/v1/state"):
            metrics.API_REQUESTS.labels(path, str(response.status_code)).inc()
        return response


def _check_model(engine, name: str) -> None:
    if name != engine.model_id:
        raise APIError(404, f"the model {name!r} does not exist here; this server serves {engine.model_id!r}",
                       param="model", code="model_not_found")


def _add_model_routes(app: FastAPI, engine) -> None:
    """`/v1/models`: the one model this server serves."""

    def card() -> dict:
        return {"id": engine.model_id, "object": "model", "created": engine.created, "owned_by": "swarmnode"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}")  # Hub ids hold a slash
    async def model(name: str):
        _check_model(engine, name)
        return card()


def _add_completion_routes(app: FastAPI, engine, limits: Limits | None) -> None:
    """`/v1/completions` and `/v1/chat/completions`, streamed or not."""

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        _check_model(engine, req.model)
        req.check_supported()
        prompt_ids = engine.text_prompt(req.prompt)
        return await _generate(engine, request, req, prompt_ids, 16, _CompletionShape(engine.model_id), limits)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatCompletionRequest):
        _check_model(engine, req.model)
        req.check_supported()
        try:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in req.messages]
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        prompt_ids = engine.chat_prompt(messages)
        return await _generate(engine, request, req, prompt_ids, engine.default_max_tokens,
                               _ChatShape(engine.model_id), limits)


def _add_state_routes(app: FastAPI, engine) -> None:
    """`/metrics` (Prometheus) and `/api/v1/state` (the dashboard's feed)."""

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.API_REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/v1/state")
    async def state():
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, engine.state)
        except Exception as exc:  # safe: whatever reading the DHT raised becomes a 503 naming it
            raise APIError(503, f"could not read the swarm's state: {exc}", type="server_error") from exc


async def _generate(engine, request: Request, req, prompt_ids: list[int], default_max: int, shape,
                    limits: Limits | None) -> Response:
    """Run one completion: server-sent events when `req.stream`, else one JSON body (499 on a disconnect),
    admitted against the caller's key first when the server has keys."""
    params = engine.params(req, prompt_ids, default_max)
    admission = _admit(request, limits, len(prompt_ids))
    on_tokens = admission.spend if admission is not None else None
    ident, created = shape.new_id(), int(time.time())
    if req.stream:
        events = _events(engine.stream(prompt_ids, params, on_tokens=on_tokens), req, shape, ident, created,
                         admission)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(admission.close) if admission is not None else None)
    task = asyncio.ensure_future(engine.complete(prompt_ids, params, on_tokens=on_tokens))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
    finally:
        if not task.done():
            task.cancel()
        if admission is not None:
            admission.close()
    result = task.result()
    text = (engine.decode(prompt_ids) if getattr(req, "echo", False) else "") + result.text
    return JSONResponse(shape.whole(ident, created, text, result))


async def _events(stream, req, shape, ident: str, created: int, admission: Admission | None = None):
    """A generation's server-sent events: text chunks, the finish (and usage when asked for), `[DONE]`; the
    key's admission ends with the stream."""
    try:
        first = shape.first_chunk(ident, created)
        if first is not None:
            yield _sse(first)
        async for kind, value in stream:
            if kind == "text":
                if value:
                    yield _sse(shape.chunk(ident, created, value, None))
            else:
                yield _sse(shape.chunk(ident, created, None, value.finish_reason,
                                       value.usage() if req.include_usage_in_stream else None))
                if req.include_usage_in_stream:
                    yield _sse(shape.usage_chunk(ident, created, value.usage()))
    except APIError as exc:
        yield _sse(exc.body())
    finally:
        await stream.aclose()
        if admission is not None:
            admission.close()
    yield _sse("[DONE]")


class _CompletionShape:
    def __init__(self, model_id: str):
        self.model = model_id

    @staticmethod
    def new_id() -> str:
        return "cmpl-" + uuid.uuid4().hex

    def first_chunk(self, ident, created):
        return None

    def chunk(self, ident, created, text, finish, usage=None) -> dict:
        return {"id": ident, "object": "text_completion", "created": created, "model": self.model,
                "choices": [{"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}]}

    def usage_chunk(self, ident, created, usage) -> dict:
        return {"id": ident, "object": "text_completion", "created": created, "model": self.model,
                "choices": [], "usage": usage}

    def whole(self, ident, created, text, result) -> dict[str, Any]:
        return {"id": ident, "object": "text_completion", "created": created, "model": self.model,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": result.finish_reason}],
                "usage": result.usage()}


class _ChatShape:
    def __init__(self, model_id: str):
        self.model = model_id

    @staticmethod
    def new_id() -> str:
        return "chatcmpl-" + uuid.uuid4().hex

    def _chunk(self, ident, created, delta, finish) -> dict:
        return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    def first_chunk(self, ident, created):
        return self._chunk(ident, created, {"role": "assistant", "content": ""}, None)

    def chunk(self, ident, created, text, finish, usage=None) -> dict:
        return self._chunk(ident, created, {} if text is None else {"content": text}, finish)

    def usage_chunk(self, ident, created, usage) -> dict:
        return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.model,
                "choices": [], "usage": usage}

    def whole(self, ident, created, text, result) -> dict[str, Any]:
        return {"id": ident, "object": "chat.completion", "created": created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": result.finish_reason}],
                "usage": result.usage()}
