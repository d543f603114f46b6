"""The sim's WSGI application: routes vLLM's endpoints and the control surface, and carries a
completion request through faults, validation, the role and the response (JSON or stream).

Plain WSGI rather than Flask: in zero-latency mode the sim must never be a benchmark's
bottleneck, and every layer between the socket and the SSE writes costs CPU on that path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from . import control, errors, logprobs, mooncake, pacing, roles, stream, textgen, validate, wire
from .httpio import (
    SSE_HEADERS,
    StartResponse,
    WSGIResult,
    empty_response,
    json_response,
    read_body,
    request_headers,
    status_line,
    text_response,
)
from .state import SimState

logger = logging.getLogger(__name__)

#: Longest an injected hang or a dying engine's request is held open, client or not.
HANG_CAP_SECONDS = 600.0
#: What a proxy's prober reads every round: counted, but kept out of the request record.
PROBED_PATHS = ("/health", "/v1/models", "/metrics")
#: Set in the environ of a completion that has its place in the batch (batch.py).
SLOT = "sim.slot"
#: The request's record in /sim/requests (None when not recorded), for what its stream adds.
RECORD = "sim.record"
RECORDED_RAW_BODY_CHARS = 2048
DP_RANK_HEADER = "HTTP_X_DATA_PARALLEL_RANK"

Handler = Callable[["SimApp", dict[str, Any], StartResponse], WSGIResult]


class SimApp:
    """One sim server's WSGI callable; all of its memory lives in ``state``."""

    def __init__(self, state: SimState) -> None:
        self.state = state

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        path = environ.get("PATH_INFO") or "/"
        methods = ROUTES.get(path)
        if methods is None:
            self._note(environ, path, None)
            return json_response(start_response, 404, errors.NOT_FOUND)
        handler = methods.get(environ["REQUEST_METHOD"])
        if handler is None:
            self._note(environ, path, None)
            allow = ", ".join(methods)
            return json_response(start_response, 405, errors.METHOD_NOT_ALLOWED,
                                 [("allow", allow)])
        return handler(self, environ, start_response)

    # -- bookkeeping ------------------------------------------------------------------------

    def _note(self, environ: dict[str, Any], path: str, body: Any,
              raw: bytes = b"") -> dict[str, Any] | None:
        """Count the request and keep it in the record (control and probe traffic aside);
        returns the record, so the answer's status can be added to it."""
        if path.startswith("/sim/"):
            return None
        self.state.count_path(path)
        if path in PROBED_PATHS and not self.state.config.record_health:
            return None
        entry = {
            "time": time.time(),
            "method": environ["REQUEST_METHOD"],
            "path": path,
            "query": environ.get("QUERY_STRING", ""),
            "headers": request_headers(environ),
            "body": body,
        }
        if body is None and raw:
            entry["body_raw"] = raw[:RECORDED_RAW_BODY_CHARS].decode("utf-8", "replace")
        self.state.record(entry)
        return entry

    # -- vLLM's endpoints -------------------------------------------------------------------

    def health(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        self._note(environ, "/health", None)
        self.state.count("health_checks")
        return empty_response(start_response, 200 if self.state.healthy else 503)

    def version(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        self._note(environ, "/version", None)
        return json_response(start_response, 200, wire.version())

    def models(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        self._note(environ, "/v1/models", None)
        cfg = self.state.config
        return json_response(start_response, 200, wire.models_list(
            cfg.model, cfg.max_model_len, self.state.adapters))

    def load_lora(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        """vLLM's runtime LoRA loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): the adapter's
        name becomes a model of this server, listed in /v1/models with the base as parent."""
        path = environ["PATH_INFO"]
        try:
            body = validate.parse_body(read_body(environ), environ.get("CONTENT_TYPE", ""))
            self._note(environ, path, body)
            name, where = body.get("lora_name"), body.get("lora_path")
            if not name or not where or not isinstance(name, str):
                raise errors.SimError(400, "Both 'lora_name' and 'lora_path' must be "
                                      "provided.", "InvalidUserInput")
            if name == self.state.config.model:
                raise errors.SimError(400, f"The lora adapter '{name}' conflicts with a "
                                      "served base model.", "InvalidUserInput")
            if name in self.state.adapters and not body.get("load_inplace"):
                raise errors.SimError(
                    400, f"The lora adapter '{name}' has already been loaded. If you want to "
                    "load the adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        except errors.SimError as exc:
            return self._error(start_response, exc)
        self.state.adapters[name] = {"path": str(where), "loaded_at": time.time()}
        return text_response(start_response, 200,
                             f"Success: LoRA adapter '{name}' added successfully.")

    def unload_lora(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        path = environ["PATH_INFO"]
        try:
            body = validate.parse_body(read_body(environ), environ.get("CONTENT_TYPE", ""))
            self._note(environ, path, body)
            name = body.get("lora_name")
            if not name:
                raise errors.SimError(400, "'lora_name' needs to be provided to unload a LoRA "
                                      "adapter.", "InvalidUserInput")
            if name not in self.state.adapters:
                raise errors.SimError(404, f"The lora adapter '{name}' cannot be found.",
                                      "NotFoundError")
        except errors.SimError as exc:
            return self._error(start_response, exc)
        del self.state.adapters[name]
        return text_response(start_response, 200,
                             f"Success: LoRA adapter '{name}' removed successfully.")

    def completion(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        path = environ["PATH_INFO"]
        raw = read_body(environ)
        body: dict[str, Any] | None = None
        parse_error: errors.SimError | None = None
        try:
            body = validate.parse_body(raw, environ.get("CONTENT_TYPE", ""))
        except errors.SimError as exc:
            parse_error = exc
        entry = self._note(environ, path, body, raw)
        environ[RECORD] = entry
        state = self.state
        state.count("completions")
        request_id = environ.get("HTTP_X_REQUEST_ID")
        state.enter(request_id)
        handed_off = False
        if entry is not None:
            # The status each completion was answered with ("status" in /sim/requests), set
            # when the status line is decided: a stream's 200 is there while it still runs.
            start_response = _recording_status(start_response, entry)
        try:
            result = self._complete(environ, start_response, path, body, parse_error)
            handed_off = isinstance(result, stream.StreamBody)
            return result
        finally:
            if not handed_off:
                state.leave(request_id, slot=bool(environ.get(SLOT)))

    def tokenize(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        """vLLM's ``POST /tokenize``: the very token ids the sim's prefix cache (and its KV
        events) use for that prompt or conversation."""
        try:
            body = validate.parse_body(read_body(environ), environ.get("CONTENT_TYPE", ""))
            self._note(environ, validate.TOKENIZE_PATH, body)
            cfg = self.state.config
            prompt, want_strs = validate.parse_tokenize(body, cfg.model, self.state.adapters)
        except errors.SimError as exc:
            return self._error(start_response, exc)
        ids = textgen.token_ids(prompt)
        return json_response(start_response, 200, {
            "count": len(ids), "max_model_len": cfg.max_model_len, "tokens": ids,
            "token_strs": textgen.token_strs(prompt) if want_strs else None})

    def metrics(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        """vLLM's ``GET /metrics``, its scheduler gauges only: what a router reads to see the
        engine's queue (docs/behaviour.md#routing-policies)."""
        self._note(environ, "/metrics", None)
        body = wire.engine_metrics(self.state.config.model, [self.state.engine_gauges()])
        start_response(status_line(200), [
            ("content-type", "text/plain; version=0.0.4; charset=utf-8"),
            ("content-length", str(len(body)))])
        return [body]

    def kv_event_sources(self, environ: dict[str, Any],
                         start_response: StartResponse) -> WSGIResult:
        """vLLM's ``GET /kv_event_sources``: where each DP rank publishes its KV events ({}
        when events are off)."""
        self._note(environ, "/kv_event_sources", None)
        return json_response(start_response, 200, self.state.kv_event_sources())

    def profile(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        """vLLM's profiler switch: 200 with an empty body, or 404 when no profiler is set up."""
        path = environ["PATH_INFO"]
        self._note(environ, path, None)
        state = self.state
        if not state.config.profiler:
            return json_response(start_response, 404, errors.NOT_FOUND)
        state.profiling = path == "/start_profile"
        state.count("profiles_started" if state.profiling else "profiles_stopped")
        return empty_response(start_response, 200)

    # -- one completion request -------------------------------------------------------------

    def _complete(
        self, environ: dict[str, Any], start_response: StartResponse, path: str,
        body: dict[str, Any] | None, parse_error: errors.SimError | None,
    ) -> WSGIResult:
        state = self.state
        sock = environ.get("sim.socket")
        if state.engine_dead:
            return self._error(start_response, errors.engine_dead())
        fail_status = state.take_fail()
        if fail_status is not None:
            return json_response(start_response, fail_status,
                                 errors.injected_failure(fail_status).body())
        if state.take_hang():
            return self._hang(sock, start_response)
        try:
            if parse_error is not None:
                raise parse_error
            assert body is not None
            cfg = state.config
            req = validate.parse_request(path, body, cfg.model, cfg.max_model_len,
                                         state.adapters)
            rank = self._dp_rank(environ)
            answer = roles.answer(req, state, rank)
            state.count_model(req.model)
        except errors.SimError as exc:
            return self._error(start_response, exc)
        except roles.HandleWithoutBlocks as exc:
            logger.warning("decode got kv_transfer_params without remote_block_ids %s; the "
                           "engine dies", exc)
            state.engine_dead = True
            return self._error(start_response, errors.engine_dead())
        except roles.IncompleteHandle as exc:
            # Real vLLM: "Got invalid KVTransferParams", the request hangs, and when the client
            # gives up the EngineCore dies on a KeyError (/health 503, process gone).
            logger.warning("decode got incomplete kv_transfer_params %s; hanging", exc)
            result = self._hang(sock, start_response)
            state.engine_dead = True
            return result
        cfg = state.config
        if not state.batch.acquire(cfg.max_num_seqs, _priority(body), cfg.scheduling_policy,
                                   lambda: pacing.client_gone(sock)):
            state.abort(stream=req.stream)  # left while waiting for a place: vLLM aborts it
            pacing.hang_up(sock)
            return json_response(start_response, 499, {"error": "client gone"})
        environ[SLOT] = True
        first_at, token_delay = self._costs(answer, _priority(body))
        if answer.pull is not None:
            # The decode's own TTFT runs while it waits for the KV: the first token comes at
            # whichever is later, as when a real decode is busy while the prefill computes.
            pulled = mooncake.pull(answer.pull, sock, cfg.kv_timeout)
            failed = self._pulled(pulled.outcome, sock, start_response)
            if failed is not None:
                return failed
            if pulled.prompt is not None and pulled.prompt != req.prompts[-1]:
                # Another request's KV: the answer continues that prompt, not this one.
                state.count("kv_transfers_crossed")
                answer.pieces = [textgen.generate(pulled.prompt, len(p)) for p in answer.pieces]
        fp = wire.fingerprint(state.engine_id)
        if req.stream:
            events = stream.plan_events(
                answer, chat=req.chat, include_usage=req.include_usage, model=req.model,
                fingerprint=fp, ttft=0.0, token_delay=token_delay,
                logprobs=req.logprobs)
            drop_after = state.take_drop()
            start_response(status_line(200), list(SSE_HEADERS))
            return stream.StreamBody(events, state, sock, drop_after,
                                     environ.get("sim.flush_headers"),
                                     environ.get("HTTP_X_REQUEST_ID"), first_at=first_at,
                                     record=environ.get(RECORD))
        steps = max((len(p) for p in answer.pieces), default=0)
        if pacing.wait_until_or_gone(sock, first_at) or \
                pacing.wait_or_gone(sock, token_delay * max(steps - 1, 0)):
            state.abort(stream=False)
            pacing.hang_up(sock)
            if answer.transfer_id is not None:
                state.transfers.settle(answer.transfer_id, ok=False)
            return json_response(start_response, 499, {"error": "client gone"})
        if answer.transfer_id is not None:
            state.transfers.settle(answer.transfer_id, ok=True)
        build = wire.chat_response if req.chat else wire.completion_response
        return json_response(start_response, 200, build(
            request_id=answer.request_id,
            created=int(time.time()),
            model=req.model,
            texts=["".join(p) for p in answer.pieces],
            finish_reasons=answer.finish_reasons,
            fingerprint=fp,
            usage=wire.usage(answer.prompt_tokens, answer.completion_tokens,
                             answer.cached_tokens if cfg.prompt_tokens_details else 0),
            kv_transfer_params=answer.kv_transfer_params,
            ec_transfer_params=answer.ec_transfer_params,
            logprobs=None if req.logprobs is None else [
                (logprobs.chat_logprobs(p, req.logprobs) if req.chat
                 else logprobs.completion_logprobs(p, req.logprobs))
                for p in answer.pieces],
        ))

    def _costs(self, answer: roles.Answer,
               priority: int) -> tuple[Callable[[], float], float]:
        """(when the first token comes, as a monotonic time read when needed; inter-token
        time) for ``answer``: the configured constants, or with the cost model
        (costmodel.py) what this server's prefill queue and batch make them. The first token
        follows the prompt's prefill, which a more urgent prompt (``priority`` under
        ``--scheduling-policy priority``) arriving before it starts puts off."""
        cfg = self.state.config
        now = time.monotonic()
        if cfg.prefill_tokens_per_s <= 0:
            first = now + cfg.ttft
            return (lambda: first), cfg.token_delay
        engine = self.state.engine
        step = engine.inter_token(cfg.token_delay, cfg.token_delay_per_stream, now,
                                  cfg.token_delay_per_context_token)
        computed = answer.computed_tokens
        if computed is None:
            computed = max(0, answer.prompt_tokens - answer.cached_tokens)
        rank = priority if cfg.scheduling_policy == "priority" else 0
        job = engine.queue(computed, cfg.prefill_tokens_per_s, rank, now)
        after = cfg.ttft + step
        steps = max((len(p) for p in answer.pieces), default=0)
        end = job.end + after + step * max(steps - 1, 0)
        if steps > 1:
            engine.stream_until(end, answer.prompt_tokens + steps // 2)
        engine.hold(-(-(answer.prompt_tokens + steps) // cfg.block_size), end)
        return (lambda: job.end + after), step

    def _pulled(self, outcome: str, sock: Any | None,
                start_response: StartResponse) -> WSGIResult | None:
        """Account for a Mooncake pull; a response if the request ends here, else None."""
        state = self.state
        if outcome == mooncake.PULLED:
            state.count("kv_handles_mooncake")
        elif outcome == mooncake.INVALID:
            state.count("kv_handles_invalid")  # nothing to pull: recompute, as a real one would
        elif outcome == mooncake.GONE:
            state.abort(stream=False)
            pacing.hang_up(sock)
            return json_response(start_response, 499, {"error": "client gone"})
        else:
            state.count(f"kv_transfers_{outcome}")
            return self._error(start_response, errors.SimError(
                500, f"KV transfer {outcome.replace('_', ' ')}: the prefill never delivered "
                "the KV for this request"))
        return None

    def _dp_rank(self, environ: dict[str, Any]) -> int:
        raw = environ.get(DP_RANK_HEADER)
        if raw is None:
            return 0
        dp_size = self.state.config.dp_size
        try:
            rank = int(raw)
        except ValueError:
            rank = -1
        if not 0 <= rank < dp_size:
            raise errors.bad_request(
                f"data_parallel_rank {raw} is out of range [0, {dp_size}).", None)
        self.state.count_rank(rank)
        return rank

    def _error(self, start_response: StartResponse, exc: errors.SimError) -> WSGIResult:
        self.state.count("errors")
        return json_response(start_response, exc.status, exc.body())

    def _hang(self, sock: Any | None, start_response: StartResponse) -> WSGIResult:
        """Answer nothing until the client leaves (or the cap passes), then cut the line."""
        if pacing.wait_or_gone(sock, HANG_CAP_SECONDS):
            self.state.abort(stream=False)
        else:
            logger.warning("hung request still open after %.0f s; closing it", HANG_CAP_SECONDS)
        pacing.hang_up(sock)
        return empty_response(start_response, 500)

    # -- the control surface ----------------------------------------------------------------

    def sim(self, environ: dict[str, Any], start_response: StartResponse) -> WSGIResult:
        handler = CONTROL[environ["PATH_INFO"]]
        return handler(self.state, environ, start_response)


def _priority(body: dict[str, Any] | None) -> int:
    """The request's ``priority`` as vLLM's lax model reads it (0 when absent)."""
    value = (body or {}).get("priority", 0)
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _recording_status(start_response: StartResponse, entry: dict[str, Any]) -> StartResponse:
    def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        entry["status"] = int(status.split(" ", 1)[0])
        return start_response(status, headers, exc_info)
    return start


CONTROL = {
    "/sim/stats": control.stats,
    "/sim/requests": control.requests,
    "/sim/config": control.config,
    "/sim/faults": control.faults,
    "/sim/reset": control.reset,
}
ROUTES: dict[str, dict[str, Handler]] = {
    "/health": {"GET": SimApp.health},
    "/version": {"GET": SimApp.version},
    "/v1/models": {"GET": SimApp.models},
    "/v1/load_lora_adapter": {"POST": SimApp.load_lora},
    "/v1/unload_lora_adapter": {"POST": SimApp.unload_lora},
    validate.COMPLETIONS_PATH: {"POST": SimApp.completion},
    validate.CHAT_PATH: {"POST": SimApp.completion},
    validate.TOKENIZE_PATH: {"POST": SimApp.tokenize},
    "/kv_event_sources": {"GET": SimApp.kv_event_sources},
    "/metrics": {"GET": SimApp.metrics},
    "/start_profile": {"POST": SimApp.profile},
    "/stop_profile": {"POST": SimApp.profile},
    "/sim/stats": {"GET": SimApp.sim},
    "/sim/requests": {"GET": SimApp.sim},
    "/sim/config": {"GET": SimApp.sim, "POST": SimApp.sim},
    "/sim/faults": {"GET": SimApp.sim, "POST": SimApp.sim},
    "/sim/reset": {"POST": SimApp.sim},
}
