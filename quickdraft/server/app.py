"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, vLLM's /health,
/tokenize, /detokenize and /metrics, over one LLM whose scheduler runs on an engine thread (async_engine).

Errors have OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for invalid input (pydantic's
and SamplingParams' checks, a prompt over the context), 401 without the API key, 404 for another model name,
413 for a body over the limit, 503 with Retry-After when the queue is full (and while shutting down), 500 when
the engine fails a request (the server goes on serving the others); FastAPI's own refusals (a body that is not
JSON or nests too deeply to read, an unknown path) have that body too.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from quickdraft.api import LLM
from quickdraft.errors import QuickdraftError
from quickdraft.server.async_engine import AsyncEngine
from quickdraft.server.metrics import ServerMetrics
from quickdraft.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        DetokenizeResponse, ModelCard, ModelList, SamplingFields, TokenizeRequest,
                                        TokenizeResponse, error_body)
from quickdraft.server.serving import GenerationFailed, OpenAIServing, param_of

UNPROTECTED_PATHS = ("/health", "/metrics")  # what a load balancer and Prometheus read without the key


@dataclass
class ServerConfig:
    served_model_name: str | None = None  # None: the LLM's model name
    api_key: str | None = None  # None: no authentication
    max_queue: int = 256  # unfinished sequences (running + waiting) the server holds before answering 503
    max_body_bytes: int = 1 << 20
    drain_grace_s: float = 30.0  # on shutdown, how long in-flight requests may take to finish


class ServerState:
    """What the routes share: the LLM, its engine thread, the metrics, and whether the server is draining."""

    def __init__(self, llm: LLM, config: ServerConfig):
        self.llm = llm
        self.config = config
        self.model_name = config.served_model_name or llm.model_name
        self.metrics = ServerMetrics(self.model_name)
        self.engine = AsyncEngine(llm.new_scheduler(), config.max_queue, observer=self.metrics)
        self.serving = OpenAIServing(llm, self.engine, self.model_name)
        self.draining = False

    def check_accepting(self) -> None:
        if self.draining or not self.engine.alive:
            raise ApiError(503, "the server is shutting down")

    async def drain(self, grace_s: float) -> None:
        """Stop taking requests (503) and let those in flight finish, for at most grace_s; then end the rest."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.engine.num_unfinished and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_unfinished:
            await self.engine.stop("the server shut down before this request finished")


class ApiKeyMiddleware:
    """Every path but /health and /metrics needs `Authorization: Bearer <key>`; checked before the body is
    read, so that an unauthenticated client learns nothing else."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in UNPROTECTED_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not secrets.compare_digest(given, self.expected):
            response = JSONResponse(error_body(401, "invalid or missing API key: send 'Authorization: Bearer <key>'"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Request bodies over max_bytes get 413 before any parsing: the body is read (counted, chunked uploads
    too) and then replayed to the app."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the connection's own messages (a disconnect)

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        response = JSONResponse(error_body(413, f"the request body is over {self.max_bytes} bytes"), status_code=413)
        await response(scope, receive, send)


def _include_usage(body: SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work) -> Any:
    """Run `work` (a coroutine) unless the client disconnects first; then cancel it (which aborts its engine
    requests) and raise ApiError (nobody reads the answer)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its cleanup runs at the loop's next turn
    if task.done() and not task.cancelled():
        return task.result()
    raise ApiError(499, "the client disconnected")


def _http_error_message(exc: HTTPException) -> str:
    """What went wrong where FastAPI says only "There was an error parsing the body": its JSON reader raised
    something other than a JSON syntax error (which is a validation error), e.g. RecursionError for a body
    nested deeper than Python's recursion limit, or UnicodeDecodeError for bytes that are not UTF-8."""
    if isinstance(exc.__cause__, RecursionError):
        return (f"the request body's JSON is nested too deeply to parse (Python's JSON reader stops short of "
                f"{sys.getrecursionlimit()} levels); send a flatter body")
    if exc.status_code == 400 and exc.__cause__ is not None:
        return f"the request body is not valid JSON: {type(exc.__cause__).__name__}: {exc.__cause__}"
    return str(exc.detail)


def create_app(llm: LLM, config: ServerConfig | None = None) -> FastAPI:
    """An app over `llm`; its engine thread starts and stops with the app's lifespan."""
    config = config or ServerConfig()
    state = ServerState(llm, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            await state.engine.stop()

    app = FastAPI(title="quickdraft", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)  # added last: runs first

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return _error_response(ApiError(400, message, param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """FastAPI's and Starlette's own refusals (a path or method the app does not have, a body its JSON
        reader raised on) in OpenAI's body too."""
        return _error_response(ApiError(exc.status_code, _http_error_message(exc), headers=exc.headers))

    @app.exception_handler(QuickdraftError)
    async def quickdraft_error(request: Request, exc: QuickdraftError) -> JSONResponse:
        return _error_response(ApiError(400, str(exc), param_of(str(exc))))

    serving = state.serving

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if state.draining or not state.engine.alive else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name, root=llm.model_name, max_model_len=serving.max_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.check_accepting()
        return await _answer(await serving.completions(body), body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state.check_accepting()
        return await _answer(await serving.chat_completions(body), body, request, chat=True)

    async def _answer(generation, body: CompletionRequest | ChatCompletionRequest, request: Request,
                      chat: bool) -> Response:
        """A stream of SSE chunks, or the whole response once every completion has finished."""
        if body.stream:
            return StreamingResponse(serving.stream(generation, chat=chat, include_usage=_include_usage(body)),
                                     media_type="text/event-stream")
        texts = await _collect(generation, request)
        build = serving.chat_response if chat else serving.completion_response
        return JSONResponse(build(generation, texts, body.return_token_ids).model_dump(mode="json"))

    async def _collect(generation, request: Request) -> list[str]:
        try:
            return await _unless_disconnected(request, serving.collect(generation))
        except GenerationFailed as exc:
            raise ApiError(500, str(exc)) from None

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", "prompt")
        if body.messages is not None:
            tokens = serving.chat_prompt(body.messages)
        else:
            tokens = serving.tokenize(body.prompt, "prompt", body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=serving.max_len, tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        if llm.tokenizer is None:
            raise ApiError(400, f"model '{state.model_name}' has no tokenizer", "tokens")
        vocab = llm.engine.target.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens must be ids in [0, {vocab}); got {bad[:5]}", "tokens")
        return DetokenizeResponse(prompt=llm.tokenizer.decode(body.tokens))

    return app
