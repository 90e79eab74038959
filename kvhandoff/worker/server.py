"""The OpenAI-compatible HTTP server for one colocated instance.

The engine runs in its own thread (EngineLoop) and reports each request's progress through a callback
on that thread. `RequestStream` carries those outputs into the asyncio world: the callback only
schedules `queue.put_nowait` on the event loop with call_soon_threadsafe, so the engine never waits
on HTTP. Whoever stops listening before the final output (client gone, handler cancelled) calls
`RequestStream.close()`, which aborts the request in the engine and so frees its KV blocks.

Every error reaches the client as OpenAI's `{"error": {message, type, param, code}}`; client mistakes
are 400/404 with a message that says what to fix, and unexpected exceptions are a generic 500 whose
traceback goes to the server log only.
"""
from __future__ import annotations

import asyncio
import time
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvhandoff.engine.request import RequestOutput, Resume, SamplingParams
from kvhandoff.wire import api as P
from kvhandoff.wire import messages as M
from kvhandoff.wire.http import (CHAT, COMPLETIONS, CONTENT_TYPE, SSEResponse, endpoint_label, parse_body, sse_event,
                                  validation_message, wait_disconnect)
from kvhandoff.wire.modes import FinishReason, Role
from kvhandoff.worker.metrics import Metrics

if TYPE_CHECKING:
    from kvhandoff.engine.loop import EngineLoop
    from kvhandoff.worker.handoff import WorkerHandoff

log = logging.getLogger("kvhandoff.worker")

@dataclass
class EngineInfo:
    """What the HTTP layer needs to know about the engine besides its loop."""
    served_name: str
    max_model_len: int
    tokenizer: Any                              # encode, decode, apply_chat_template
    pool_tokens: int | None = None              # KV pool capacity: caps the default max_tokens
    aliases: set[str] = field(default_factory=set)   # other names a request may use for the model
    compute: dict = field(default_factory=dict)      # device, dtype, threads, kernels: shown in /health

    @classmethod
    def from_engine(cls, engine, alias: str | None = None) -> "EngineInfo":
        return cls(served_name=engine.served_name, max_model_len=engine.max_model_len, tokenizer=engine.tokenizer,
                   pool_tokens=engine.num_blocks * engine.block_size,
                   aliases={alias} if alias else set(), compute=engine.compute_facts())


class RequestStream:
    """One request's outputs, carried from the engine thread into asyncio; aborts on early close."""

    def __init__(self, loop: "EngineLoop", request_id: str, on_finished: Callable[[RequestOutput], None]):
        self.loop, self.request_id, self._on_finished = loop, request_id, on_finished
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.aio = asyncio.get_running_loop()
        self.done = False          # final output consumed by us
        self.closed = False

    def submit(self, prompt_ids: list[int], params: SamplingParams, resume: Resume | None = None) -> "RequestStream":
        try:
            self.loop.submit(self.request_id, prompt_ids, params, self.on_output, resume=resume)
        except ValueError as e:       # the engine's message is written for the client
            raise P.APIError(400, str(e)) from None
        except RuntimeError as e:     # the engine loop is stopping
            raise P.APIError(503, str(e), type="service_unavailable") from None
        return self

    def on_output(self, out: RequestOutput) -> None:
        """Engine thread: one output of the request (EngineLoop's callback)."""
        # Metrics here, so requests nobody listens to any more (aborted) still count.
        if out.finished:
            self._on_finished(out)
        try:
            self.aio.call_soon_threadsafe(self.queue.put_nowait, out)
        except RuntimeError:          # event loop closed: the server is shutting down
            pass

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.done:
            out = await self.queue.get()
            self.done = out.finished
            yield out

    def close(self) -> None:
        """Abort the request in the engine unless it finished; idempotent."""
        if not self.done and not self.closed:
            self.loop.abort(self.request_id)
        self.closed = True


class Server:
    """Request handling behind the routes: validation, tokenization, engine I/O, response shapes."""

    def __init__(self, loop: "EngineLoop", info: EngineInfo, max_in_flight: int | None = None,
                 queue_wait_s: float = 10.0, handoff: "WorkerHandoff | None" = None, metrics: Metrics | None = None):
        self.loop, self.info = loop, info
        self.metrics = metrics or Metrics()
        self.active: dict[str, RequestStream] = {}
        self.handoff = handoff      # on a prefill or decode worker (worker/handoff.py)
        # Backpressure: at most max_in_flight requests held (running or queued for the engine); one
        # more waits up to queue_wait_s for a slot, then gets 429 with Retry-After. None: unbounded.
        self.max_in_flight, self.queue_wait_s = max_in_flight, queue_wait_s
        self.in_flight = 0
        self.slot_freed = asyncio.Event()       # set by leave(): waiters in admit() look again

    async def admit(self) -> None:
        """Take a slot (asyncio thread only), waiting a bounded time for one; 429 if none frees up."""
        if self.max_in_flight is not None:
            deadline = time.monotonic() + self.queue_wait_s
            while self.in_flight >= self.max_in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise P.APIError(429, f"the server is at capacity ({self.in_flight} requests in flight, its limit "
                                     f"--max-in-flight); retry later", type="server_busy", code="server_busy",
                                     retry_after=max(1, round(self.queue_wait_s)))
                self.slot_freed.clear()
                try:
                    await asyncio.wait_for(self.slot_freed.wait(), left)
                except TimeoutError:
                    pass
        self.in_flight += 1

    async def prefill(self, kv, prompt_ids: list[int], params: SamplingParams,
                      first_sse: Callable[[RequestOutput], str], started: float) -> Response:
        """Prefill side of a handoff: it holds a slot like any request, until its KV is handed over
        (the streamed answer's end)."""
        try:
            await self.admit()
        except P.APIError as exc:
            # Refused before it started: a decode worker that registered (push) hears it at once, and
            # frees the blocks it reserved, instead of waiting out the registration's time to live.
            self.handoff.refused(kv, exc.message)
            raise
        try:
            return await self.handoff.prefill(kv, prompt_ids, params, first_sse, started, on_close=self.leave)
        except BaseException:
            self.leave()
            raise

    def leave(self) -> None:
        assert self.in_flight > 0
        self.in_flight -= 1
        self.slot_freed.set()

    # -- validation ---------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        # A missing model is accepted (curl convenience); a wrong one is an error, as with OpenAI.
        if model and model != self.info.served_name and model not in self.info.aliases:
            raise P.APIError(404, f"model '{model}' not found; this server serves '{self.info.served_name}'",
                             param="model", code="model_not_found")

    def check_length(self, num_prompt: int, max_tokens: int | None, prompt_field: str,
                     max_field: str = "max_tokens") -> int:
        """Return max_tokens (defaulting to the rest of the context) once prompt + max_tokens fit."""
        limit = self.info.max_model_len
        if num_prompt >= limit:
            raise P.APIError(400, f"the prompt is {num_prompt} tokens but this model's context length is "
                             f"{limit} tokens (prompt plus at least one generated token); shorten the prompt",
                             param=prompt_field, code="context_length_exceeded")
        if max_tokens is None:     # chat's default: as much as the context (and the KV pool) allows
            return max(1, min(limit, self.info.pool_tokens or limit) - num_prompt)
        if max_tokens < 1:
            raise P.APIError(400, f"{max_field} must be at least 1, got {max_tokens}", param=max_field)
        if num_prompt + max_tokens > limit:
            raise P.APIError(400, f"the prompt ({num_prompt} tokens) plus {max_field} ({max_tokens}) is "
                             f"{num_prompt + max_tokens} tokens, over this model's context length of {limit}; "
                             f"set {max_field} to at most {limit - num_prompt} or shorten the prompt",
                             param=max_field, code="context_length_exceeded")
        return max_tokens

    def completion_prompt(self, req: P.CompletionRequest) -> list[int]:
        # Token ids are range-checked by the engine (EngineLoop.submit raises ValueError -> 400).
        ids = self.info.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
        if not ids:
            raise P.APIError(400, "prompt is empty after tokenization", param="prompt")
        return ids

    def chat_prompt(self, req: P.ChatCompletionRequest) -> list[int]:
        try:
            text = self.info.tokenizer.apply_chat_template(req.template_messages(), add_generation_prompt=True)
        except ValueError as e:
            raise P.APIError(400, f"cannot build a chat prompt: {e}; use /v1/completions with a plain prompt",
                             param="messages") from None
        ids = self.info.tokenizer.encode(text)
        if not ids:
            raise P.APIError(400, "the chat prompt is empty", param="messages")
        return ids

    # -- engine I/O ---------------------------------------------------------------------------------
    async def open_stream(self, endpoint: str, rid: str, prompt_ids: list[int], params: SamplingParams,
                          kv=None) -> RequestStream:
        def on_finished(out: RequestOutput) -> None:
            self.metrics.finished(endpoint, out)
        stream = RequestStream(self.loop, rid, on_finished)
        await self.admit()
        try:
            if kv is None:
                stream.submit(prompt_ids, params)
            elif isinstance(kv, M.ColocatedParams):     # the router has it computed here, or continued
                stream.submit(prompt_ids, params, Resume(kv.resume_token_ids, kv.emitted_chars)
                              if kv.resume_token_ids else None)
            else:           # decode side of a handoff: the KV comes from a prefill worker
                await self.handoff.submit_decode(kv, stream, prompt_ids, params)
        except BaseException:
            self.leave()
            raise
        self.active[rid] = stream
        return stream

    def kv_route(self, req, request: Request, prompt_ids: list[int]):
        """For a request carrying kv_transfer_params: authenticate it and return (kv, prompt_ids) —
        the decode side of a pull uses the prefill's token ids, never its own tokenization."""
        if req.kv_transfer_params is None:
            return None, prompt_ids
        if self.handoff is None:
            raise P.APIError(400, "this worker runs colocated (--role both) and takes no handoffs",
                             param="kv_transfer_params")
        kv = self.handoff.parse(req.kv_transfer_params, request)
        remote = getattr(kv, "remote", None)
        return kv, (list(remote.prompt_token_ids) if remote is not None else prompt_ids)

    def release(self, stream: RequestStream) -> None:
        stream.close()
        if self.active.pop(stream.request_id, None) is not None:
            self.leave()

    def abort_all(self) -> None:
        """Shutdown: end every in-flight generation so connections drain quickly."""
        for stream in list(self.active.values()):
            stream.close()

    async def collect(self, stream: RequestStream, request: Request) -> tuple[str, list[int], RequestOutput] | None:
        """Run a non-streaming request to the end: its text, its token ids and the final output; None
        if the client disconnected first (aborted)."""
        async def drain() -> tuple[str, list[int], RequestOutput]:
            pieces, ids = [], []
            async for out in stream:
                pieces.append(out.new_text)
                ids += out.new_token_ids
            return "".join(pieces), ids, out

        task = asyncio.ensure_future(drain())
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:                       # also on cancellation of this handler
            gone.cancel()
            if not task.done():
                task.cancel()
            self.release(stream)
        return task.result() if task.done() and not task.cancelled() else None

    async def sse(self, stream: RequestStream, first: list[dict], chunk: Callable[[RequestOutput], dict],
                  usage_chunk: dict | None, ids: TokenIds | None = None,
                  notes: EventNotes | None = None) -> AsyncIterator[str]:
        """SSE body: `first` chunks, one chunk per engine output with text, the final chunk (with
        `timings`), then the usage chunk when asked for, then [DONE]. Closing early aborts. `ids`:
        the client asked for token ids (each chunk carries those generated since the last one).
        `notes`: the router asked (messages.EventNote before every event)."""
        note = notes.note if notes else (lambda tags, text="": "")
        try:
            for c in first:
                yield note(" head") + sse_event(ids.first(c) if ids else c)
            async for out in stream:
                if out.finished and out.finish_reason == FinishReason.ERROR:
                    yield note(" error") + sse_event(P.error_body(f"generation failed: {out.error}", "server_error"))
                    break
                if ids:
                    ids.pending += out.new_token_ids
                if notes:
                    notes.pending += out.new_token_ids
                if not out.finished and not out.new_text:
                    continue           # detokenizer held text back (partial UTF-8 or stop-string prefix)
                if notes and notes.is_first(out) and out.finished:
                    # The prefill sent this token's chunk as a non-final one: the same here (the router
                    # drops it), then the end on its own.
                    c = chunk(replace(out, finished=False, finish_reason=None))
                    yield notes.note(" first", text=out.new_text) + sse_event(ids.chunk(c) if ids else c)
                    out = replace(out, new_text="", new_token_ids=[])
                tags = " first" if notes and notes.is_first(out) else ""
                c = ids.chunk(chunk(out)) if ids else chunk(out)
                if out.finished:
                    c["timings"] = out.timings
                    if out.handoff is not None:
                        c["handoff"] = out.handoff
                    tags += " final"
                yield note(tags, text=out.new_text) + sse_event(c)
                if out.finished and usage_chunk is not None:
                    usage_chunk.update(usage=P.usage(out.num_prompt_tokens, out.num_output_tokens,
                                                     out.num_cached_tokens), timings=out.timings)
                    if out.handoff is not None:         # the last chunk carries it too
                        usage_chunk["handoff"] = out.handoff
                    yield note(" final") + sse_event(usage_chunk)
            yield "data: [DONE]\n\n"
        finally:                       # client disconnect cancels us here: abort frees the blocks
            self.release(stream)

    # -- endpoints ----------------------------------------------------------------------------------
    async def respond(self, endpoint: "Endpoint", req, request: Request, started: float) -> Response:
        """/v1/completions and /v1/chat/completions: one path; `endpoint` builds the prompt and shapes
        the answer. `started`: perf_counter when the request reached its route."""
        self.check_model(req.model)
        req.check_supported()
        kv, prompt_ids = self.kv_route(req, request, endpoint.prompt(self, req))
        params = sampling_params(req, endpoint.max_tokens(self, req, len(prompt_ids)))
        rid = kv.handoff_id if kv else P.new_id(endpoint.id_prefix)
        created, model = (kv.created if kv and kv.created else P.now()), self.info.served_name
        chat = endpoint.path == CHAT
        if kv is not None and kv.role == Role.PREFILL:
            def first_sse(out: RequestOutput) -> str:
                """The client's stream up to and with the first token, as `sse` would send it."""
                ids = TokenIds(prompt_ids, chat) if req.return_token_ids else None
                events = [sse_event(ids.first(c) if ids else c) for c in endpoint.first_chunks(rid, created, model)]
                if out.new_text:        # (none if the detokenizer holds its text back: neither does `sse`)
                    if ids:
                        ids.pending += out.new_token_ids
                    c = endpoint.chunk(rid, created, model, replace(out, finished=False, finish_reason=None))
                    events.append(sse_event(ids.chunk(c) if ids else c))
                return "".join(events)
            return await self.prefill(kv, prompt_ids, params, first_sse, started)
        stream = await self.open_stream(endpoint.path, rid, prompt_ids, params, kv)
        if req.stream:
            usage_chunk = ({"id": rid, "object": endpoint.chunk_object, "created": created, "model": model,
                            "choices": []} if req.include_usage else None)
            ids = TokenIds(prompt_ids, chat) if req.return_token_ids else None
            notes = None if kv is None else EventNotes.of(kv)
            body = self.sse(stream, endpoint.first_chunks(rid, created, model),
                            lambda o: endpoint.chunk(rid, created, model, o), usage_chunk, ids, notes)
            return SSEResponse(body, on_close=lambda: self.release(stream))
        result = await self.collect(stream, request)
        if result is None:
            return Response(status_code=499)   # nobody is listening; nginx's "client closed request"
        text, output_ids, final = result
        usage = P.usage(final.num_prompt_tokens, final.num_output_tokens, final.num_cached_tokens)
        body = endpoint.response(rid, created, model, text, final.finish_reason, usage, final.timings)
        if req.return_token_ids:
            TokenIds(prompt_ids, endpoint.path == CHAT).answer(body, output_ids)
        return engine_failure(final) or JSONResponse(with_handoff(body, final))


@dataclass
class EventNotes:
    """A stream the router follows (a request with kv_transfer_params): messages.EventNote before
    every event, with the ids since the last one and the text emitted so far."""
    handoff: bool                       # the first output is the token a prefill worker sampled
    chars: int = 0
    pending: list[int] = field(default_factory=list)
    num_outputs: int = 0

    @classmethod
    def of(cls, kv) -> "EventNotes":
        resumed = kv.emitted_chars if isinstance(kv, M.ColocatedParams) else 0
        return cls(handoff=not isinstance(kv, M.ColocatedParams), chars=resumed)

    def is_first(self, out: RequestOutput) -> bool:
        """Is this output the first token of a handoff (the router may have sent it already)?"""
        return self.handoff and out.num_output_tokens == 1 and bool(out.new_text)

    def note(self, tags: str, text: str = "") -> str:
        """The note before an event; `tags` each with a space before it (" first final")."""
        self.chars += len(text)
        line = M.note_line(self.pending, self.chars, tags)
        self.pending = []
        return line


@dataclass
class TokenIds:
    """vLLM's `return_token_ids`: a client that resends a conversation as token ids needs exactly the
    ids it was given (re-tokenizing text can split differently and cut reuse short). Completions put
    `prompt_token_ids` in the choice, chat at the top of the response (a stream: in its first chunk);
    every choice or chunk carries `token_ids`, the ids generated (since the previous chunk)."""
    prompt_ids: list[int]
    chat: bool
    pending: list[int] = field(default_factory=list)     # generated, not yet sent (text held back)
    prompt_sent: bool = False

    def answer(self, body: dict, output_ids: list[int]) -> dict:
        (body if self.chat else body["choices"][0])["prompt_token_ids"] = list(self.prompt_ids)
        body["choices"][0]["token_ids"] = list(output_ids)
        return body

    def first(self, chunk: dict) -> dict:
        """A chunk sent before any token (chat's role chunk): the prompt's ids go there."""
        if self.chat and not self.prompt_sent:
            chunk["prompt_token_ids"], self.prompt_sent = list(self.prompt_ids), True
        return chunk

    def chunk(self, chunk: dict) -> dict:
        choice = chunk["choices"][0]
        if not self.prompt_sent:
            (chunk if self.chat else choice)["prompt_token_ids"], self.prompt_sent = list(self.prompt_ids), True
        choice["token_ids"], self.pending = self.pending, []
        return chunk


@dataclass(frozen=True)
class Endpoint:
    """What differs between the two generation endpoints."""
    path: str
    id_prefix: str
    chunk_object: str
    prompt: Callable[[Server, Any], list[int]]
    max_tokens: Callable[[Server, Any, int], int]      # (server, request, prompt length) -> checked max_tokens
    first_chunks: Callable[[str, int, str], list[dict]]
    chunk: Callable[[str, int, str, RequestOutput], dict]
    response: Callable[..., dict]


def _chat_max_tokens(server: Server, req, num_prompt: int) -> int:
    field_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return server.check_length(num_prompt, req.requested_max_tokens, "messages", field_name)


COMPLETION = Endpoint(
    COMPLETIONS, "cmpl", "text_completion",
    prompt=lambda server, req: server.completion_prompt(req),
    max_tokens=lambda server, req, n: server.check_length(n, req.max_tokens if req.max_tokens is not None else 16,
                                                          "prompt"),
    first_chunks=lambda rid, created, model: [],
    chunk=lambda rid, created, model, o: P.completion_chunk(rid, created, model, o.new_text,
                                                            o.finish_reason if o.finished else None),
    response=P.completion_response)
CHAT_COMPLETION = Endpoint(
    CHAT, "chatcmpl", "chat.completion.chunk",
    prompt=lambda server, req: server.chat_prompt(req),
    max_tokens=_chat_max_tokens,
    # OpenAI's first chunk announces the role; content follows in later deltas.
    first_chunks=lambda rid, created, model: [P.chat_chunk(rid, created, model, {"role": "assistant", "content": ""})],
    chunk=lambda rid, created, model, o: P.chat_chunk(rid, created, model,
                                                      {"content": o.new_text} if o.new_text else {},
                                                      o.finish_reason if o.finished else None),
    response=P.chat_response)


class RejectionLog:
    """Rejected control messages (no or wrong token, malformed /kv/* bodies) are logged with who sent
    them and why, never with the token; at most PER_SECOND lines a second, so a flood cannot fill the
    disk (the rest are counted and reported in one line)."""
    PER_SECOND = 10

    def __init__(self):
        self.window, self.logged, self.suppressed = 0.0, 0, 0

    def note(self, request: Request, err: P.APIError) -> None:
        now = time.monotonic()
        if now - self.window >= 1.0:
            if self.suppressed:
                log.warning("%d more rejected control requests not logged", self.suppressed)
            self.window, self.logged, self.suppressed = now, 0, 0
        if self.logged >= self.PER_SECOND:
            self.suppressed += 1
            return
        self.logged += 1
        client = request.client.host if request.client else "?"
        log.warning("rejected %s %s from %s: %d %s", request.method, request.url.path, client, err.status, err.message)


def sampling_params(req: P.CompletionRequest | P.ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    """A request's sampling fields as the engine's parameters; raises APIError with the offending
    field named."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    top_k = req.top_k or 0
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if top_k == -1 else top_k,      # -1 is vLLM's spelling of "off"
        seed=req.seed,
        stop=[s for s in stop if s],
        ignore_eos=bool(req.ignore_eos),
        min_tokens=req.min_tokens or 0,
    )
    try:
        params.validate()
    except ValueError as e:
        raise P.APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
    return params


def with_handoff(body: dict, final: RequestOutput) -> dict:
    if final.handoff is not None:
        body["handoff"] = final.handoff
    return body


def engine_failure(final: RequestOutput) -> JSONResponse | None:
    """The error response for a request the engine ended without an answer (already counted in the
    metrics under its finish reason, so not raised as an APIError, which would count it again)."""
    if final.finish_reason == FinishReason.ERROR:
        log.error("request %s failed in the engine: %s", final.request_id, final.error)
        return JSONResponse(P.error_body(f"generation failed: {final.error}", "server_error"), status_code=500)
    if final.finish_reason == FinishReason.ABORT:
        return JSONResponse(P.error_body("the request was aborted (cancelled by the router, or the server is "
                                         "shutting down); retry",
                                         "service_unavailable"), status_code=503)
    return None


# ---------------------------------------------------------------------------------------------------
# App

def build_app(loop: "EngineLoop", engine_info: EngineInfo, max_in_flight: int | None = None,
              queue_wait_s: float = 10.0, handoff: "WorkerHandoff | None" = None,
              metrics: Metrics | None = None) -> FastAPI:
    """The OpenAI server's app; a prefill or decode worker's `handoff` adds its routes after
    (handoff.attach_worker_routes)."""
    app = FastAPI(title="kvhandoff", version="0.1.0")
    srv = Server(loop, engine_info, max_in_flight, queue_wait_s, handoff, metrics)
    app.state.server = srv

    def error_response(request: Request, err: P.APIError) -> JSONResponse:
        srv.metrics.rejected(endpoint_label(request), err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    rejections = RejectionLog()

    @app.exception_handler(P.APIError)
    async def on_api_error(request: Request, exc: P.APIError):
        if exc.status >= 500:
            log.error("%s %s: %s", request.method, request.url.path, exc.message)
        elif exc.code == "unauthorized" or request.url.path.startswith("/kv/") or \
                (exc.param or "").startswith("kv_transfer_params"):
            rejections.note(request, exc)
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        # FastAPI answers 422 with its own shape; OpenAI clients expect 400 and {"error": ...}.
        message, param = validation_message(exc.errors())
        return error_response(request, P.APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        err = P.http_error(request.method, request.url.path, exc.status_code, exc.detail)
        srv.metrics.rejected(endpoint_label(request), exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(request, P.APIError(500, "internal server error; see the server log"))

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        started = time.perf_counter()
        return await srv.respond(COMPLETION, await parse_body(request, P.CompletionRequest), request, started)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        started = time.perf_counter()
        return await srv.respond(CHAT_COMPLETION, await parse_body(request, P.ChatCompletionRequest), request, started)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(engine_info)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        srv.check_model(model_id)
        return model_card(engine_info)

    @app.get("/health")
    async def health():
        stats = {"model": engine_info.served_name, "role": srv.handoff.role if srv.handoff else Role.BOTH,
                 **engine_info.compute, **loop.stats(), **(srv.handoff.health() if srv.handoff else {})}
        if (channel_port := getattr(app.state, "channel_port", None)) is not None:
            stats["channel_port"] = channel_port        # routers send their legs there (wire/channel.py)
        if not loop.is_alive():
            return JSONResponse({"status": "error", "error": loop.fatal_error or "engine loop stopped", **stats},
                                status_code=503)
        return {"status": "ok", **stats}

    @app.get("/metrics")
    async def metrics():
        if srv.handoff is not None:
            srv.handoff.sync_counters()
        return Response(srv.metrics.render(loop.stats()), media_type=CONTENT_TYPE)

    return app


def model_card(info: EngineInfo) -> dict:
    return {"id": info.served_name, "object": "model", "created": 0, "owned_by": "kvhandoff",
            "max_model_len": info.max_model_len}


