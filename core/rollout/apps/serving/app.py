"""The HTTP server in front of a `Service`: the OpenAI routes, rollout's native route, health.

`serve()` runs it until cancelled or SIGTERM and closes the service on the way out;
`ServerThread` runs the same server on a loop of its own in a background thread, for tests
and benchmarks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping

import attrs
from aiohttp import web

from rollout.contract import convert
from rollout.front import raw_id
from rollout.contract.errors import EngineDeadError, InvalidRequestError, NoReplicaError, \
    RolloutError, RolloutTimeoutError
from rollout.contract.schemas import Chunk, Completion, Request
from rollout.kit.images import refuse_paths
from rollout.kit.prompts import PromptEncoder
from rollout.apps.serving.prometheus import CONTENT_TYPE, Metered, ServerMetrics
from rollout.apps.serving.openai_api import ApiError, Call, ChatCall, CompletionsCall, api_error, \
    bad_field, model_not_found
from rollout.apps.serving.responses_api import STORE_SIZE, ResponsesCall, ResponseStore, \
    message_item, output_text
from rollout.apps.serving import anthropic_api
from rollout.apps.serving.anthropic_api import MessagesCall
from rollout.apps.serving.sessions import MAX_SESSIONS, Recording, SessionGone, Sessions, \
    session_of
from rollout.service.client import CALL_HEADER
from rollout.service.service import CALL, Service
from rollout.weights.receive import OpenUpdates
from rollout.weights.update import BUCKET_WAIT_S, check_adapter, check_group, \
    check_update_options
from rollout.apps.tool_parsers import DEFAULT_PARSER, load_tool_parser

log = logging.getLogger("rollout.serve")

MAX_BODY_BYTES = 64 << 20
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
ANTHROPIC_ROUTE = re.compile(r"(/sessions/[^/]+)?/v1/messages")  # errors in Anthropic's shape
SHUTDOWN_GRACE_S = 5.0
WEIGHT_STEPS = ("group", "bucket", "end", "cancel")
LORA_LOAD_FIELDS = {"lora_name", "lora_path", "load_inplace", "version"}
# vLLM's development routes that TRL's VLLMClient calls to sync weights over NCCL: not
# served, and said so (a 404 would send TRL's user to restart vLLM in development mode).
TRL_NCCL_ROUTES = ("/server_info", "/get_world_size", "/init_weight_transfer_engine",
                   "/start_weight_update", "/update_weights", "/finish_weight_update",
                   "/reset_prefix_cache")
TRL_NCCL_REASON = ("weight sync through vLLM's NCCL weight-transfer routes (TRL's server "
                   "mode) is not served by rollout serve; push the trainer's weights with "
                   "rollout.integrations.trl.RolloutFunc or the /rollout/weights routes "
                   "(docs/integrations.md)")


def make_app(service: Service, model_name: str, api_key: str | None = None,
             tool_parser: str = DEFAULT_PARSER, public_metrics: bool = False,
             log_prompts: bool = False, responses_kept: int = STORE_SIZE,
             lora_modules: Mapping[str, str] | None = None,
             sessions_kept: int = MAX_SESSIONS,
             encoder: Callable[[], PromptEncoder | None] | None = None) -> web.Application:
    """`public_metrics`: /metrics answers without the API key (for a scraper that has
    none); `log_prompts`: the debug line of each finished request carries its prompt;
    `responses_kept`: how many /v1/responses answers previous_response_id can name;
    `lora_modules`: LoRA adapters (name -> PEFT folder) loaded before the server listens;
    `sessions_kept`: how many agent sessions are recorded (0: none); `encoder`: gives the
    model's prompt encoder, whose chat template continues a session's tokens, where the
    service has none of its own (replicas in other processes)."""
    load_tool_parser(tool_parser)  # an unknown parser stops the server before it starts
    metrics = ServerMetrics(service, model_name, log_prompts)
    sessions = Sessions(lambda: getattr(service, "encoder", None) or (
        encoder() if encoder is not None else None), sessions_kept) if sessions_kept else None
    routes = _Routes(Metered(service, metrics), model_name, tool_parser,
                     ResponseStore(responses_kept), sessions)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[
        _errors_middleware(metrics),
        _auth_middleware(api_key, {"/metrics"} if public_metrics else set())])
    app.add_routes(_route_table(routes))

    async def load_adapters(app: web.Application) -> None:
        for name, path in (lora_modules or {}).items():
            try:
                await routes.load_folder(name, path)
            except ApiError as exc:  # the server does not start
                raise InvalidRequestError("lora", f"{name}={path}: {exc.message}",
                                          "NAME=PATH of a PEFT adapter folder") from None
    app.on_startup.append(load_adapters)
    return app


def _route_table(routes: _Routes) -> list[web.AbstractRouteDef]:
    # Each sampling route also under /sessions/{session}, for a harness that can set its
    # base URL and nothing else.
    sampling = [(prefix + path, handler) for prefix in ("", "/sessions/{session}")
                for path, handler in (("/v1/completions", routes.completions),
                                      ("/v1/chat/completions", routes.chat),
                                      ("/v1/responses", routes.responses),
                                      ("/v1/messages", routes.messages),
                                      ("/v1/messages/count_tokens", routes.count_tokens))]
    return [
        web.get("/metrics", routes.metrics),
        *(web.post(path, handler) for path, handler in sampling),
        web.get("/v1/responses/{id}", routes.stored_response),
        web.get("/sessions/{session}/v1/models", routes.models),
        web.get("/sessions/{session}/v1/models/{model}", routes.model),
        web.get("/rollout/sessions/{session}", routes.session),
        web.get("/v1/models", routes.models),
        web.get("/v1/models/{model}", routes.model),
        web.get("/health", routes.health),
        web.post("/rollout/generate", routes.native_generate),
        web.post("/rollout/stream", routes.native_stream),
        web.get("/rollout/capabilities", routes.capabilities),
        web.post("/rollout/abort", routes.abort),
        web.post("/rollout/release", routes.release),
        web.post("/rollout/resume", routes.resume),
        web.post("/rollout/weights/{step}", routes.weights),
        web.post("/v1/load_lora_adapter", routes.load_lora_adapter),
        web.post("/v1/unload_lora_adapter", routes.unload_lora_adapter),
        *(web.route("*", path, _not_served) for path in TRL_NCCL_ROUTES),
    ]


async def _not_served(request: web.Request) -> web.Response:
    raise ApiError(501, f"{request.path}: {TRL_NCCL_REASON}", type="server_error",
                   code="unsupported")


class _Routes:
    def __init__(self, service: Service, model_name: str, tool_parser: str,
                 responses: ResponseStore, sessions: Sessions | None):
        self.service = service
        self.sessions = sessions
        self.stored = responses
        self.model_name = model_name
        self.tool_parser = tool_parser
        self.started = int(time.time())
        self.updates = OpenUpdates()
        self.adapter_paths: dict[str, str] = {}  # LoRA adapters loaded from folders here
        self.update_started: dict[str, tuple[float, str]] = {}  # id -> (began, transport)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        call = CompletionsCall(await _json(request), self.model_name,
                               adapters=self.service.adapters())
        return await self._openai(request, call, self._session(request, call, "completions"))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        call = ChatCall(await _json(request), self.model_name, self.tool_parser,
                        adapters=self.service.adapters())
        return await self._openai(request, call, self._session(request, call, "chat"))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        call = ResponsesCall(await _json(request), self.model_name, self.tool_parser,
                             self.stored, adapters=self.service.adapters())
        return await self._one(request, call, "responses", _stream_response, call.response)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        call = MessagesCall(await _json(request), self.model_name, self.tool_parser,
                            adapters=self.service.adapters())
        return await self._one(request, call, "messages", _messages_stream, call.message)

    async def _one(self, request: web.Request, call, route: str, stream, answer
                   ) -> web.StreamResponse:
        """A call of one request: streamed by `stream`, else its completion's `answer`."""
        service = self._session(request, call, route)
        (one,) = call.requests
        if call.stream:
            return await stream(request, service, call, one)
        (completion,) = await _all([service.generate(one)])
        return web.json_response(answer(completion))

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's length as the engine reads it: one token is made to learn it
        (the server may front replicas and has no tokenizer of its own)."""
        call = MessagesCall(await _json(request), self.model_name, self.tool_parser,
                            adapters=self.service.adapters(), count=True)
        (completion,) = await _all([self.service.generate(call.requests[0])])
        call.check(completion)
        return web.json_response({"input_tokens": completion.results[0].prompt_tokens})

    async def stored_response(self, request: web.Request) -> web.Response:
        return web.json_response(self.stored.get(request.match_info["id"], "id")[1])

    def _session(self, request: web.Request, call, route: str):
        """The service for this call. Where it names a session, its requests carry it (a
        pool keeps a session on one replica), and a chat-like call of one sample is
        recorded into it (rollout.apps.serving.sessions)."""
        session = session_of(request.headers, request.match_info.get("session"), call.body,
                             route)
        if session is None:
            return self.service
        call.requests = [attrs.evolve(r, session_id=session) for r in call.requests]
        if self.sessions is None or route == "completions" or len(call.requests) != 1:
            return self.service
        ticket = self.sessions.begin(session, call.requests[0], route, call.answer)
        call.requests = [ticket.request]
        return Recording(self.service, self.sessions, ticket)

    async def _openai(self, request: web.Request, call: Call, service) -> web.StreamResponse:
        if call.stream:
            return await _stream(request, service, call)
        # A client that goes away cancels this handler, and so its requests in the engine.
        completions = await _all(service.generate(r) for r in call.requests)
        return web.json_response(call.response(completions))

    async def session(self, request: web.Request) -> web.Response:
        """A recorded session's branches (`?pop=true`: and no longer kept here)."""
        if self.sessions is None:
            raise ApiError(404, "sessions are not recorded by this server (--sessions-kept 0)",
                           code="session_not_found")
        take = self.sessions.pop if request.query.get("pop") == "true" else self.sessions.get
        try:
            return web.json_response(take(request.match_info["session"]))
        except SessionGone as exc:
            raise ApiError(404, exc.message, param="session", code=exc.kind) from None

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.service.metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        names = [self.model_name, *self.service.adapters()]
        return web.json_response({"object": "list", "data": [self._model(n) for n in names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model_name and name not in self.service.adapters():
            raise model_not_found(name, self.model_name, self.service.adapters())
        return web.json_response(self._model(name))

    def _model(self, name: str) -> dict:
        """As vLLM lists them: an adapter's parent is the base model."""
        model = {"id": name, "object": "model", "created": self.started, "owned_by": "rollout",
                 "root": self.model_name, "parent": None}
        if name != self.model_name:
            model.update(root=self.adapter_paths.get(name, name), parent=self.model_name,
                         version=self.service.adapters().get(name))
        return model

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's route: {lora_name, lora_path, load_inplace} loads a PEFT folder on this
        server's host, through the same update as a trainer's push."""
        body = await _json(request)
        if not isinstance(body, dict) or set(body) - LORA_LOAD_FIELDS:
            raise ApiError(400, "the body must be an object with "
                           + ", ".join(sorted(LORA_LOAD_FIELDS)))
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or name == self.model_name:
            raise bad_field("lora_name", f"got {name!r}",
                            "a non-empty string other than the base model's name")
        if not isinstance(path, str) or not path:
            raise bad_field("lora_path", f"got {path!r}", "the path of a PEFT adapter folder")
        if name in self.service.adapters() and body.get("load_inplace") is not True:
            raise ApiError(400, f"the LoRA adapter {name!r} has already been loaded; set "
                           "load_inplace to true to replace it", param="lora_name")
        await self.load_folder(name, path, body.get("version"))
        return web.Response(text=f"Success: LoRA adapter {name!r} added successfully.")

    async def load_folder(self, name: str, path: str, version: int | None = None) -> None:
        from rollout.weights.lora import read_peft_folder
        from rollout.weights.send import push_weights

        try:
            tensors, config = await asyncio.to_thread(read_peft_folder, path)
        except InvalidRequestError as exc:
            raise api_error(exc, "lora_path") from None
        opened = await self.updates.begin(self.service, version, "wait", BUCKET_WAIT_S,
                                          {"name": name, "config": config})
        if opened is None:
            raise ApiError(409, "a weight update is open on this server", code="update_open")
        update_id, update = opened
        try:
            await push_weights(update, tensors.items())
        except InvalidRequestError as exc:
            raise api_error(exc, "lora_path") from None
        finally:
            self.updates.close(update_id)
        self.adapter_paths[name] = path
        log.info("LoRA adapter %s loaded from %s", name, path)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _json(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or name not in self.service.adapters():
            raise ApiError(404, f"the LoRA adapter {name!r} cannot be found (loaded: "
                           f"{', '.join(self.service.adapters()) or 'none'})",
                           param="lora_name", code="not_found")
        await self.service.unload_adapter(name)
        self.adapter_paths.pop(name, None)
        return web.Response(text=f"Success: LoRA adapter {name!r} removed successfully.")

    async def health(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(await self.service.health())
        except Exception as exc:  # noqa: BLE001 - any failure means not healthy
            kind = exc.kind if isinstance(exc, RolloutError) else "unhealthy"
            raise ApiError(503, f"not healthy: {exc}", type="server_error", code=kind) from None

    async def native_generate(self, request: web.Request) -> web.Response:
        """Requests and completions in rollout's own schema; a bad request fails alone."""
        CALL.set(request.headers.get(CALL_HEADER))  # (this handler's own context)
        body = await _json(request)
        items = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(items, list) or set(body) != {"requests"}:
            raise ApiError(400, 'the body must be {"requests": [request, ...]}',
                           param="requests")
        completions: list[Completion | None] = [None] * len(items)
        valid: list[tuple[int, Request]] = []
        for i, item in enumerate(items):
            try:
                valid.append((i, refuse_paths(convert.structure(item, Request))))
            except InvalidRequestError as exc:
                completions[i] = Completion(raw_id(item, i), error=exc)
        done = await _all(self.service.generate(r) for _, r in valid)
        for (i, _), completion in zip(valid, done):
            completions[i] = completion
        return web.json_response({"completions": [convert.unstructure(c) for c in completions]})

    async def native_stream(self, request: web.Request) -> web.StreamResponse:
        """One request in rollout's own schema, its chunks as they come: newline-delimited
        JSON, `{"chunk": ...}` lines and then `{"completion": ...}`, whose error is the
        request's own. Until the first line is sent, a service that can serve nothing
        answers as on the other routes (503, 504), so that a pool sends the request
        elsewhere."""
        CALL.set(request.headers.get(CALL_HEADER))
        body = await _json(request)
        if not isinstance(body, dict) or set(body) != {"request"}:
            raise ApiError(400, 'the body must be {"request": request}', param="request")
        one = refuse_paths(convert.structure(body["request"], Request))
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})

        async def send(item: dict) -> None:
            if not response.prepared:
                await response.prepare(request)
            await response.write(json.dumps(item).encode() + b"\n")

        stream = self.service.stream(one)
        try:
            async for chunk in stream:
                await send({"chunk": convert.unstructure(chunk)})
            completion = stream.completion
        except RolloutError as exc:
            if not response.prepared and isinstance(
                    exc, (EngineDeadError, NoReplicaError, RolloutTimeoutError)):
                raise
            completion = Completion(one.id, error=exc)
        finally:
            await stream.aclose()
        await send({"completion": convert.unstructure(completion)})
        await response.write_eof()
        return response

    # --- lifecycle: what a trainer calls between steps --------------------------------

    async def capabilities(self, request: web.Request) -> web.Response:
        return web.json_response(convert.unstructure(await self.service.capabilities()))

    async def abort(self, request: web.Request) -> web.Response:
        """{"request_ids": [id, ...], "calls": [call, ...]}: those requests stop and return
        what they made; a request sent with one of `calls` in its X-Rollout-Call header
        stops when it comes, if it has not yet (the abort overtook it)."""
        body = await _json(request)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        calls = body.get("calls", []) if isinstance(body, dict) else None
        if not _strings(ids) or not _strings(calls) \
                or not {"request_ids"} <= set(body) <= {"request_ids", "calls"}:
            raise ApiError(400, 'the body must be {"request_ids": ["id", ...]} (and '
                           'optionally "calls": the X-Rollout-Call ids of those requests)',
                           param="request_ids")
        await self.service.abort(ids, calls)
        return web.json_response({})

    async def release(self, request: web.Request) -> web.Response:
        tags = _tags_of(await _json(request))
        await self.service.release(tags)
        log.info("released %s", ", ".join(tags or ["everything"]))
        return web.json_response({})

    async def resume(self, request: web.Request) -> web.Response:
        tags = _tags_of(await _json(request))
        await self.service.resume(tags)
        log.info("resumed %s", ", ".join(tags or ["everything"]))
        return web.json_response({})

    async def weights(self, request: web.Request) -> web.Response:
        """A weight update in steps: `begin` {version, pause, timeout} -> {update,
        receivers}; for gloo, `group` {update, host, port, name, world_size, first_rank};
        `bucket` {update, bucket} once per bucket; `end` {update} -> {version}; `cancel`
        {update, reason}."""
        step, body = request.match_info["step"], await _json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        if step == "begin":
            return await self._begin_update(body)
        update_id = body.get("update")
        update = self.updates.get(update_id)
        if step not in WEIGHT_STEPS or update is None:
            raise ApiError(404, f"no open weight update {body.get('update')!r} at step "
                           f"{step!r} (steps: begin, {', '.join(WEIGHT_STEPS)})",
                           param="update")
        if step in ("bucket", "group"):
            await self._feed_update(step, update_id, update, body)
            return web.json_response({})
        self.updates.close(update_id)
        began, transport = self.update_started.pop(update_id, (time.monotonic(), ""))
        if step == "cancel":
            reason = str(body.get("reason", "cancelled by the trainer"))
            await update.cancel(reason)
            log.info("weight update cancelled: %s", reason)
            return web.json_response({})
        return await self._end_update(update, began, transport)

    async def _begin_update(self, body: dict) -> web.Response:
        """The `begin` step: opens the server's one weight update."""
        unknown = set(body) - {"version", "pause", "timeout", "adapter"}
        if unknown:
            raise ApiError(400, f"unknown fields {sorted(unknown)} (allowed: version, "
                           "pause, timeout, adapter)", param=sorted(unknown)[0])
        options = (body.get("version"), body.get("pause", "wait"),
                   body.get("timeout", BUCKET_WAIT_S))
        check_update_options(*options)
        adapter = check_adapter(body.get("adapter"))
        if adapter is not None and adapter["name"] == self.model_name:
            raise bad_field("adapter.name", f"got {adapter['name']!r}, the base model's "
                            "name", "another name")
        opened = await self.updates.begin(self.service, *options, adapter)
        if opened is None:
            raise ApiError(409, "another weight update is open on this server",
                           code="update_open")
        update_id, update = opened
        self.update_started = {update_id: (time.monotonic(), "")}  # the only one open
        return web.json_response({"update": update_id, "receivers": update.receivers,
                                  "nodes": sorted(update.nodes)})

    async def _feed_update(self, step: str, update_id: str, update, body: dict) -> None:
        """The `group` or `bucket` step; one that fails cancels the update."""
        try:
            if step == "group":
                await update.join(check_group(body))
            else:
                await update.send(body.get("bucket"))
            self.updates.touch(update_id)
            self._note_transport(update_id, body)
        except BaseException:  # a half-sent update: the backend stays dirty until a full one
            self.updates.close(update_id)
            await update.cancel(f"the {step} step failed")
            raise

    async def _end_update(self, update, began: float, transport: str) -> web.Response:
        """The `end` step, logged (and, for the base model's weights, counted) with how
        long the update took and by which transport."""
        version = await update.end()
        seconds = time.monotonic() - began
        adapter = getattr(update, "adapter", None)
        if adapter is not None:
            log.info("LoRA adapter %s loaded at version %s by %s in %.2f s", adapter["name"],
                     version, transport or "no bucket", seconds)
            return web.json_response({"version": version})
        self.service.metrics.weight_update(transport or "none", seconds)
        log.info("weights updated to version %s by %s in %.2f s", version, transport or
                 "no bucket", seconds, extra={"weight_version": version})
        return web.json_response({"version": version})

    def _note_transport(self, update_id: str, body: dict) -> None:
        """The update's transport: its group's backend, or its first bucket's."""
        began, transport = self.update_started.get(update_id, (time.monotonic(), ""))
        if not transport:
            bucket = body.get("bucket")
            transport = body.get("backend") if "backend" in body else \
                bucket.get("transport") if isinstance(bucket, dict) else ""
            self.update_started[update_id] = (began, str(transport or ""))


async def _all(calls) -> list:
    """Every call's result; the first that raises cancels the rest (their client gets the
    error, so their work would be lost anyway)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def _tags_of(body) -> list[str] | None:
    if not isinstance(body, dict) or set(body) - {"tags"}:
        raise ApiError(400, 'the body must be {"tags": ["weights", "kv_cache"] or null}',
                       param="tags")
    return body.get("tags")


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, str) for i in value)


async def _json(request: web.Request):
    try:
        return json.loads(await request.read())
    except ValueError as exc:  # bad JSON, or bytes that are not UTF-8
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None


async def _stream(request: web.Request, service: Service, call: Call) -> web.StreamResponse:
    """Server-sent events, token by token: each chunk a request's engine makes goes out as
    it comes. A client that goes away stops its requests in the engine."""
    response = web.StreamResponse(headers=SSE_HEADERS)

    async def send(data: str) -> None:
        if not response.prepared:
            await response.prepare(request)
        await response.write(f"data: {data}\n\n".encode())

    completions: list[Completion | None] = [None] * len(call.requests)
    arrived = _arrivals([service.stream(r) for r in call.requests])
    try:
        for chunk in call.opening_chunks():
            await send(json.dumps(chunk))
        async for i, item in arrived:
            if isinstance(item, Exception):
                raise item
            if isinstance(item, Completion):
                call.check(item, i)
                completions[i] = item
                for chunk in call.closing_chunks(i, item):
                    await send(json.dumps(chunk))
            elif (chunk := call.delta_chunk(i, item)) is not None:
                await send(json.dumps(chunk))
        if call.include_usage:
            await send(json.dumps(call.usage_chunk(completions)))
        await send("[DONE]")
    except ConnectionResetError:  # the client went away
        return response
    except Exception as exc:  # noqa: BLE001 - reported to the client, as any other error
        if not response.prepared:
            raise  # nothing sent yet: an ordinary error response
        error = _api_error(exc, request)
        service.metrics.error(exc, _error_kind(exc, error))
        await send(json.dumps(error.body()))
        await send("[DONE]")  # the stream still ends as streams do (as vLLM's server)
    finally:
        await arrived.aclose()
    await response.write_eof()
    return response


def _arrivals(streams: list) -> AsyncIterator[tuple[int, Chunk | Completion | Exception]]:
    """(index, item) for each stream's chunks as they come, then its completion, or the
    error it raised. One stream (most calls) is read in place; several are merged through a
    queue, which costs each chunk a turn of the loop. Closing it stops them all."""
    if len(streams) == 1:
        return _items(0, streams[0])
    return _merged([_items(i, stream) for i, stream in enumerate(streams)])


async def _items(i: int, stream) -> AsyncIterator[tuple[int, Chunk | Completion | Exception]]:
    try:
        async for chunk in stream:
            yield i, chunk
        yield i, stream.completion
    except Exception as exc:  # noqa: BLE001 - the request's error, for the caller
        yield i, exc
    finally:
        await stream.aclose()


async def _merged(sources: list[AsyncIterator]) -> AsyncIterator:
    arrived: asyncio.Queue = asyncio.Queue()

    async def pump(source) -> None:
        async for item in source:
            arrived.put_nowait(item)

    pumps = [asyncio.ensure_future(pump(source)) for source in sources]
    ended = 0
    try:
        while ended < len(sources):  # each source ends with its one item that is no Chunk
            item = await arrived.get()
            ended += not isinstance(item[1], Chunk)
            yield item
    finally:
        for task in pumps:
            task.cancel()


async def _stream_response(request: web.Request, service: Service, call: ResponsesCall,
                           one: Request) -> web.StreamResponse:
    """A /v1/responses stream: Responses events (`event:` and `data:` lines). Text comes
    as it is made; an answer read for tool calls, when it is done. Until the first event,
    a call that fails answers with an ordinary error response."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    sequence = iter(range(1 << 62))

    async def send(kind: str, **fields) -> None:
        if not response.prepared:
            await response.prepare(request)
            for opening in ("response.created", "response.in_progress"):
                await send(opening, response=call.skeleton("in_progress"))
        event = {"type": kind, "sequence_number": next(sequence), **fields}
        await response.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())

    where = {"output_index": 0, "content_index": 0}
    message_id = f"msg_{uuid.uuid4().hex}"
    streams_text = call.chat.tools.mode == "none"

    async def on_chunk(chunk: Chunk) -> None:
        if not (streams_text and chunk.text):
            return
        if where.get("item_id") is None:  # the first text opens the message
            where["item_id"] = message_id
            await send("response.output_item.added", output_index=0,
                       item={**message_item("", "in_progress", message_id), "content": []})
            await send("response.content_part.added", **where, part=output_text(""))
        await send("response.output_text.delta", **where, delta=chunk.text, logprobs=[])

    async def finish(completion: Completion) -> None:
        body = call.response(completion, message_id)
        await _send_output(body["output"], where.get("item_id"), send)
        # `completed` also for an incomplete one (its status says so), as vLLM's server
        # does: the openai SDK's and the Agents SDK's streams end on that event.
        await send("response.completed", response=body)

    async def fail(error: ApiError) -> None:
        await send("error", code=error.code or error.type, message=error.message,
                   param=error.param)

    return await _events(response, service, one, on_chunk, finish, fail)


async def _messages_stream(request: web.Request, service: Service, call: MessagesCall,
                           one: Request) -> web.StreamResponse:
    """A /v1/messages stream: Anthropic's events. Text comes as it is made (but for the
    characters that may begin a stop sequence); an answer read for tool calls, when it is
    done. Until the first event, a call that fails answers with an ordinary error."""
    response = web.StreamResponse(headers=SSE_HEADERS)

    async def send(kind: str, event: dict) -> None:
        if not response.prepared:
            await response.prepare(request)
            await send("message_start", {"type": "message_start",
                                         "message": call.skeleton(*prompt)})
        await response.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())

    text, sent = "", 0
    prompt = [0, 0]  # its tokens and those the prefix cache gave, from the first chunk

    async def on_chunk(chunk: Chunk) -> None:
        nonlocal text, sent
        if chunk.prompt_tokens is not None:
            prompt[:] = chunk.prompt_tokens, chunk.cached_tokens or 0
        text += chunk.text
        ready = len(text) - call.held_back
        if call.streams_text and ready > sent:
            if not sent:
                await send(*anthropic_api.block_start(0, {"type": "text", "text": ""}))
            await send(*anthropic_api.delta(0, {"type": "text_delta",
                                                "text": text[sent:ready]}))
            sent = ready

    async def finish(completion: Completion) -> None:
        for kind, event in anthropic_api.events(call, completion, sent):
            await send(kind, event)

    async def fail(error: ApiError) -> None:
        await send("error", anthropic_api.error_body(error))

    return await _events(response, service, one, on_chunk, finish, fail)


async def _events(response: web.StreamResponse, service: Service, one: Request,
                  on_chunk, finish, fail) -> web.StreamResponse:
    """Run `one`'s stream: each chunk to `on_chunk`, then its completion to `finish`.
    Until the response has started, a failure is raised (an ordinary error response);
    after, the request's error is its completion's, and an answer that cannot be given
    goes to `fail` as the stream's last event."""
    stream = service.stream(one)
    try:
        async for chunk in stream:
            await on_chunk(chunk)
        completion = stream.completion
    except RolloutError as exc:
        if not response.prepared:
            raise
        completion = Completion(one.id, error=exc)
    except ConnectionResetError:  # the client went away
        return response
    finally:
        await stream.aclose()
    try:
        await finish(completion)
    except ApiError as error:
        if not response.prepared:
            raise
        service.metrics.error(error, _error_kind(error, error))
        await fail(error)
    await response.write_eof()
    return response


async def _send_output(output: list, streamed_id: str | None, send) -> None:
    """Each output item's events, from `added` to `done`; the message `streamed_id`, whose
    text has gone out already, only from its `done` events."""
    for index, item in enumerate(output):
        at = {"output_index": index}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = {**at, "item_id": item["id"], "content_index": 0}
            if item["id"] != streamed_id:  # not streamed: all of it now
                await send("response.output_item.added", **at,
                           item={**item, "status": "in_progress", "content": []})
                await send("response.content_part.added", **part, part=output_text(""))
                await send("response.output_text.delta", **part, delta=text, logprobs=[])
            await send("response.output_text.done", **part, text=text, logprobs=[])
            await send("response.content_part.done", **part, part=output_text(text))
        else:
            await send("response.output_item.added", **at,
                       item={**item, "arguments": "", "status": "in_progress"})
            await send("response.function_call_arguments.delta", **at, item_id=item["id"],
                       delta=item["arguments"])
            await send("response.function_call_arguments.done", **at, item_id=item["id"],
                       arguments=item["arguments"])
        await send("response.output_item.done", **at, item=item)


def _errors_middleware(metrics: ServerMetrics):
    @web.middleware
    async def errors(request: web.Request, handler) -> web.StreamResponse:
        """Every failure becomes an OpenAI error body, counted by its kind; a traceback
        goes to the log only."""
        try:
            return await handler(request)
        except Exception as exc:  # noqa: BLE001 - a bug fails this call, not the server
            if isinstance(exc, web.HTTPException) and exc.status < 400:
                raise  # a redirect is no error
            error = _api_error(exc, request)
            metrics.error(exc, _error_kind(exc, error))
        body = anthropic_api.error_body(error) if ANTHROPIC_ROUTE.match(request.path) \
            else error.body()
        return web.json_response(body, status=error.status, headers=error.headers)

    return errors


def _api_error(exc: Exception, request: web.Request) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RolloutError):  # the service could serve nothing (no replica, dead)
        return api_error(exc)
    if isinstance(exc, web.HTTPException):  # unknown route, wrong method, body too large
        return ApiError(exc.status, exc.text or exc.reason,
                        code=exc.reason.lower().replace(" ", "_"))
    log.exception("%s %s failed", request.method, request.path)
    return ApiError(500, "internal server error (see the server log)", type="server_error")


def _error_kind(exc: Exception, error: ApiError) -> str:
    """The metrics' name for an error: its rollout kind, else its HTTP error's code."""
    if isinstance(exc, RolloutError):
        return exc.kind
    return error.code or ("invalid_request" if error.status == 400 else error.type)


def _auth_middleware(api_key: str | None, public: set[str]):
    """The key as OpenAI's clients send it (Authorization: Bearer) or Anthropic's
    (x-api-key)."""
    expected = api_key.encode() if api_key else None

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        if expected is not None and request.path not in public:
            bearer = request.headers.get("Authorization", "")
            given = bearer.removeprefix("Bearer ") if bearer.startswith("Bearer ") \
                else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), expected):
                raise ApiError(401, "missing or wrong API key (send Authorization: Bearer "
                               "KEY, or x-api-key: KEY)", code="invalid_api_key")
        return await handler(request)

    return auth


# --- running it ---------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything else starts: a port that is
    taken fails at once (not after a model has loaded), and replicas started afterwards
    cannot be handed this port as a free one."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


async def serve(service: Service, host: str = "127.0.0.1", port: int = 8000,
                api_key: str | None = None, model_name: str | None = None,
                on_started: Callable[[str], None] | None = None,
                tool_parser: str = DEFAULT_PARSER, sock: socket.socket | None = None,
                **app_options) -> None:
    """Serve until cancelled or SIGTERM, then stop taking calls, let running ones finish
    (a few seconds at most) and close the service. `port=0` picks a free port; `sock`, a
    socket from `listen`, is used instead of host and port; `on_started` gets the
    server's URL once it listens; `tool_parser` reads tool calls out of chat answers (an
    entry point of `rollout.tool_parsers`); `app_options` go to `make_app`."""
    app = make_app(service, model_name or service.name, api_key, tool_parser, **app_options)
    # handler_cancellation: a client that disconnects cancels its call (and requests).
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S,
                           handler_cancellation=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        await runner.setup()
        site = web.SockSite(runner, sock) if sock is not None else \
            web.TCPSite(runner, host, port, backlog=1024)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
        log.info("serving %s at %s", model_name or service.name, url)
        if on_started is not None:
            on_started(url)
        handles_sigterm = _on_sigterm(loop, stop.set)
        try:
            await stop.wait()
        finally:
            if handles_sigterm:
                loop.remove_signal_handler(signal.SIGTERM)
    finally:
        await runner.cleanup()
        await service.close()


def _on_sigterm(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> bool:
    try:
        loop.add_signal_handler(signal.SIGTERM, callback)
        return True
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
        return False


class ServerThread:
    """`serve()` on its own event loop in a daemon thread; `.url` once entered.

    with ServerThread(LocalService(rollout, "tiny")) as server:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    """

    def __init__(self, service: Service, api_key: str | None = None,
                 model_name: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 start_timeout: float = 30.0, tool_parser: str = DEFAULT_PARSER,
                 **app_options):
        self._args = dict(service=service, host=host, port=port, api_key=api_key,
                          model_name=model_name, tool_parser=tool_parser, **app_options)
        self._start_timeout = start_timeout
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-server", daemon=True)
        self.url = ""

    def _run(self) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            await serve(**self._args, on_started=self._set_url)

        try:
            asyncio.run(main())
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported to the thread that waits
            self._error = exc
        finally:
            self._started.set()

    def _set_url(self, url: str) -> None:
        self.url = url
        self._started.set()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        if not self._started.wait(self._start_timeout):
            raise TimeoutError(f"the server did not start within {self._start_timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(SHUTDOWN_GRACE_S + 30)
