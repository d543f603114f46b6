"""The fast JSON path must read and write exactly what Python's json (vLLM's parser) would."""

from __future__ import annotations

import json

import pytest

from epd_flask import jsoncodec


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
