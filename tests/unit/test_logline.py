"""The request's logfmt line, built piece by piece (serving/context.py), is byte for byte the
line the former field-list formatter wrote (routing decisions repeated in a row written once
with a count), kept here as the reference, for drawn contexts:
odd strings (spaces, quotes, equals signs, backslashes, control characters, non-ASCII, empty),
missing and odd numbers, every optional field present or not."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from epd_flask.serving.context import LogSettings, RequestContext


class Traced:
    """What the line reads of a request's trace (docs/behaviour.md#tracing)."""

    def __init__(self, trace_id: str) -> None:
        self.trace_id = trace_id


def reference_value(value: object) -> str:
    text = "" if value is None else str(value)
    if text and not any(c in text for c in ' "=\\') and text.isprintable():
        return text
    return json.dumps(text)


def reference_line(ctx: RequestContext) -> str:
    fields: list[tuple[str, object]] = [
        ("request_id", ctx.request_id), ("upstream_id", ctx.upstream_id),
        ("route", ctx.route), ("status", ctx.status)]
    if ctx.trace is not None:
        fields.append(("trace_id", ctx.trace.trace_id))
    if ctx.model is not None:
        fields.append(("model", ctx.model))
    fields += list(ctx.instances.items())
    if ctx.routing:
        runs = [(entry, len(list(run))) for entry, run in itertools.groupby(ctx.routing)]
        fields.append(("routing", ",".join(e if n == 1 else f"{e}x{n}" for e, n in runs)))
    fields += [(f"{k}_ms", v) for k, v in ctx.timings.items()]
    fields += [("retries", ctx.retries), ("chunks", ctx.chunks), ("bytes", ctx.bytes_out)]
    rate = ctx.chunks_per_second()
    if rate is not None:
        fields.append(("chunks_per_s", rate))
    if ctx.error:
        fields.append(("error", ctx.error))
    return " ".join(f"{k}={reference_value(v)}" for k, v in fields)


ODD = st.one_of(st.sampled_from(["", " ", '"', "=", "\\", "a b", "x=y", "\n", "\x00", "é", "ü z",
                                 "http://127.0.0.1:8001", "chatcmpl-1"]), st.text(max_size=12))
NUMBER = st.one_of(st.integers(-10, 10**12), st.floats(allow_nan=True, allow_infinity=True))
TIMINGS = st.dictionaries(st.sampled_from(["encode", "rewrite", "prefill", "decode_first_byte",
                                           "first_byte", "total"]), NUMBER, max_size=6)


@settings(max_examples=200, deadline=None)
@given(rid=ODD, route=ODD, status=st.one_of(st.none(), st.integers(0, 599)),
       model=st.one_of(st.none(), ODD), instances=st.dictionaries(
           st.sampled_from(["encode", "prefill", "decode"]), ODD, max_size=3),
       routing=st.lists(ODD, max_size=3), timings=TIMINGS, retries=st.integers(0, 5),
       chunks=st.integers(0, 10**6), nbytes=st.integers(0, 10**9),
       error=st.one_of(st.none(), ODD),
       trace_id=st.one_of(st.none(), st.text("0123456789abcdef", min_size=32, max_size=32)))
def test_the_line_is_the_reference_line(rid: str, route: str, status: int | None,
                                        model: str | None, instances: dict[str, str],
                                        routing: list[str], timings: dict[str, float],
                                        retries: int, chunks: int, nbytes: int,
                                        error: str | None, trace_id: str | None) -> None:
    ctx = RequestContext(rid, route, {}, upstream_id="0123456789abcdef",
                         trace=None if trace_id is None else Traced(trace_id))
    ctx.status, ctx.model, ctx.error = status, model, error
    ctx.instances.update(instances)
    ctx.routing.extend(routing)
    ctx.timings.update(timings)
    ctx.retries, ctx.chunks, ctx.bytes_out = retries, chunks, nbytes
    assert ctx.log_line() == reference_line(ctx)


def test_repeated_decisions_are_written_once_with_their_count() -> None:
    """A request with eight images makes eight encoder decisions; its line stays short."""
    ctx = RequestContext("r", "/v1/chat/completions", {}, upstream_id="u")
    ctx.routing.extend(["encode:round_robin(rotation)"] * 8 + ["decode:prefix(hit)",
                                                               "prefill:prefix(hit)"])
    assert ("routing=encode:round_robin(rotation)x8,decode:prefix(hit),prefill:prefix(hit) "
            in ctx.log_line())


def test_the_json_line_carries_the_trace_id_of_a_traced_request() -> None:
    as_json = LogSettings("json")
    traced = RequestContext("r", "/v1/chat/completions", {}, upstream_id="u",
                            trace=Traced("0af7651916cd43dd8448eb211c80319c"), log=as_json)
    plain = RequestContext("r", "/v1/chat/completions", {}, upstream_id="u", log=as_json)
    assert json.loads(traced.log_line())["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert "trace_id" not in json.loads(plain.log_line())
