"""An instance whose ``/v1/models`` names a fresh set of long names on every read (a broken or
hostile engine, or adapters loaded and unloaded without end) must not grow a worker: its
metrics label only names served now or lately, its log says what changed in a line of
bounded length, and a name past the length cap makes the answer unreadable
(docs/behaviour.md#models)."""

from __future__ import annotations

import json
import logging
import socket
from typing import Any

import pytest
import requests

from epd_flask.control.roster import MAX_MODEL_NAME
from epd_flask.observe.observer import RECENT_MODELS
from tests.fakes import response
from tests.helpers import scrape

NAMES_PER_READ = 200


class Churning:
    """``GET /v1/models`` answers ``NAMES_PER_READ`` names never listed before; a completion
    is answered for any model. ``extra`` names are added to the next answer."""

    def __init__(self) -> None:
        self.reads = 0
        self.listed: list[list[str]] = []
        self.extra: list[str] = []

    def names(self, read: int) -> list[str]:
        return [f"churn-{read:03d}-{i:03d}-" + "x" * 90 for i in range(NAMES_PER_READ)]

    def __call__(self, conn: socket.socket, request: bytes) -> None:
        line = request.split(b"\r\n", 1)[0]
        if line.startswith(b"GET /health"):
            conn.sendall(response(body=b"{}"))
        elif line.startswith(b"GET /v1/models"):
            names = self.names(self.reads) + self.extra
            self.reads += 1
            self.listed.append(names)
            doc = {"object": "list", "data": [{"id": n, "object": "model"} for n in names]}
            conn.sendall(response(body=json.dumps(doc).encode()))
        else:
            model = json.loads(request.split(b"\r\n\r\n", 1)[1])["model"]
            doc = {"id": "c", "object": "text_completion", "model": model,
                   "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
            conn.sendall(response(body=json.dumps(doc).encode()))


def model_labels(samples: dict[Any, float]) -> set[str]:
    return {dict(labels)["model"] for (name, labels) in samples
            if name.startswith("epd_model_") and "model" in dict(labels)}


def test_a_churning_model_list_keeps_metrics_and_log_lines_bounded(
        fake, proxy, caplog: pytest.LogCaptureFixture) -> None:
    upstream = Churning()
    instance = fake(upstream)
    px = proxy({"settings": {"probe_interval": 60},
                "instances": [{"role": "prefill_decode", "url": instance.url}]})
    sizes = []
    with caplog.at_level(logging.INFO, logger="epd_flask.fleet.registry"):
        for read in range(10):
            px.services.prober.probe_all()  # one fresh list of 200 names
            served = upstream.listed[-1]
            assert px.services.pipeline.catalog.resolve(served[0]) == served[0]
            for model in (served[0], served[-1]):  # a series for each of two served names
                r = requests.post(px.url + "/v1/completions", timeout=10,
                                  json={"model": model, "prompt": "hi", "max_tokens": 1})
                assert r.status_code == 200, r.text
            samples = scrape(px.url)
            sizes.append(len(requests.get(px.url + "/metrics", timeout=10).content))
            # Only names served now, or among the last RECENT_MODELS that left.
            left = upstream.listed[-2][-RECENT_MODELS:] if read else []
            assert model_labels(samples) <= {*served, *left}, read
    assert upstream.reads == 10
    # The exposition stopped growing once the churn was under way: each round's labels
    # replace the last round's instead of adding to them.
    assert max(sizes[3:]) <= sizes[2] * 1.1, sizes
    labels = px.services.metrics.observer.model_labels
    assert len(labels.recent) == RECENT_MODELS and labels.served == set(upstream.listed[-1])
    # Each change is logged as counts and the first few names, never the whole list.
    lines = [r.getMessage() for r in caplog.records if "serves models" in r.getMessage()]
    assert len(lines) == 10
    assert lines[0].endswith("and 190 more") and "200:" in lines[0]
    assert all("added 200" in line and "removed 200" in line for line in lines[1:])
    assert max(len(line) for line in lines) < 4000  # one list of 200 names is ~20,000


def test_a_model_name_past_the_cap_makes_the_answer_unreadable(
        fake, proxy, caplog: pytest.LogCaptureFixture) -> None:
    upstream = Churning()
    instance = fake(upstream)
    px = proxy({"settings": {"probe_interval": 60},
                "instances": [{"role": "prefill_decode", "url": instance.url}]})
    px.services.prober.probe_all()
    known = set(upstream.listed[-1])
    upstream.extra = ["y" * (MAX_MODEL_NAME + 1)]
    with caplog.at_level(logging.WARNING, logger="epd_flask.fleet.registry"):
        px.services.prober.probe_all()
    state = px.services.registry.get(instance.url)
    assert state is not None and set(state.cards or {}) == known  # the last good list stays
    (warning,) = [r.getMessage() for r in caplog.records if "its models" in r.getMessage()]
    assert f"more than {MAX_MODEL_NAME}" in warning and "y" * 100 not in warning
    upstream.extra = ["y" * MAX_MODEL_NAME]  # at the cap: a name like any other
    px.services.prober.probe_all()
    assert "y" * MAX_MODEL_NAME in (state.cards or {})


def test_adapters_churned_through_the_proxy_leave_metrics_bounded(sim, proxy) -> None:
    """The operator loads and unloads adapters through the pass-through (the admin key's
    route) while clients use each: every round's names replace the last round's."""
    d = sim("prefill_decode", model="base")
    admin = {"X-API-Key": "admin-key-abcdefghijkl"}
    px = proxy({"settings": {"probe_interval": 60},
                "instances": [{"role": "prefill_decode", "url": d.url}]},
               admin_api_key=admin["X-API-Key"])
    sizes = []
    for round_ in range(3):
        names = [f"lora-{round_}-{i:02d}" for i in range(40)]
        for name in names:
            r = requests.post(px.url + "/v1/load_lora_adapter", headers=admin, timeout=10,
                              json={"lora_name": name, "lora_path": f"/adapters/{name}"})
            assert r.status_code == 200, r.text
        px.services.prober.probe_all()
        for name in names:
            r = requests.post(px.url + "/v1/completions", timeout=10,
                              json={"model": name, "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200, r.text
        assert model_labels(scrape(px.url, admin)) >= set(names)
        for name in names:
            assert requests.post(px.url + "/v1/unload_lora_adapter", headers=admin,
                                 json={"lora_name": name}, timeout=10).status_code == 200
        px.services.prober.probe_all()
        sizes.append(len(requests.get(px.url + "/metrics", headers=admin,
                                      timeout=10).content))
        # Of the 40 unloaded, the last RECENT_MODELS still label their series.
        assert model_labels(scrape(px.url, admin)) - {"", "base"} == set(names[-RECENT_MODELS:])
    assert max(sizes) <= min(sizes) * 1.1, sizes
