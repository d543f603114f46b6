"""Tracing's pieces without a server (docs/behaviour.md#tracing): when it is on, which URL the
spans go to, the usage a trace reads from an answer, and that a proxy with tracing off never
loads the OpenTelemetry SDK."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epd_flask.control.config import ProxyConfig
from epd_flask.observe.tracing import TraceSettings, traces_url
from epd_flask.serving.usage import last_usage

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("base", "traces", "url"), [
    (None, None, None),
    ("http://c:4318", None, "http://c:4318/v1/traces"),
    ("http://c:4318/", None, "http://c:4318/v1/traces"),
    ("http://c:4318/otlp", None, "http://c:4318/otlp/v1/traces"),
    ("http://c:4318", "http://t:9/in", "http://t:9/in"),  # the per-signal one, as it is
    (None, "http://t:9/in", "http://t:9/in"),
])
def test_the_traces_url_is_resolved_as_the_specification_says(base, traces, url) -> None:
    assert traces_url(base, traces) == url


@pytest.mark.parametrize(("disabled", "on"), [
    (None, True), ("true", False), ("TRUE", False), (" True ", False), ("false", True),
    ("1", True), ("yes", True), ("", True),  # only "true" disables; nothing else is an error
])
def test_only_true_disables_the_sdk(disabled, on) -> None:
    config = ProxyConfig(otel_exporter_otlp_endpoint="http://c:4318", otel_sdk_disabled=disabled)
    assert (TraceSettings.from_config(config) is not None) is on


def test_tracing_is_off_without_an_endpoint_and_bounded_with_one() -> None:
    assert TraceSettings.from_config(ProxyConfig()) is None
    settings = TraceSettings.from_config(ProxyConfig(
        otel_exporter_otlp_traces_endpoint="http://t:9/in", otel_bsp_max_queue_size=100,
        otel_bsp_max_export_batch_size=10, otel_bsp_schedule_delay=250))
    assert settings == TraceSettings("http://t:9/in", 100, 10, 0.25)
    with pytest.raises(ValueError, match="OTEL_BSP_MAX_EXPORT_BATCH_SIZE"):
        ProxyConfig(otel_bsp_max_queue_size=10, otel_bsp_max_export_batch_size=11)


@pytest.mark.parametrize(("data", "found"), [
    (b'{"id":"x","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
     b'"prompt_tokens_details":{"cached_tokens":4}}}', (7, 3, 4)),
    (b'data: {"choices":[],"usage": {"prompt_tokens":7,"total_tokens":10,'
     b'"completion_tokens":3}}\n\ndata: [DONE]\n\n', (7, 3, None)),
    # the last one counts: vLLM's continuous usage stats repeat it on every event
    (b'data: {"usage":{"completion_tokens":1}}\n\ndata: {"usage":{"completion_tokens":2}}\n\n',
     (None, 2, None)),
    (b'data: {"usage":null}\n\n', None),
    (b'{"usage":{"prompt_tokens":-1,"completion_tokens":true}}', (None, None, None)),
    (b'{"usage":{"prompt_tokens":7', None),  # cut short
    (b'{"content":"\\"usage\\" is a word"}', None),
    (b'{"role":"usage"}', None),
    (b'\xff"usage":{}', (None, None, None)),
    (b'no usage here', None),
])
def test_the_last_usage_object_is_read_alone(data, found) -> None:
    assert last_usage(data) == found


CHECK = """
import sys
from epd_flask.app import create_app, services
from epd_flask.control.config import ProxyConfig
from epd_flask.control.roster import parse

def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")

from epd_flask.sim import SimConfig, SimServer

instance = SimServer(SimConfig(role="prefill_decode")).start()
config = ProxyConfig.from_env()
app = create_app(config, parse({"instances": [
    {"role": "prefill_decode", "url": instance.url}]}, "test"))
built = loaded()
answer = app.test_client().post("/v1/chat/completions", json={
    "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]})
services(app).start()
answered = loaded()
services(app).stop()
instance.stop()
print(json.dumps({"built": built, "answered": answered, "status": answer.status_code,
                  "traced": "trace_id=" in "".join(LINES)}))
"""


def run_app(tmp_path: Path, **env: str) -> dict[str, object]:
    """Build an app in a fresh gevent-patched interpreter, answer one request, start and stop
    its services: which OpenTelemetry modules were loaded, and when."""
    script = tmp_path / "check.py"
    script.write_text("import json, logging\nLINES = []\nclass Keep(logging.Handler):\n"
                      "    def emit(self, record):\n        LINES.append(record.getMessage())\n"
                      "logging.getLogger('epd_flask.requests').addHandler(Keep())\n"
                      "logging.getLogger('epd_flask.requests').setLevel(logging.INFO)\n"
                      + CHECK)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-m", "gevent.monkey", str(script)], cwd=ROOT,
                         env={**clean, "EPD_STATE_DIR": str(tmp_path), **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_tracing_off_never_loads_the_sdk(tmp_path: Path) -> None:
    off = run_app(tmp_path)
    assert off["status"] == 200 and not off["traced"]
    assert off["built"] == off["answered"] == []


def test_tracing_on_loads_the_sdk_when_the_server_starts_it(tmp_path: Path) -> None:
    """Not when the app is built (the gunicorn master never builds one, and a worker's import
    of the app stays light): when ``Services.start`` runs, after the fork."""
    on = run_app(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9")
    assert on["built"] == [] and on["status"] == 200
    assert "opentelemetry.sdk.trace" in on["answered"]  # type: ignore[operator]
    assert not on["traced"]  # the request came before the start: not traced


def test_the_readme_names_every_span_event_and_attribute() -> None:
    """The names are a contract with the operators' dashboards: each one the code writes is
    in the README's "Tracing" section."""
    from epd_flask.observe import otelspans

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Tracing"):readme.index("## The simulator")]
    names = {value for name, value in vars(otelspans).items()
             if name.isupper() and isinstance(value, str) and name not in ("SCOPE",)}
    names |= {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"}
    names |= set(otelspans.OPERATIONS.values())
    missing = sorted(n for n in names if f"`{n}`" not in section)
    assert not missing, f"not in the README's Tracing section: {missing}"
