"""Every metric the README documents moves when what it counts happens.

One fleet (an encoder, a prefill, two decodes) and a proxy go through what an operator would
watch for: multimodal and streamed requests, a retried decode failure, a probe failure that
evicts an instance and its rejoin, admin changes applied and refused, a request refused at the
in-flight cap, a stream ended by a stopping worker, and (each on an app of its own, whose
metrics are its own) a membership source that cannot reach its nameserver and spans traced to a
collector and lost to one that is gone. ``/metrics`` is scraped over HTTP after each step. An
app's metrics are born with it: its first scrape counts what it started with other than 0
(the roster, the cap), every later one what appeared or changed since the one before. A
documented metric that never moved fails the test, and so does a documented name the
exposition does not know. A metric added to the README without anything that moves it fails
here until a step does.
"""

from __future__ import annotations

import re
from pathlib import Path

import gevent
import requests
import yaml

from tests import rosters
from tests.bodies import chat, image
from tests.helpers import RawStream, Samples, eventually, free_port, scrape
from tests.otlp import Receiver
from tests.unit.test_kvaware import Publisher, publish_until_ready

README = Path(__file__).parents[2] / "README.md"
KEY = "metrics-admin-key"
CHAT = chat(temperature=0, max_tokens=4)
IMAGE = image("https://media.invalid/m.png")
SUFFIXES = ("_bucket", "_count", "_sum", "_created")


def documented() -> set[str]:
    """The metric names in the README's table of metrics (first column, backquoted)."""
    names: set[str] = set()
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `epd_"):
            first = line.split("|")[1]
            names.update(re.findall(r"`(epd_[a-z_]+)`", first))
    return names


def family(sample_name: str) -> str:
    for suffix in SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def moved(before: Samples, after: Samples, absent: float | None = None) -> set[str]:
    """Families with a series that appeared or changed value between two scrapes; with
    ``absent``, a series missing before counts as that value (an app's first scrape against
    its birth, with 0: only what it started with other than 0)."""
    return {family(name) for (name, labels), value in after.items()
            if before.get((name, labels), absent) != value}


def test_every_documented_metric_moves(sim, proxy, tmp_path: Path, monkeypatch) -> None:
    names = documented()
    assert len(names) >= 20, names  # the table was found
    e, p = sim("encode"), sim("prefill")
    d1 = sim("decode", token_delay=0.05, output_tokens=400)
    d2 = sim("decode", token_delay=0.05, output_tokens=400)
    events = Publisher()  # the prefill's KV-event endpoint, as vLLM's
    doc = rosters.roster([(p, {"kv_events": events.endpoint})], [d1], encoders=[e],
                         fail_threshold=1, probe_interval=60)
    roster = tmp_path / "roster.yaml"
    roster.write_text(yaml.safe_dump(doc))
    px = proxy(doc, roster_path=str(roster), admin_api_key=KEY, max_in_flight=2)
    seen: set[str] = set()
    last: Samples | None = None

    def step() -> None:
        nonlocal last
        now = scrape(px.url, {"X-API-Key": KEY})
        seen.update(moved(last or {}, now, 0.0 if last is None else None))
        last = now

    # Probes (last-probe gauges, live instances) and the admin API (a reload applied, one
    # refused): d2 joins the roster.
    px.services.prober.probe_all()
    step()
    auth = {"X-API-Key": KEY}
    assert requests.post(px.url + "/instances", json={"role": "decode", "url": d2.url},
                         headers=auth, timeout=5).status_code == 201
    assert requests.post(px.url + "/instances", json={"role": "prefill", "url": d1.url},
                         headers=auth, timeout=5).status_code == 409
    px.services.prober.probe_all()
    step()
    # Requests: a multimodal one (encode, prefill and decode stages), a stream (chunks).
    image = {**CHAT, **chat([IMAGE])}
    assert requests.post(px.url + "/v1/chat/completions", json=image, timeout=10).ok
    with requests.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                       stream=True, timeout=10) as r:
        assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
    step()
    # A decode failure before the first byte: an upstream error, retried on the other decode
    # (round robin sends one of two requests to d1 first).
    d1.state.inject(fail_next=1)
    for _ in range(2):
        assert requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10).ok
    step()
    # A failed probe evicts d1 (fail_threshold 1); a passing one readmits it.
    d1.state.inject(health_fail=True)
    px.services.prober.probe_all()
    step()
    d1.state.inject(health_fail=False)
    px.services.prober.probe_all()
    step()
    # Two long streams hold the cap of 2: upstream and client in-flight gauges rise, and a
    # third request is refused; then the worker stops and ends both streams.
    streams = [RawStream(px.url, "/v1/chat/completions", {**CHAT, "max_tokens": 400,
                                                          "stream": True}) for _ in range(2)]
    for s in streams:
        s.first_event()
    refused = requests.post(px.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert refused.status_code == 503
    step()
    ended = gevent.spawn(px.services.drain.run, 0.1)
    assert ended.get(timeout=10) == 2
    for s in streams:
        s.hang_up()
    eventually(lambda: not px.services.inflight.count, what="both streams' slots freed")
    step()
    # KV-cache events: a subscriber per instance with an endpoint, sent until it hears.
    assert px.services.kv_events is not None
    px.services.kv_events.sync()
    try:
        assert eventually(lambda: px.services.kv_events.readers[p.url].connected)
        publish_until_ready(px.services.kv_events, events, p.url, [0] * 64)
    finally:
        px.services.kv_events.stop()
        events.close()
    step()
    # A membership source whose nameserver does not answer says so, on its own app's
    # /metrics (each app's metrics are its own): scraped before its sources start and after.
    lost = proxy({"discovery": {"dns": [{"name": "d.svc.test", "role": "decode", "port": 8000,
                                         "interval": 0.1,
                                         "nameserver": f"127.0.0.1:{free_port()}"}]}})
    before = scrape(lost.url)
    lost.services.start()
    dns = lost.services.sources["dns"]
    assert eventually(lambda: dns.state.detail != "starting" and not dns.state.up)
    after = scrape(lost.url)
    seen.update(moved(before, after) & {"epd_discovery_up"})
    exposed = [*after]
    # Tracing: spans sent to a collector, and spans lost to one that is gone.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")
    collector, gone = Receiver().start(), Receiver().start()
    gone.stop()
    try:
        for url in (collector.url, gone.url):
            traced = proxy(doc, otel_exporter_otlp_traces_endpoint=url)
            before = scrape(traced.url)
            traced.services.tracing.start()
            assert requests.post(traced.url + "/v1/chat/completions", json=CHAT,
                                 timeout=10).ok
            traced.services.tracing.flush(10)
            after = scrape(traced.url)
            seen.update(moved(before, after) & {"epd_tracing_spans_exported_total",
                                                "epd_tracing_spans_dropped_total"})
            exposed += after
    finally:
        collector.stop()
    # Admission (an app of its own, in front of one place): a tenant's request waits and goes
    # out, the tenant's rate limit refuses one, and the shared stores it names (the rate
    # limits', the hosts' load) do not answer.
    place = sim("prefill_decode", token_delay=0.05, output_tokens=400)
    doc = rosters.roster(combined=[(place, {"max_concurrency": 1})],
                         admission={"tenant_header": "X-Tenant",
                                    "store": f"redis://127.0.0.1:{free_port()}/0"},
                         load_store=f"redis://127.0.0.1:{free_port()}/0")
    doc["tenants"] = {"t": {"requests_per_minute": 2}}
    admitted = proxy(doc)
    tenant = {"X-Tenant": "t"}
    before = scrape(admitted.url)
    held = RawStream(admitted.url, "/v1/chat/completions",
                     {**CHAT, "max_tokens": 400, "stream": True})
    held.first_event()
    queued = gevent.spawn(requests.post, admitted.url + "/v1/chat/completions", json=CHAT,
                          headers=tenant, timeout=10)
    eventually(lambda: admitted.services.admission.waiting == 1, what="a request waiting")
    during = scrape(admitted.url)
    held.hang_up()
    assert queued.get(timeout=10).ok
    assert [requests.post(admitted.url + "/v1/chat/completions", json=CHAT, headers=tenant,
                          timeout=10).status_code for _ in range(2)] == [200, 429]
    admitted.services.live.registry.share.exchange()
    after = scrape(admitted.url)
    seen.update({name for name in moved(before, during) | moved(during, after)
                 if name.startswith(("epd_admission_", "epd_load_store_"))})
    exposed += after

    known = {family(name) for name, _ in (*last, *exposed)}
    assert names <= known, f"documented but never exposed: {sorted(names - known)}"
    assert names <= seen, f"documented but never moved: {sorted(names - seen)}"
