"""The proxy's own body checks let every well-formed request through (the bad-input property
suite in tests/serving proves the other direction through HTTP)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_flask.core.errors import ClientError
from epd_flask.web.validation import check_completion

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

urls = st.sampled_from(["http://x/a.png", "data:image/png;base64,AAAA", "file:///m.wav"])
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)}),
    st.sampled_from(["image_url", "audio_url", "video_url"]).flatmap(
        lambda k: st.fixed_dictionaries(
            {"type": st.just(k), k: urls | st.fixed_dictionaries({"url": urls})},
            optional={"uuid": st.text(max_size=4)})),
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
limits = st.none() | st.integers(1, 10**6) | st.integers(1, 4096).map(float)
common = {"model": st.none() | st.text(max_size=5), "max_tokens": limits,
          "min_tokens": st.none() | st.integers(0, 10), "stream": st.none() | st.booleans(),
          "stream_options": st.none() | st.fixed_dictionaries(
              {"include_usage": st.booleans()}), "temperature": st.floats(0, 2)}


@settings(max_examples=150, deadline=None)
@given(body=st.fixed_dictionaries({"messages": messages}, optional={
    **common, "max_completion_tokens": limits}))
def test_well_formed_chat_bodies_pass(body: dict[str, Any]) -> None:
    check_completion(CHAT, body)


@settings(max_examples=100, deadline=None)
@given(body=st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=5)
                                   | st.lists(st.text(max_size=3), min_size=1, max_size=3)
                                   | st.lists(st.integers(0, 50000), min_size=1, max_size=4)
                                   | st.lists(st.lists(st.integers(0, 9), min_size=1),
                                              min_size=1, max_size=2)},
                                  optional=common))
def test_well_formed_completion_bodies_pass(body: dict[str, Any]) -> None:
    check_completion(COMPLETIONS, body)


def test_prompt_embeds_stand_in_for_a_prompt() -> None:
    check_completion(COMPLETIONS, {"prompt_embeds": "AAAA"})


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": 7}}]}]},
     "messages.0.content.0.image_url.url"),
    ({"messages": [], "max_tokens": 0}, "max_tokens"),
    ({"messages": [], "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": [1, [2]]}, "prompt"),
])
def test_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    path = CHAT if "messages" in body else COMPLETIONS
    with pytest.raises(ClientError) as info:
        check_completion(path, body)
    assert info.value.param == param and info.value.status == 400
