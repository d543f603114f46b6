"""Property-based bad input through real HTTP: every malformed completion request gets a 4xx in
OpenAI's error shape, never a 5xx; what the proxy refuses itself never reaches a backend; and
the worker keeps serving afterwards.

Hypothesis draws the bodies. The fleet (an encoder, a prefill, a decode) and the proxy are
started once per module because hypothesis runs many examples per test and function-scoped
fixtures would be shared between them anyway. ``EXAMPLES`` bounds each test; the whole module
runs in a few seconds.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from typing import Any

import gevent
import pytest
import requests
from gevent.pywsgi import WSGIServer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from epd_flask.app import create_app, services
from epd_flask.control.config import ProxyConfig
from epd_flask.control.roster import parse
from epd_flask.sim import SimConfig, SimServer
from tests.bodies import chat, completion
from tests.helpers import NoDelayHandler
from tests.rosters import instance

EXAMPLES = 40
MAX_BODY = 64 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT: dict[str, Any] = chat("hello", max_tokens=3)
GOOD_COMPLETION: dict[str, Any] = completion("hello", max_tokens=3)
PROPERTY = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

CASES = {"count": 0}


class Fleet:
    def __init__(self) -> None:
        self.sims = [SimServer(SimConfig(role=role)).start()
                     for role in ("encode", "prefill", "decode")]
        doc = {"instances": [instance(s.config.role, s) for s in self.sims]}
        self.app = create_app(ProxyConfig(max_body_bytes=MAX_BODY), parse(doc, "test roster"))
        self.server = WSGIServer(("127.0.0.1", 0), self.app, log=None,
                                 handler_class=NoDelayHandler)
        self.server.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.http = requests.Session()

    def backend_calls(self) -> int:
        return sum(s.state.stats()["completions"] for s in self.sims)

    def post(self, path: str, data: bytes, content_type: str | None = "application/json",
             **headers: str) -> requests.Response:
        if content_type is not None:
            headers["Content-Type"] = content_type
        CASES["count"] += 1
        return self.http.post(self.url + path, data=data, headers=headers, timeout=30)

    def stop(self) -> None:
        self.http.close()
        services(self.app).stop()
        self.server.stop(timeout=1)
        for s in self.sims:
            s.stop()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    yield f
    f.stop()
    print(f"\nbad-input property suite: {CASES['count']} requests")


def assert_openai_error(resp: requests.Response, statuses: range = range(400, 500)) -> dict:
    assert resp.status_code in statuses, (resp.status_code, resp.text[:500])
    assert resp.headers["Content-Type"].startswith("application/json")
    doc = resp.json()
    assert set(doc) == {"error"}, doc
    assert set(doc["error"]) >= {"message", "type", "param", "code"}, doc
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    return doc["error"]


def refused_here(fleet: Fleet, path: str, body: Any, status: int = 400) -> dict:
    """The proxy itself refuses ``body``: the status we expect and no backend heard of it."""
    before = fleet.backend_calls()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    err = assert_openai_error(fleet.post(path, raw), range(status, status + 1))
    assert fleet.backend_calls() == before, "a backend was called for a request we refuse"
    return err


# -- strategies -----------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


LAX_INT = TypeAdapter(int)
LAX_BOOL = TypeAdapter(bool)


def _lax_ok(adapter: TypeAdapter[Any], value: Any) -> bool:
    try:
        adapter.validate_python(value)
    except ValidationError:
        return False
    return True


def _not(*kinds: type) -> Any:
    return json_values.filter(lambda v: not isinstance(v, kinds))


non_lists = _not(list)
non_objects = _not(dict)
non_strings = _not(str)
#: What vLLM's request models (pydantic, lax mode) refuse for an ``int`` / ``bool`` field:
#: "5", 5.0 and true are integers to them, "true", 1 and "no" booleans.
non_booleans = json_values.filter(lambda v: v is not None and not _lax_ok(LAX_BOOL, v))
non_integers = json_values.filter(lambda v: v is not None and not _lax_ok(LAX_INT, v))
bad_contents = json_values.filter(lambda v: v is not None and not isinstance(v, (str, list)))
media_kinds = st.sampled_from(["image_url", "audio_url", "video_url"])


def chat(**fields: Any) -> dict[str, Any]:
    return {**GOOD_CHAT, **fields}


def with_content(content: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": content}])


# -- the fields the proxy reads or rewrites: refused here ------------------------------------

@PROPERTY
@given(messages=non_lists)
def test_messages_of_the_wrong_type(fleet: Fleet, messages: Any) -> None:
    err = refused_here(fleet, CHAT, chat(messages=messages))
    assert err["param"] == "messages"


@PROPERTY
@given(message=non_objects)
def test_messages_that_are_not_objects(fleet: Fleet, message: Any) -> None:
    err = refused_here(fleet, CHAT, chat(messages=[{"role": "user", "content": "a"}, message]))
    assert err["param"] == "messages.1"


@PROPERTY
@given(role=non_strings)
def test_roles_that_are_not_strings(fleet: Fleet, role: Any) -> None:
    refused_here(fleet, CHAT, chat(messages=[{"role": role, "content": "a"}]))


@PROPERTY
@given(content=bad_contents)
def test_content_of_the_wrong_type(fleet: Fleet, content: Any) -> None:
    err = refused_here(fleet, CHAT, with_content(content))
    assert err["param"] == "messages.0.content"


@PROPERTY
@given(part=non_objects.filter(lambda v: not isinstance(v, str))
       | st.fixed_dictionaries({"type": non_strings}),
       position=st.integers(0, 2))
def test_content_parts_of_the_wrong_shape(fleet: Fleet, part: Any, position: int) -> None:
    parts: list[Any] = [{"type": "text", "text": "a"}] * 2
    parts.insert(position, part)
    err = refused_here(fleet, CHAT, with_content(parts))
    assert err["param"].startswith(f"messages.0.content.{position}")


@PROPERTY
@given(text=non_strings)
def test_text_parts_are_vllms_to_judge(fleet: Fleet, text: Any) -> None:
    """vLLM's parser skips a text part without text and renders what the template makes of
    any other: the proxy reads no text, so it refuses none, and never answers 5xx for it."""
    resp = fleet.post(CHAT, json.dumps(with_content([{"type": "text", "text": text}])).encode())
    assert resp.status_code < 500, resp.text[:300]


@PROPERTY
@given(kind=media_kinds,
       payload=json_values.filter(lambda v: not isinstance(v, (str, dict)))
       | st.dictionaries(st.sampled_from(["url", "detail"]), non_strings, min_size=1)
       .filter(lambda d: "url" in d))
@example(kind="image_url", payload={})
@example(kind="video_url", payload=None)
def test_media_items_of_the_wrong_shape(fleet: Fleet, kind: str, payload: Any) -> None:
    err = refused_here(fleet, CHAT, with_content([{"type": "text", "text": "look"},
                                                  {"type": kind, kind: payload}]))
    assert err["param"].startswith("messages.0.content.1")


@PROPERTY
@given(audio=non_objects | st.fixed_dictionaries(
    {"data": non_strings, "format": st.just("wav")}) | st.fixed_dictionaries(
    {"data": st.just("UklGRg=="), "format": non_strings}))
def test_input_audio_of_the_wrong_shape(fleet: Fleet, audio: Any) -> None:
    refused_here(fleet, CHAT, with_content([{"type": "input_audio", "input_audio": audio}]))


@PROPERTY
@given(path=st.sampled_from([CHAT, COMPLETIONS]),
       name=st.sampled_from(["max_tokens", "max_completion_tokens", "min_tokens"]),
       value=non_integers | st.integers(-2**64, -1))
@example(path=CHAT, name="max_tokens", value=0)
@example(path=CHAT, name="max_tokens", value="sixteen")
@example(path=COMPLETIONS, name="max_tokens", value=2.5)
@example(path=COMPLETIONS, name="min_tokens", value="2.5")
def test_token_limits_of_the_wrong_type_or_range(fleet: Fleet, path: str, name: str,
                                                 value: Any) -> None:
    if name == "max_completion_tokens" and path == COMPLETIONS:
        name = "max_tokens"
    base = GOOD_CHAT if path == CHAT else GOOD_COMPLETION
    err = refused_here(fleet, path, {**base, name: value})
    assert err["param"] == name


@PROPERTY
@given(path=st.sampled_from([CHAT, COMPLETIONS]), value=non_booleans)
@example(path=CHAT, value="maybe")
@example(path=COMPLETIONS, value=2)
def test_stream_that_is_not_a_boolean(fleet: Fleet, path: str, value: Any) -> None:
    base = GOOD_CHAT if path == CHAT else GOOD_COMPLETION
    err = refused_here(fleet, path, {**base, "stream": value})
    assert err["param"] == "stream"


@PROPERTY
@given(options=non_objects.filter(lambda v: v is not None))
def test_stream_options_that_are_not_objects(fleet: Fleet, options: Any) -> None:
    refused_here(fleet, CHAT, chat(stream=True, stream_options=options))


@PROPERTY
@given(prompt=json_values.filter(lambda v: not isinstance(v, (str, list)))
       | st.lists(st.one_of(st.floats(allow_nan=False, allow_infinity=False).filter(
                                lambda f: not f.is_integer()),
                            st.none(), st.dictionaries(st.text(max_size=3), scalars,
                                                       max_size=2)), min_size=1, max_size=3))
def test_prompts_of_the_wrong_type(fleet: Fleet, prompt: Any) -> None:
    err = refused_here(fleet, COMPLETIONS, {**GOOD_COMPLETION, "prompt": prompt})
    assert err["param"] == "prompt"


@PROPERTY
@given(model=non_strings.filter(lambda v: v is not None))
def test_models_that_are_not_strings(fleet: Fleet, model: Any) -> None:
    refused_here(fleet, CHAT, chat(model=model))


def test_missing_messages_and_prompt(fleet: Fleet) -> None:
    refused_here(fleet, CHAT, {"model": "tiny-llama"})
    refused_here(fleet, COMPLETIONS, {"model": "tiny-llama", "max_tokens": 2})


# -- what vLLM's models coerce: served, decided on as vLLM decides, forwarded as sent ---------

def _spellings(n: int) -> st.SearchStrategy[Any]:
    return st.sampled_from([n, float(n), str(n), f" {n} ", f"{n}.0", True if n == 1 else n])


lax_flags = st.sampled_from([True, False, 1, 0, 1.0, "true", "false", "True", "1", "0",
                             "yes", "no", "on", "off", "t", "f", "y", "n", None])


@PROPERTY
@given(path=st.sampled_from([CHAT, COMPLETIONS]), limit=st.integers(1, 4).flatmap(_spellings),
       least=st.integers(0, 3).flatmap(_spellings), stream=lax_flags)
@example(path=CHAT, limit="5", least=0, stream="true")
@example(path=COMPLETIONS, limit=5.0, least="3", stream="false")
def test_what_vllm_coerces_is_served(fleet: Fleet, path: str, limit: Any, least: Any,
                                     stream: Any) -> None:
    """``"max_tokens": "5"`` and ``"stream": "true"`` are what vLLM's lax models make 5 and
    True: the proxy serves them, streams exactly when vLLM will, primes prefill with at most
    one token, and decode receives the client's values as written."""
    base = GOOD_CHAT if path == CHAT else GOOD_COMPLETION
    body = {**base, "max_tokens": limit, "min_tokens": least, "stream": stream}
    resp = fleet.post(path, json.dumps(body).encode())
    assert resp.status_code == 200, resp.text[:300]
    streams = LAX_BOOL.validate_python(stream) if stream is not None else False
    assert resp.headers["Content-Type"].startswith("text/event-stream") == streams
    _encoder, prefill, decode = fleet.sims
    primed = prefill.state.requests(1)[0]["body"]
    assert (primed["max_tokens"], primed["stream"]) == (1, False)
    assert LAX_INT.validate_python(primed["min_tokens"]) <= 1
    seen = decode.state.requests(1)[0]["body"]
    assert (seen["max_tokens"], seen["min_tokens"], seen["stream"]) == (limit, least, stream)


# -- the body as a whole ---------------------------------------------------------------------

@PROPERTY
@given(path=st.sampled_from([CHAT, COMPLETIONS]),
       doc=json_values.filter(lambda v: not isinstance(v, dict)))
def test_bodies_that_are_not_objects(fleet: Fleet, path: str, doc: Any) -> None:
    refused_here(fleet, path, doc)


@settings(PROPERTY, max_examples=EXAMPLES // 2)
@given(depth=st.integers(200, 200_000), opener=st.sampled_from(["[", '{"a":']),
       where=st.sampled_from(["top", "content", "unknown_field"]))
def test_deeply_nested_bodies(fleet: Fleet, depth: int, opener: str, where: str) -> None:
    closer = "]" if opener == "[" else "}"
    nested = opener * depth + "1" + closer * depth
    if where == "top":
        raw = '{"messages":' + nested + "}"
    elif where == "content":
        raw = '{"messages":[{"role":"user","content":' + nested + "}]}"
    else:
        raw = json.dumps(GOOD_CHAT)[:-1] + ',"x":' + nested + "}"
    if len(raw) > MAX_BODY:
        return  # the size limit answers first; test_huge_bodies covers that
    refused_here(fleet, CHAT, raw.encode())


@settings(PROPERTY, max_examples=EXAMPLES // 4)
@given(size=st.integers(MAX_BODY + 1, 8 * MAX_BODY), chunked=st.booleans())
def test_huge_bodies(fleet: Fleet, size: int, chunked: bool) -> None:
    padding = "x" * size
    raw = json.dumps(chat(messages=[{"role": "user", "content": padding}])).encode()
    before = fleet.backend_calls()
    CASES["count"] += 1
    data: Any = iter([raw[i:i + 8192] for i in range(0, len(raw), 8192)]) if chunked else raw
    resp = fleet.http.post(fleet.url + CHAT, data=data, timeout=30,
                           headers={"Content-Type": "application/json"})
    assert_openai_error(resp, range(413, 414))
    assert fleet.backend_calls() == before


@PROPERTY
@given(prefix=st.text(string.ascii_letters, max_size=5),
       bad=st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80",
                            b"\xc0\xaf", b"\x80"]),
       field=st.sampled_from(["content", "role", "model"]))
def test_invalid_utf8(fleet: Fleet, prefix: str, bad: bytes, field: str) -> None:
    doc = with_content("__BAD__") if field == "content" else chat(**{field: "__BAD__"})
    if field == "role":
        doc = chat(messages=[{"role": "__BAD__", "content": "x"}])
    raw = json.dumps(doc).encode().replace(b"__BAD__", prefix.encode() + bad)
    refused_here(fleet, CHAT, raw)


@PROPERTY
@given(content_type=st.sampled_from([
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/xml", "text/json", "application/octet-stream", "image/png",
    "application/jsonx"]), path=st.sampled_from([CHAT, COMPLETIONS]))
def test_wrong_content_types(fleet: Fleet, content_type: str, path: str) -> None:
    before = fleet.backend_calls()
    body = GOOD_CHAT if path == CHAT else GOOD_COMPLETION
    resp = fleet.post(path, json.dumps(body).encode(), content_type)
    assert_openai_error(resp, range(415, 416))
    assert fleet.backend_calls() == before


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers(fleet: Fleet, constant: bytes) -> None:
    """Python's parser (vLLM's too) reads NaN and Infinity, and the proxy passes them on as
    read (jsoncodec); in a field the proxy checks they are refused like any other non-integer,
    elsewhere vLLM judges them."""
    err = refused_here(fleet, COMPLETIONS, b'{"prompt": "a", "max_tokens": ' + constant + b"}")
    assert err["param"] == "max_tokens"
    resp = fleet.post(CHAT, json.dumps(GOOD_CHAT).encode()[:-1] + b', "temperature": '
                      + constant + b"}")
    assert resp.status_code < 500


# -- what vLLM judges: relayed as a 4xx -----------------------------------------------------

@PROPERTY
@given(name=st.sampled_from(["temperature", "top_p", "n", "logprobs", "seed", "stop",
                             "presence_penalty"]),
       value=json_values.filter(lambda v: isinstance(v, (dict, list, str)) and v != []))
def test_fields_left_to_vllm_never_5xx(fleet: Fleet, name: str, value: Any) -> None:
    """Fields the proxy neither reads nor rewrites go to vLLM as sent; whatever it makes of
    them, the client never sees a 5xx from us (the sim accepts them; real vLLM 400s)."""
    resp = fleet.post(CHAT, json.dumps(chat(**{name: value})).encode())
    assert resp.status_code < 500, resp.text[:300]


# -- afterwards -----------------------------------------------------------------------------

def test_worker_still_serves_after_the_onslaught(fleet: Fleet) -> None:
    """Runs last in this module: the same worker streams a good request to the end."""
    with fleet.http.post(fleet.url + CHAT, json={**GOOD_CHAT, "stream": True}, stream=True,
                         timeout=30) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    assert requests.get(fleet.url + "/health", timeout=5).status_code == 200
    gevent.sleep(0)
