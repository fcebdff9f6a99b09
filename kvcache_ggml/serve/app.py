"""The HTTP side: an ASGI app (starlette) in OpenAI's shapes over one :class:`~.engine.Engine`.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events ending in ``data: [DONE]``), ``POST /tokenize``, ``POST /detokenize``
(llama-server's shapes), ``GET /metrics`` (Prometheus text), and llama-server's ``GET /slots`` and
``POST /slots/{id}?action=save|restore|erase`` (:mod:`.slots`; with ``slot_dir``).

Every failure is OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``:

* 400 -- a body that is not JSON, a missing field or a wrong type (:mod:`.protocol`), an unknown model, a prompt
  the context cannot hold (both numbers named), a chat request to a model without a chat template;
* 401 -- ``--api-key`` set and the ``Authorization: Bearer`` key missing or wrong (compared in constant time;
  ``/health`` and ``/v1/models`` stay open, as llama-server has them);
* 413 -- a body over ``max_body`` bytes (from Content-Length, or counted as it arrives);
* 503 with ``Retry-After`` -- the queue is full;
* 500 -- the engine failed the request (its message says why); a stream that fails after its first chunk ends with
  an error event and ``[DONE]``.

A request runs on the engine thread; its events cross to the event loop through one outbox (:class:`_Outbox`): the
engine thread queues them and, once after each step, wakes the loop with one ``call_soon_threadsafe`` for all of
them (``Engine.set_wake``).  On a server of one slot, a stream's text chunks and its end go to its socket from the
engine thread instead (:mod:`.direct`).  A client that goes away -- a stream's connection closed, or a plain
request's -- cancels its request: the engine releases its sequence at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from . import protocol as P
from .chat import ChatTemplate
from .direct import LAST_CHUNK, Connections, DirectSink, StreamSocket, frame
from .engine import Engine, QueueFull
from .formatters import ChatFormatter, CompletionFormatter, Formatter
from .request import Event, Job
from .sampling import Sampler
from .slots import SlotBusy, erase_slot, restore_slot, save_slot, slot_path, slots_info
from .text import TextStream

__all__ = ["Service", "make_app"]

_OPEN_PATHS = frozenset({"/health", "/v1/models"})


@dataclass(slots=True)
class Service:
    """What the app serves: the engine and the model's text side."""

    engine: Engine                   # the engine (owns the context)
    vocab: Any                       # the model's Vocab
    model_name: str                  # the name /v1/models lists and requests must ask for
    template: ChatTemplate | None    # the GGUF's chat template (None: the chat endpoint answers 400)
    api_key: str = ""                # "" : no authentication
    max_body: int = 8 << 20          # bytes a request body may have
    retry_after: int = 1             # seconds a 503 tells the client to wait
    created: int = 0                 # unix time the server started (the model object's "created")
    slot_dir: Path | None = None     # --slot-save-path (None: POST /slots/{id} answers 501)
    slots_endpoint: bool = True      # GET /slots answers (--no-slots: 501)


def _error(e: P.RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


_DONE = "data: [DONE]\n\n"  # a stream's last server-sent event
_POLL_SECONDS = 1.0  # how often a plain request looks for a gone client (llama-server: HTTP_POLLING_SECONDS)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Outbox:
    """The engine's events on their way to the event loop.  ``put`` runs on the engine thread for every event and
    only appends to a deque (no system call: the engine thread keeps the GIL); ``wake`` runs there once after each
    step that emitted events and schedules ``drain`` on the loop, which hands every event queued so far to its
    request's queue, in order.  One wake-up a step for all requests, where one per event would let the loop thread
    take the GIL from the engine thread once a request and step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[tuple[asyncio.Queue, Event]] = deque()
        self.held: deque[DirectSink] = deque()  # sinks holding a response's end for the wake-up (module direct)

    def put(self, queue: asyncio.Queue, ev: Event) -> None:
        self.items.append((queue, ev))

    def hold(self, sink: DirectSink) -> None:
        self.held.append(sink)

    def wake(self) -> None:
        held = self.held
        while held:  # (their end events join the items)
            held.popleft().finish()
        if self.items:  # (none after a step whose events all went to their sockets: module direct)
            self.loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        items = self.items
        while items:
            queue, ev = items.popleft()
            queue.put_nowait(ev)


class _Prepared:
    """A parsed request turned into a job, and what its answer needs."""

    __slots__ = ("fmt", "req", "job", "queue", "sink", "model", "id", "created", "text_sse")

    def __init__(self, fmt: Formatter, req: Any, job: Job, queue: asyncio.Queue, sink: DirectSink,
                 model: str) -> None:
        self.fmt, self.req, self.job, self.queue, self.sink, self.model = fmt, req, job, queue, sink, model
        self.id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        # a text chunk without logprobs, as the formatter writes it, with the text's JSON string in the middle: one
        # string join per token instead of a dict and a json.dumps of it (the event loop shares 2 cores with ggml)
        probe = "\u0000"
        head, tail = _sse(fmt.text_chunk(self.id, self.created, model, probe)).split(json.dumps(probe))
        self.text_sse = (head, tail)

    def text_event(self, text: str) -> str:
        """The server-sent event of a text chunk without logprobs, from the precomputed head and tail."""
        head, tail = self.text_sse
        return head + json.dumps(text, ensure_ascii=False) + tail

    def end_sse(self, ev: Event) -> str:
        """The server-sent events of a stream's end (``done``): its final chunk, then its usage when asked for."""
        out = _sse(self.fmt.final_chunk(self.id, self.created, self.model, ev.finish_reason))
        if self.req.stream_include_usage:
            out += _sse(self.fmt.usage_chunk(self.id, self.created, self.model, ev.usage))
        return out

    def wire(self, ev: Event) -> tuple[bytes, bool] | None:
        """What the engine thread writes for ``ev`` (module direct): a text event without logprobs as one chunk
        of the body, not its last (False); the end as its chunks and ``[DONE]`` in one chunk, then the body's last
        chunk (True).  None for the others (the loop's path)."""
        if ev.kind == "text" and not ev.logprobs:
            return frame(self.text_event(ev.text).encode()), False
        if ev.kind == "done":
            return frame((self.end_sse(ev) + _DONE).encode()) + LAST_CHUNK, True
        return None


def make_app(svc: Service, conns: Connections | None = None) -> Starlette:
    """The ASGI app over ``svc`` (the engine is started and stopped with the app's lifespan).  ``conns``: the
    server's connections (:meth:`Connections.protocol` as uvicorn's protocol class), whose streams' text chunks the
    engine thread then writes itself (module :mod:`.direct`); without, every chunk goes through the event loop."""
    api = _Api(svc, conns)
    api.warm_up()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        api.outbox = _Outbox(asyncio.get_running_loop())
        svc.engine.set_wake(api.outbox.wake)
        svc.engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, svc.engine.stop)

    return Starlette(routes=[
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/slots", api.slots, methods=["GET"]),
        Route("/slots/{id_slot}", api.slot_action, methods=["POST"]),
    ], lifespan=lifespan)


class _Api:
    """The endpoints over one service."""

    def __init__(self, svc: Service, conns: Connections | None = None) -> None:
        self.svc = svc
        self.conns = conns                                               # the server's connections, if known
        self.direct_chunks = 0                                           # text chunks the engine thread wrote
        self.direct_ends = 0                                             # ... and responses' ends
        self.eng = svc.engine
        self.vocab = vocab = svc.vocab
        self.n_vocab = len(vocab.tokens)
        # the end-of-generation ids (ignore_eos masks them), found once
        self.eog = np.array([t for t in range(self.n_vocab) if vocab.is_eog(t)], np.int32)
        self.chat = ChatFormatter(vocab, svc.template, svc.model_name)   # /v1/chat/completions
        self.completion = CompletionFormatter(vocab)                     # /v1/completions
        self.outbox: _Outbox | None = None                               # set when the app starts (lifespan)

    def warm_up(self) -> None:
        """Run the text side once -- parsing, the chat template, the tokenizer, a chunk's JSON -- so that the first
        request does not pay their first-call costs (the tokenizer's and jinja's caches, lazy imports): on a cold
        server they added about 25 ms to the first request's time to first token."""
        msgs = [{"role": "user", "content": "Hello, world."}]
        body = {"model": self.svc.model_name, "messages": msgs, "prompt": "Hello", "stream": True, "max_tokens": 1}
        for fmt in (self.completion, self.chat):
            try:
                fmt.prompt(fmt.parse(body))
            except P.RequestError:
                pass  # (no chat template, or one that refuses this conversation: warmed as far as it goes)
            _sse(fmt.text_chunk(f"{fmt.id_prefix}-0", 0, self.svc.model_name, "Hello"))
        self.vocab.detokenize(self.vocab.tokenize("Hello, world.", add_special=False))

    # ------------------------------------------------------------------ reading a request

    def auth(self, request: Request) -> None:
        key_set = self.svc.api_key
        if not key_set or request.url.path in _OPEN_PATHS:
            return
        got = request.headers.get("authorization", "")
        key = got[7:] if got.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(key.encode(), key_set.encode()):
            raise P.RequestError("invalid or missing API key (Authorization: Bearer KEY)", status=401,
                                 type="authentication_error", code="invalid_api_key")

    async def body_of(self, request: Request) -> Any:
        self.auth(request)
        limit = self.svc.max_body
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limit:
            raise P.RequestError(f"the body has {size} bytes; the limit is {limit}", status=413)
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise P.RequestError(f"the body has more than {limit} bytes, the limit", status=413)
        return P.parse_json(data)

    async def prepare(self, request: Request, fmt: Formatter) -> _Prepared:
        body = await self.body_of(request)
        req = fmt.parse(body)
        if req.model != self.svc.model_name:
            raise P.RequestError(f"model {req.model!r} is not served (served: {self.svc.model_name!r})",
                                 param="model", code="model_not_found")
        req.check_vocab(self.n_vocab)
        tokens = fmt.prompt(req)
        sp = req.sampling
        queue: asyncio.Queue[Event] = asyncio.Queue()
        outbox = self.outbox
        if outbox is None:  # (the app was not started through its lifespan)
            raise RuntimeError("the app's lifespan did not run: start it with uvicorn (lifespan='on')")
        cache_prompt = body.get("cache_prompt", True)  # llama-server's extension
        if not isinstance(cache_prompt, bool):
            raise P.RequestError(f"cache_prompt must be a boolean, got {cache_prompt!r}", param="cache_prompt")
        id_slot = body.get("id_slot", -1)  # llama-server's extension: the sequence the request prefers
        n_seq = self.eng.prefix.n_seq
        if isinstance(id_slot, bool) or not isinstance(id_slot, int) or not -1 <= id_slot < n_seq:
            raise P.RequestError(f"id_slot must be -1 or a slot in [0, {n_seq}), got {id_slot!r}", param="id_slot")
        sink = DirectSink(lambda ev: outbox.put(queue, ev), outbox.hold)
        job = Job(tokens, Sampler(sp, self.n_vocab, self.eog), TextStream(self.vocab, sp.stop),
                  sink, max_tokens=sp.max_tokens,
                  cache_prompt=cache_prompt, top_logprobs=sp.top_logprobs if sp.logprobs else -1, id_slot=id_slot)
        shift = P.parse_shift_fields(body, len(tokens), self.eng.can_shift)  # llama-server's extensions
        job.n_cache_reuse, job.n_keep, job.n_discard = shift.n_cache_reuse, shift.n_keep, shift.n_discard
        try:
            self.eng.submit(job)
        except QueueFull as err:
            raise P.RequestError(f"the server is busy: {err}", status=503, type="server_error",
                                 code="queue_full") from None
        except ValueError as err:
            raise P.RequestError(str(err), param=fmt.param, code="context_length_exceeded") from None
        return _Prepared(fmt, req, job, queue, sink, self.svc.model_name)

    # ------------------------------------------------------------------ answers

    async def events(self, p: _Prepared, request: Request, poll: bool) -> AsyncIterator[list[Event]]:
        """The job's events until its end, in lists of those that have arrived (a stream sends each list as one
        write); cancels the job when the client goes away or the task is cancelled.  ``poll``: look for a gone
        client every second, whether events arrive or not (a plain request, whose tokens may flow for as long as
        the context shifts; a stream's response is cancelled by starlette when its client goes)."""
        done = False
        queue = p.queue
        loop = asyncio.get_running_loop()
        next_poll = loop.time() + _POLL_SECONDS
        try:
            while not done:
                if poll:
                    try:
                        ev = await asyncio.wait_for(queue.get(), timeout=_POLL_SECONDS)
                    except asyncio.TimeoutError:
                        ev = None
                    if loop.time() >= next_poll:
                        if await request.is_disconnected():
                            return
                        next_poll = loop.time() + _POLL_SECONDS
                    if ev is None:
                        continue
                else:
                    ev = await queue.get()
                evs = [ev]
                while not queue.empty():
                    evs.append(queue.get_nowait())
                done = evs[-1].kind != "text"
                yield evs
        finally:
            if not done:
                self.eng.cancel(p.job)

    async def whole(self, p: _Prepared, request: Request) -> Response:
        text, lps, end = [], [], None
        async for evs in self.events(p, request, poll=True):
            for ev in evs:
                if ev.kind == "text":
                    text.append(ev.text)
                    lps += ev.logprobs
                else:
                    end = ev
        if end is None:
            return Response(status_code=499)
        if end.kind == "error":
            return _error(P.RequestError(end.text, status=500, type="server_error"))
        want_lp = p.job.top_logprobs >= 0
        return JSONResponse(p.fmt.response(p.id, p.created, self.svc.model_name, "".join(text), end.finish_reason,
                                           end.usage, lps if want_lp else None))

    async def stream(self, p: _Prepared, request: Request) -> AsyncIterator[str]:
        first = p.fmt.first_chunk(p.id, p.created, self.svc.model_name)
        if first is not None:
            yield _sse(first)
        sock = self.open_direct(p, request)  # (the head and the first chunk are out)
        try:
            offset = [0]
            async for evs in self.events(p, request, poll=False):
                if p.sink.ended:  # (the end, the only event left, and [DONE] are out: the response completes here)
                    return
                yield "".join(self.chunk(p, ev, offset) for ev in evs)  # (the events that arrived: one write)
                if sock is not None:  # (written to the transport: the engine thread may go on from there)
                    if not sock.flushed():
                        sock.close()
                    p.sink.delivered(len(evs))
            yield _DONE
        finally:
            if sock is not None:
                self.conns.release(request.scope, sock)
                self.direct_chunks += sock.chunks
                self.direct_ends += p.sink.ended

    def open_direct(self, p: _Prepared, request: Request) -> StreamSocket | None:
        """The stream's socket handed to its job's sink, where the engine thread may write its text chunks: on a
        server of one slot, for text without logprobs (module :mod:`.direct`)."""
        if self.conns is None or p.job.top_logprobs >= 0 or self.eng.params.n_parallel != 1:
            return None
        sock = self.conns.open(request.scope)
        if sock is not None:
            p.sink.arm(sock, p.wire)
        return sock

    def chunk(self, p: _Prepared, ev: Event, offset: list[int]) -> str:
        """The server-sent event(s) of one engine event (``offset``: the text's length so far, updated)."""
        name, fmt = self.svc.model_name, p.fmt
        if ev.kind == "text" and p.job.top_logprobs < 0:
            offset[0] += len(ev.text)
            return p.text_event(ev.text)
        if ev.kind == "text":
            out = _sse(fmt.text_chunk(p.id, p.created, name, ev.text, ev.logprobs, offset[0]))
            offset[0] += len(ev.text)
            return out
        if ev.kind == "error":
            return _sse(P.RequestError(ev.text, status=500, type="server_error").body())
        return p.end_sse(ev)

    async def generate(self, request: Request, fmt: Formatter) -> Response:
        try:
            p = await self.prepare(request, fmt)
        except P.RequestError as e:
            return _error(e, {"Retry-After": str(self.svc.retry_after)} if e.status == 503 else None)
        except ClientDisconnect:
            return Response(status_code=499)
        if p.req.stream:
            return StreamingResponse(self.stream(p, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self.whole(p, request)

    # ------------------------------------------------------------------ endpoints

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, self.completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, self.chat)

    async def health(self, request: Request) -> Response:
        if not self.eng.ready.is_set():  # (llama-server's answer while it loads and warms up)
            return JSONResponse({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse(P.models_response([self.svc.model_name], self.svc.created))

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self.body_of(request)
            if not isinstance(body, dict) or not isinstance(body.get("content"), str):
                raise P.RequestError("tokenize needs {\"content\": string}", param="content")
            add_special = body.get("add_special", False)
            if not isinstance(add_special, bool):
                raise P.RequestError(f"add_special must be a boolean, got {add_special!r}", param="add_special")
        except P.RequestError as e:
            return _error(e)
        return JSONResponse({"tokens": self.vocab.tokenize(body["content"], add_special=add_special,
                                                           parse_special=True)})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self.body_of(request)
            toks = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
                raise P.RequestError("detokenize needs {\"tokens\": [integers]}", param="tokens")
            bad = [t for t in toks if not 0 <= t < self.n_vocab]
            if bad:
                raise P.RequestError(f"token id {bad[0]} is out of range [0, {self.n_vocab})", param="tokens")
        except P.RequestError as e:
            return _error(e)
        return JSONResponse({"content": self.vocab.detokenize(toks)})

    async def metrics(self, request: Request) -> Response:
        try:
            self.auth(request)
        except P.RequestError as e:
            return _error(e)
        return PlainTextResponse(metrics_text(self.eng, self.direct_chunks, self.direct_ends),
                                 media_type="text/plain; version=0.0.4")

    async def slots(self, request: Request) -> Response:
        try:
            self.auth(request)
            if not self.svc.slots_endpoint:
                raise P.RequestError("This server does not support slots endpoint. Start it with `--slots`",
                                     status=501, type="not_supported_error")
        except P.RequestError as e:
            return _error(e)
        return JSONResponse(await asyncio.wrap_future(self.eng.call(slots_info)))

    async def slot_action(self, request: Request) -> Response:
        """``POST /slots/{id_slot}?action=save|restore|erase`` (llama-server's shapes; :mod:`.slots`)."""
        try:
            self.auth(request)
            d = self.svc.slot_dir
            if d is None:
                raise P.RequestError("This server does not support slots action. Start it with `--slot-save-path`",
                                     status=501, type="not_supported_error")
            raw, action = request.path_params["id_slot"], request.query_params.get("action", "")
            if not (raw.isascii() and raw.isdigit()):
                raise P.RequestError(f"invalid slot id {raw!r}", param="id_slot")
            s = int(raw)
            if action in ("save", "restore"):
                body = await self.body_of(request)
                name = body.get("filename") if isinstance(body, dict) else None
                try:
                    path = slot_path(d, name)
                except ValueError as err:
                    raise P.RequestError(str(err), param="filename") from None
                act = save_slot if action == "save" else restore_slot
                fn = lambda eng: act(eng, s, path, name)  # noqa: E731
            elif action == "erase":
                fn = lambda eng: erase_slot(eng, s)  # noqa: E731
            else:
                raise P.RequestError(f"invalid action {action!r}: save, restore or erase", param="action")
            return JSONResponse((await self.slot_call(request, fn)).to_json())
        except P.RequestError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=499)

    async def slot_call(self, request: Request, fn: Any) -> Any:
        """``fn`` on the engine's thread; while its slot serves a request, asked again every 20 ms (llama-server
        defers the task until the slot is idle) until the client goes away."""
        while True:
            try:
                return await asyncio.wrap_future(self.eng.call(fn))
            except SlotBusy:
                if await request.is_disconnected():
                    raise ClientDisconnect() from None
                await asyncio.sleep(0.02)
            except ValueError as err:
                raise P.RequestError(str(err)) from None
            except OSError as err:
                raise P.RequestError(f"slot file: {err}", status=500, type="server_error") from None


def metrics_text(eng: Engine, direct_chunks: int = 0, direct_ends: int = 0) -> str:
    """Prometheus text exposition of the engine's and the prefix cache's counters, from the snapshot the engine
    published after its last step (nothing of the engine's is read from this thread)."""
    snap = eng.snapshot()
    st = snap.stats
    rows = [
        ("requests_total", "counter", "requests finished, any reason", st.requests),
        ("requests_failed_total", "counter", "requests ended by an error", st.requests_failed),
        ("requests_cancelled_total", "counter", "requests whose client went away", st.requests_cancelled),
        ("requests_ended_cache_full_total", "counter", "requests ended because the cache was full", st.ended_full),
        ("prompt_tokens_total", "counter", "prompt tokens of admitted requests", st.prompt_tokens),
        ("prompt_tokens_cached_total", "counter", "prompt tokens reused from the prefix cache", st.cached_tokens),
        ("prompt_tokens_computed_total", "counter", "prompt tokens decoded", st.computed_tokens),
        ("generated_tokens_total", "counter", "tokens generated", st.generated_tokens),
        ("steps_total", "counter", "batches decoded", st.steps),
        ("steps_prompt_total", "counter", "batches decoded that read prompt chunks", st.prompt_steps),
        ("context_shifts_total", "counter", "context shifts of requests reaching the context", st.context_shifts),
        ("drafts_total", "counter", "drafts verified (speculative decoding)", st.drafts),
        ("draft_n_total", "counter", "draft tokens verified (llama-server's draft_n)", st.draft_tokens),
        ("draft_n_accepted_total", "counter", "draft tokens accepted (llama-server's draft_n_accepted)",
         st.draft_accepted),
        ("prefix_hits_device_total", "counter", "admissions reusing a cached sequence", snap.prefix_hits_device),
        ("prefix_hits_host_total", "counter", "admissions restoring a host-tier blob", snap.prefix_hits_host),
        ("prefix_evictions_total", "counter", "parked sequences evicted", snap.prefix_evictions),
        ("steps_padded_total", "counter", "steps given throwaway rows up to flash attention's tile",
         snap.padded_steps),
        ("fa_tiles", "gauge", "1: steps of 2..63 tokens may take throwaway rows (measured at warm-up), 0: never",
         eng.tiles is not None),
        ("split_steps", "gauge", "1: a step generates or reads prompts, never both; 0: steps mix them",
         eng.params.split()),
        ("requests_running", "gauge", "requests admitted", snap.n_running),
        ("requests_waiting", "gauge", "requests in the queue", eng.queue_depth),
        ("kv_cells_used", "gauge", "cells holding a token", snap.kv_used),
        ("kv_cells", "gauge", "cells of the cache", snap.kv_size),
        ("stream_chunks_direct_total", "counter", "streamed text chunks written by the engine thread (module direct), "
         "of responses ended", direct_chunks),
        ("stream_ends_direct_total", "counter", "streamed responses whose end the engine thread wrote (module direct)",
         direct_ends),
    ]
    out = []
    for name, kind, doc, value in rows:
        out += [f"# HELP kvcache_{name} {doc}", f"# TYPE kvcache_{name} {kind}", f"kvcache_{name} {int(value)}"]
    return "\n".join(out) + "\n"
