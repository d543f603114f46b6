"""The fast JSON path must read and write exactly what Python's json (vLLM's parser) would."""

from __future__ import annotations

import json

import pytest

from epd_flask.core import jsoncodec


@pytest.mark.parametrize("text", [
    '{"seed": 123456789012345678901234567890}',
    '{"prompt": "\\ud800 lone surrogate"}',
    '{"prompt": "caf\u00e9 \u2603", "n": 1.5e-7, "ok": true, "none": null, "l": [1, {}]}',
])
def test_round_trip_keeps_what_the_client_sent(text: str) -> None:
    assert json.loads(jsoncodec.dumps(jsoncodec.loads(text.encode("utf-8")))) == json.loads(text)


def test_nan_and_infinity_stay_what_they_were_instead_of_becoming_null() -> None:
    out = jsoncodec.dumps(jsoncodec.loads(b'{"t": NaN, "p": Infinity, "q": -Infinity}'))
    assert out == b'{"t":NaN,"p":Infinity,"q":-Infinity}'


def test_non_utf8_bytes_are_refused_even_when_json_would_guess_the_encoding() -> None:
    utf16 = '{"a": 1}'.encode("utf-16")
    assert json.loads(utf16) == {"a": 1}
    with pytest.raises(UnicodeDecodeError):
        jsoncodec.loads(utf16)


def test_syntax_errors_raise_value_error_with_json_s_message() -> None:
    with pytest.raises(ValueError, match="Expecting"):
        jsoncodec.loads(b'{"a": ')


def test_lone_surrogates_are_written_escaped_not_as_invalid_utf8() -> None:
    out = jsoncodec.dumps({"p": "\ud800x"})
    assert out == b'{"p":"\\ud800x"}'
    out.decode("utf-8")


LONG = "A" * jsoncodec.SHARED_STRING_CHARS


def _big_doc(extra: str) -> bytes:
    return ('{"messages": [{"content": [{"type": "image_url", "image_url": {"url": "data:,'
            + LONG + '"}}]}]' + extra + '}').encode("utf-8")


@pytest.mark.parametrize("extra", [
    "",
    ', "seed": 123456789012345678901234567890',
    ', "t": NaN, "p": -Infinity',
    ', "prompt": "caf\u00e9 \\ud800 lone"',
    ', "list": ["' + LONG + '", 0.5, true, null]',
])
def test_long_strings_are_written_as_json_would_whatever_else_the_body_holds(
        extra: str) -> None:
    raw = _big_doc(extra)
    doc = jsoncodec.loads(raw)
    first, again = jsoncodec.dumps(doc), jsoncodec.dumps(doc)
    assert first == again
    assert first == json.dumps(json.loads(raw), ensure_ascii="ud800" in extra,
                               separators=(",", ":")).encode("utf-8")


def test_a_long_string_is_encoded_once_and_reused_by_every_leg() -> None:
    doc = jsoncodec.loads(_big_doc(""))
    url = doc["messages"][0]["content"][0]["image_url"]["url"]
    assert isinstance(url, jsoncodec.EncodedStr) and url == "data:," + LONG
    jsoncodec.dumps(doc)
    cached = url.json_bytes()
    leg = {"model": "m", "max_tokens": 1, "messages": doc["messages"]}
    out = jsoncodec.dumps(leg)
    assert url.json_bytes() is cached
    assert json.loads(out)["messages"] == json.loads(_big_doc(""))["messages"]


def test_a_long_string_with_a_lone_surrogate_goes_on_escaped() -> None:
    raw = _big_doc("").replace(b'"data:,', b'"\\udc80data:,')
    out = jsoncodec.dumps(jsoncodec.loads(raw))
    out.decode("utf-8")
    assert json.loads(out) == json.loads(raw)


def test_other_subclasses_of_builtin_types_are_written_as_their_base() -> None:
    class Tag(str):
        pass

    class Count(int):
        pass

    assert jsoncodec.dumps({"a": Tag("x"), "n": Count(3), "b": True, "l": [Tag("y")]}) == \
        b'{"a":"x","n":3,"b":true,"l":["y"]}'


def test_small_bodies_hold_plain_strings() -> None:
    assert type(jsoncodec.loads(b'{"p": "short"}')["p"]) is str
