"""The proxy's own body checks accept what vLLM accepts and refuse only what it refuses (400).

Three sources say what vLLM does: the captured real-vLLM exchanges in
tests/sim/fixtures/realvllm, a table of rows derived from vLLM's request models (each row cites
the field type or validator it follows: ``ChatCompletionRequest`` in
vllm/entrypoints/openai/chat_completion/protocol.py, ``CompletionRequest`` in
.../completion/protocol.py, both pydantic in lax mode, and the chat parser's part rules in
vllm/entrypoints/chat_utils.py), and hypothesis drawing well-formed bodies in every lax
spelling. The bad-input property suite in tests/serving proves the refusals through HTTP.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_flask.core.errors import ClientError
from epd_flask.serving import fields
from epd_flask.web.validation import check_completion

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FIXTURES = Path(__file__).parents[1] / "sim" / "fixtures" / "realvllm"
MESSAGES = [{"role": "user", "content": "hi"}]
BASE = {CHAT: {"model": "m", "messages": MESSAGES}, COMPLETIONS: {"model": "m", "prompt": "hi"}}

CHAT_REQ = "ChatCompletionRequest"
COMPLETION_REQ = "CompletionRequest"
LAX_INT = "int in lax mode: digit strings, integral floats and booleans are integers"
LAX_BOOL = "bool in lax mode: 0/1, 'true'/'false', 'yes'/'no', 'on'/'off', 't'/'f', 'y'/'n'"
SAMPLING = "SamplingParams._verify_args"

#: (path, fields added to the base body, vLLM accepts, why). ``None`` as path: both routes.
TABLE: list[tuple[str | None, dict[str, Any], bool, str]] = [
    (None, {"max_tokens": "5"}, True, f"max_tokens: int | None, {LAX_INT}"),
    (None, {"max_tokens": " 5 "}, True, f"max_tokens: int | None, {LAX_INT}"),
    (None, {"max_tokens": "5.0"}, True, f"max_tokens: int | None, {LAX_INT}"),
    (None, {"max_tokens": "5_0"}, True, f"max_tokens: int | None, {LAX_INT}"),
    (None, {"max_tokens": 5.0}, True, f"max_tokens: int | None, {LAX_INT}"),
    (None, {"max_tokens": True}, True, f"max_tokens: int | None, {LAX_INT}"),
    (None, {"max_tokens": None}, True, "max_tokens: int | None"),
    (None, {"max_tokens": 5.5}, False, "max_tokens: int (int_from_float)"),
    (None, {"max_tokens": "5.5"}, False, "max_tokens: int (int_parsing)"),
    (None, {"max_tokens": "1e3"}, False, "max_tokens: int (int_parsing)"),
    (None, {"max_tokens": "0x10"}, False, "max_tokens: int (int_parsing)"),
    (None, {"max_tokens": [5]}, False, "max_tokens: int (int_type)"),
    (None, {"max_tokens": {"n": 5}}, False, "max_tokens: int (int_type)"),
    (None, {"max_tokens": 0}, False, f"{SAMPLING}: max_tokens must be at least 1"),
    (None, {"max_tokens": "-3"}, False, f"{SAMPLING}: max_tokens must be at least 1"),
    (COMPLETIONS, {"max_tokens": 0, "echo": True}, True,
     f"{COMPLETION_REQ}.to_sampling_params: echo with max_tokens 0 generates nothing"),
    (COMPLETIONS, {"max_tokens": "0", "echo": "yes"}, True,
     f"{COMPLETION_REQ}: echo: bool | None, {LAX_BOOL}"),
    (COMPLETIONS, {"echo": "maybe"}, False, "echo: bool | None (bool_parsing)"),
    (CHAT, {"max_completion_tokens": "7"}, True, f"max_completion_tokens: int | None, {LAX_INT}"),
    (CHAT, {"max_completion_tokens": 7.5}, False, "max_completion_tokens: int (int_from_float)"),
    (CHAT, {"max_completion_tokens": 0}, False, f"{SAMPLING}: max_tokens must be at least 1"),
    (CHAT, {"max_tokens": 0, "max_completion_tokens": 3}, True,
     f"{CHAT_REQ}.build_tok_params: max_completion_tokens wins over max_tokens"),
    (None, {"min_tokens": "2"}, True, f"min_tokens: int = 0, {LAX_INT}"),
    (None, {"min_tokens": 2.0}, True, f"min_tokens: int = 0, {LAX_INT}"),
    (None, {"min_tokens": None}, False, "min_tokens: int = 0 (not Optional: int_type)"),
    (None, {"min_tokens": -1}, False, f"{SAMPLING}: min_tokens must be >= 0"),
    *[(None, {"stream": v}, True, f"stream: bool | None, {LAX_BOOL}")
      for v in ("true", "True", "TRUE", "1", "yes", "on", "t", "y", 1, 1.0,
                "false", "0", "no", "off", "f", "n", 0, 0.0, None)],
    *[(None, {"stream": v}, False, "stream: bool | None (bool_parsing / bool_type)")
      for v in ("maybe", " true", "", 2, 0.5, [], {})],
    (None, {"stream": "yes", "stream_options": {"include_usage": "on"}}, True,
     f"stream_options: StreamOptions; include_usage: bool | None, {LAX_BOOL}"),
    (None, {"stream": True, "stream_options": {"continuous_usage_stats": 0}}, True,
     f"StreamOptions.continuous_usage_stats: bool | None, {LAX_BOOL}"),
    (None, {"stream": True, "stream_options": {"include_usage": "maybe"}}, False,
     "StreamOptions.include_usage: bool | None (bool_parsing)"),
    (None, {"stream": True, "stream_options": "usage"}, False,
     "stream_options: StreamOptions | None (model_type)"),
    (None, {"stream_options": {"include_usage": True}}, False,
     "validate_stream_options: Stream options can only be defined when `stream=True`"),
    (None, {"stream": "false", "stream_options": {"include_usage": True}}, True,
     "validate_stream_options reads the raw value: the string 'false' is truthy there"),
    (None, {"stream": False, "stream_options": {}}, True,
     "validate_stream_options: an empty stream_options is falsy"),
    (None, {"model": None}, True, "model: str | None"),
    (None, {"model": 5}, False, "model: str | None (string_type: no number-to-string)"),
    (CHAT, {"n": "2"}, True, f"{CHAT_REQ}.n: int | None = 1, {LAX_INT}"),
    (CHAT, {"n": None}, True, f"{CHAT_REQ}.n: int | None = 1"),
    (COMPLETIONS, {"n": 2.0}, True, f"{COMPLETION_REQ}.n: int = 1, {LAX_INT}"),
    (COMPLETIONS, {"n": None}, False, f"{COMPLETION_REQ}.n: int = 1 (not Optional)"),
    (None, {"n": "two"}, False, "n: int (int_parsing)"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, True, "prompt: ... | list[str]"),
    (COMPLETIONS, {"prompt": [1, 2]}, True, "prompt: list[Annotated[int, Field(ge=0)]] | ..."),
    (COMPLETIONS, {"prompt": [1.0, 2.0]}, True, f"prompt: list[int ge 0], {LAX_INT}"),
    (COMPLETIONS, {"prompt": [True, 2]}, True, f"prompt: list[int ge 0], {LAX_INT}"),
    (COMPLETIONS, {"prompt": [[1], [2, 3]]}, True, "prompt: ... | list[list[int ge 0]] | ..."),
    (COMPLETIONS, {"prompt": ["1", "2"]}, True, "prompt: ... | list[str] (strings stay text)"),
    (COMPLETIONS, {"prompt": [-1]}, False, "prompt: list[Annotated[int, Field(ge=0)]]"),
    (COMPLETIONS, {"prompt": [1, [2]]}, False, "prompt: no member takes a mixed list"),
    (COMPLETIONS, {"prompt": 5}, False, "prompt: no member takes a number"),
    (COMPLETIONS, {"prompt": [1.5]}, False, "prompt: list[int] (int_from_float)"),
    (COMPLETIONS, {"prompt": ""}, False,
     "validate_prompt_and_prompt_embeds: Either prompt or prompt_embeds must be provided "
     "and non-empty"),
    (COMPLETIONS, {"prompt": None, "prompt_embeds": "AAAA"}, True,
     "validate_prompt_and_prompt_embeds: embeds stand in for a prompt"),
    (CHAT, {"messages": [{"role": "user", "content": ["hi", {"type": "text", "text": "x"}]}]},
     True, "chat_utils ChatCompletionContentPartParam includes str: a bare string is text"),
    (CHAT, {"messages": [{"role": "user", "content": [{"image_url": "http://x/a.png"}]}]},
     True, "chat_utils CustomChatCompletionContentSimpleImageParam: no type needed"),
    (CHAT, {"messages": [{"role": "user", "content": [{"video_url": {"url": "http://x/v"}}]}]},
     True, "chat_utils _parse_chat_message_content_mm_part infers video_url"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     True, "chat_utils PART_TYPES_TO_SKIP_NONE_CONTENT: a text part without text is skipped"),
    (CHAT, {"messages": [{"role": "user", "content": [{"foo": 1}]}]}, False,
     "chat_utils: Missing 'type' field in multimodal part"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": 5}]}]}, False,
     "chat_utils: Invalid 'type' field in multimodal part"),
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}, False,
     "CustomChatCompletionMessageParam.role: Required[str]"),
    (CHAT, {"messages": "hi"}, False, f"{CHAT_REQ}.messages: list[...] (list_type)"),
]


def _rows() -> list[Any]:
    rows = []
    for path, extra, accepted, why in TABLE:
        for one in ([path] if path else [CHAT, COMPLETIONS]):
            name = f"{one.rsplit('/', 1)[-1]}-{json.dumps(extra, sort_keys=True)}"
            rows.append(pytest.param(one, extra, accepted, why, id=name))
    return rows


@pytest.mark.parametrize(("path", "extra", "accepted", "why"), _rows())
def test_the_proxy_judges_as_vllm_does(path: str, extra: dict, accepted: bool,
                                       why: str) -> None:
    body = {**BASE[path], **extra}
    if accepted:
        check_completion(path, body)
        return
    with pytest.raises(ClientError) as info:
        check_completion(path, body)
    assert info.value.status == 400, why
    assert info.value.param.split(".")[0] in {*extra, "messages"}, info.value.param


def _captured() -> list[Any]:
    cases = []
    for req in sorted(FIXTURES.glob("*/*.req")):
        first, _, rest = req.read_text(encoding="utf-8").partition("\n")
        method, target = first.split(" ", 1)
        path = urlsplit(target.strip()).path
        if method != "POST" or path not in BASE:
            continue
        try:
            body = json.loads(rest)
        except ValueError:
            continue
        if not isinstance(body, dict):
            continue
        answer = req.with_suffix(".resp").read_text()
        if not answer.startswith("HTTP/"):
            continue  # the engine-killing capture that never answered
        status = int(answer.split(" ", 2)[1])
        cases.append(pytest.param(path, body, status, id=f"{req.parent.name}/{req.stem}"))
    return cases


@pytest.mark.parametrize(("path", "body", "status"), _captured())
def test_captured_vllm_verdicts_hold(path: str, body: dict, status: int) -> None:
    """What real vLLM answered 200 passes; what the proxy refuses real vLLM refused with 400
    too (the rest of vLLM's refusals, an unknown model or a prompt too long, are its own)."""
    try:
        check_completion(path, body)
    except ClientError as err:
        assert (status, err.status) == (400, 400), (status, err.message)


def test_captured_refusals_include_the_field_types() -> None:
    """The captures hold at least one type refusal the proxy makes itself (and its rows)."""
    refused = [p.values for p in _captured() if p.values[2] == 400]
    ours = []
    for path, body, _ in refused:
        try:
            check_completion(path, body)
        except ClientError as err:
            ours.append(err.param)
    assert {"max_tokens", "prompt", "messages"} <= set(ours), ours


def test_coerced_values_drive_the_proxy() -> None:
    assert [fields.streams({"stream": v}) for v in ("true", "false", 1, "0", None, "maybe")] \
        == [True, False, True, False, False, False]
    assert [fields.count(v) for v in ("5", 5.0, " 7 ", True, "x", 5.5)] == \
        [5, 5, 7, 1, None, None]


# -- hypothesis: every lax spelling of a well-formed body passes -----------------------------

def _lax_ints(least: int) -> st.SearchStrategy[Any]:
    return st.integers(least, 10**6).flatmap(lambda n: st.sampled_from(
        [n, float(n), str(n), f" {n} ", f"{n}.0", f"+{n}"]))


lax_bools = st.sampled_from([True, False, 0, 1, 0.0, 1.0, "true", "false", "True", "FALSE",
                             "1", "0", "yes", "no", "on", "off", "t", "f", "y", "n"])
urls = st.sampled_from(["http://x/a.png", "data:image/png;base64,AAAA", "file:///m.wav"])
parts = st.one_of(
    st.text(max_size=5),
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)}),
    st.sampled_from(["image_url", "audio_url", "video_url"]).flatmap(
        lambda k: st.fixed_dictionaries(
            {k: urls | st.fixed_dictionaries({"url": urls})},
            optional={"uuid": st.text(max_size=4), "type": st.just(k)})),
    st.fixed_dictionaries({"type": st.just("input_audio"), "input_audio": st.fixed_dictionaries(
        {"data": st.just("UklGRg=="), "format": st.sampled_from(["wav", "mp3"])})}),
    # Part types the proxy does not read are vLLM's business, whatever they carry.
    st.fixed_dictionaries({"type": st.sampled_from(["image_embeds", "refusal", "file"]),
                           "x": st.integers()}),
)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
    optional={"content": st.none() | st.text(max_size=5) | st.lists(parts, max_size=3),
              "name": st.text(max_size=3)}), max_size=4)
common = {"model": st.none() | st.text(max_size=5), "max_tokens": st.none() | _lax_ints(1),
          "min_tokens": _lax_ints(0), "n": _lax_ints(1), "temperature": st.floats(0, 2)}
streaming = st.one_of(
    st.fixed_dictionaries({}, optional={"stream": st.none() | lax_bools}),
    st.fixed_dictionaries({"stream": st.sampled_from([True, "true", "yes", 1]),
                           "stream_options": st.fixed_dictionaries(
                               {}, optional={"include_usage": st.none() | lax_bools,
                                             "continuous_usage_stats": lax_bools})}))


@settings(max_examples=150, deadline=None)
@given(body=st.fixed_dictionaries({"messages": messages}, optional={
    **common, "max_completion_tokens": st.none() | _lax_ints(1)}), stream=streaming)
def test_well_formed_chat_bodies_pass(body: dict[str, Any], stream: dict[str, Any]) -> None:
    check_completion(CHAT, {**body, **stream})


@settings(max_examples=100, deadline=None)
@given(body=st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=5)
                                   | st.lists(st.text(max_size=3), min_size=1, max_size=3)
                                   | st.lists(st.integers(0, 50000), min_size=1, max_size=4)
                                   | st.lists(st.lists(st.integers(0, 9), min_size=1),
                                              min_size=1, max_size=2)},
                                  optional={**common, "echo": lax_bools}), stream=streaming)
def test_well_formed_completion_bodies_pass(body: dict[str, Any], stream: dict[str, Any]) -> None:
    check_completion(COMPLETIONS, {**body, **stream})


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": 7}}]}]},
     "messages.0.content.0.image_url.url"),
    ({"messages": [], "max_tokens": 0}, "max_tokens"),
    ({"messages": [], "max_tokens": 1.5}, "max_tokens"),
    ({"messages": [], "stream": True, "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage"),
    ({"prompt": [1, [2]]}, "prompt"),
])
def test_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    path = CHAT if "messages" in body else COMPLETIONS
    with pytest.raises(ClientError) as info:
        check_completion(path, body)
    assert info.value.param == param and info.value.status == 400
