"""Every setting the proxy has, declared once: its name, type, default, check and help.

Two channels, one table each (gunicorn's ``config.py`` is the model): environment variables,
read by gunicorn's configuration, the master's hooks or each worker's app; and the roster's
``settings:`` keys, whose pydantic schema ``roster.py`` generates from ``ROSTER``. Whatever
reads a setting reads it here, and tests hold the README's tables to these declarations.
Standard library and the other declarations of control/ only: the gunicorn master imports
this.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from epd_flask.control import policyspecs
from epd_flask.control.roles import ROLES

#: Who reads an environment variable: gunicorn itself (a setting of etc/gunicorn.conf.py),
#: our hooks in the gunicorn master, or each worker's app.
GUNICORN, MASTER, APP = "gunicorn", "master", "app"

#: The request log line's formats (``EPD_LOG_FORMAT``).
LOG_FORMATS = ("logfmt", "json")
#: gunicorn's log levels (``EPD_LOG_LEVEL``), plus the aliases ``logging`` accepts.
LOG_LEVELS = ("debug", "info", "warning", "warn", "error", "critical")
#: The default in-flight cap leaves this share of gunicorn's worker_connections free, so a
#: worker at its cap still accepts connections to refuse quickly and to answer probes.
IN_FLIGHT_SHARE = 0.9
PREFILL_FAILURES = ("fail", "recompute")
#: A tenant's class (docs/behaviour.md#admission): strictly in this order, first served first.
PRIORITIES = ("high", "normal", "low")
#: What weighted fair sharing among a class's tenants counts (docs/behaviour.md#admission).
SHARE_BY = ("requests", "tokens")
#: The example roster shipped inside the package (in a checkout, a link to etc/roster.yaml):
#: what a server started with no roster named serves, a simulated prefill on :8100 and decode
#: on :8200.
DEFAULT_ROSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_roster.yaml")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

Environ = Mapping[str, str]


@dataclass(frozen=True)
class EnvVar:
    """One environment variable.

    ``type`` picks the parse (whole numbers, seconds, on/off, text, comma-separated list);
    ``choices`` restricts text; ``minimum`` and ``maximum`` bound whole numbers. An empty
    value means "unset" unless ``literal``: for gunicorn's own ``HOST``-style values an empty
    string is a value.
    ``shown`` is the README's default column where it is not the value itself. Each variable
    is also a flag of the ``epd-flask`` command (``EPD_WORKERS`` is ``--workers``), except a
    ``secret``: a key on a command line is readable by every user of the host. Each one the
    app reads is an attribute of ``ProxyConfig`` (``config.py``), named by ``attribute``.
    """

    name: str
    type: type
    default: Any
    help: str
    read_by: tuple[str, ...]
    choices: tuple[str, ...] = ()
    minimum: int = 1
    maximum: int | None = None
    literal: bool = False
    default_from: Callable[[Environ], Any] | None = None
    shown: str | None = None
    secret: bool = False
    metavar: str | None = None
    attr: str | None = None

    @property
    def attribute(self) -> str:
        """Its name as an attribute of the worker's ``ProxyConfig`` (``EPD_MAX_BODY_BYTES``
        is ``max_body_bytes``), unless ``attr`` says otherwise."""
        return self.attr or self.name.removeprefix("EPD_").lower()

    @property
    def flag(self) -> str | None:
        """The ``epd-flask`` option setting this variable; None for a secret."""
        if self.secret:
            return None
        return "--" + self.name.removeprefix("EPD_").lower().replace("_", "-")

    def read(self, environ: Environ | None = None) -> Any:
        """The value in effect; a bad one raises ValueError naming the variable."""
        env = os.environ if environ is None else environ
        raw = env.get(self.name)
        if self.type is str and self.choices:
            return _choice(self.name, raw or self.default, self.choices)
        if raw is None or (raw == "" and not self.literal):
            return self.default_value(env)
        if self.type is bool:
            return _bool(self.name, raw, self.default_value(env))
        if self.type is int:
            return _int(self.name, raw, self.minimum, self.maximum)
        if self.type is float:
            return _float(self.name, raw)
        if self.type is tuple:
            return tuple(s.strip() for s in raw.split(",") if s.strip()) or self.default
        return raw

    def default_value(self, environ: Environ | None = None) -> Any:
        if self.default_from is not None:
            return self.default_from(os.environ if environ is None else environ)
        return self.default

    def shown_default(self) -> str:
        """The default as the README's environment table writes it."""
        if self.shown is not None:
            return self.shown
        if isinstance(self.default, bool) or self.default is None:
            raise TypeError(f"{self.name}: declare how the README shows its default")
        return _number(self.default) if isinstance(self.default, int | float) \
            else str(self.default)


@dataclass(frozen=True)
class RosterSetting:
    """One key of the roster's ``settings:`` mapping; bounds as pydantic's ``Field`` names
    them (``ge``, ``gt``, ``le``)."""

    name: str
    type: Any
    default: Any
    help: str
    unit: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    shown: str | None = None
    #: A setting that is a mapping of settings of its own (``admission``): absent, the
    #: feature is off; present, each key has its default.
    keys: tuple[RosterSetting, ...] = ()

    def bounds(self) -> dict[str, float]:
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le))
                if v is not None}

    def shown_default(self) -> str:
        """The default as the README's roster settings table writes it."""
        if self.shown is not None:
            return self.shown
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        if isinstance(self.default, str):
            return f"`{self.default}`"
        return _number(self.default)


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _bind(env: Environ) -> str:
    return f"{ENV['HOST'].read(env)}:{ENV['PORT'].read(env)}"


def _in_flight(env: Environ) -> int:
    return max(1, int(ENV["EPD_WORKER_CONNECTIONS"].read(env) * IN_FLIGHT_SHARE))


_ENV_VARS = (
    EnvVar("EPD_ROSTER", str, DEFAULT_ROSTER, "roster file", (MASTER, APP),
           shown="the packaged example (a checkout's `etc/roster.yaml`)", metavar="FILE",
           attr="roster_path"),
    EnvVar("EPD_ROSTER_MAX_BYTES", int, 256 * 1024,
           "a larger roster file is refused before it is read", (MASTER, APP)),
    EnvVar("EPD_ROSTER_MAX_INSTANCES", int, 1024,
           "a roster listing more instances is refused", (MASTER, APP)),
    EnvVar("EPD_BIND", str, None, "listen address", (GUNICORN,), default_from=_bind,
           shown="`$HOST:$PORT`", metavar="HOST:PORT"),
    EnvVar("HOST", str, "127.0.0.1", "listen host when EPD_BIND is unset", (GUNICORN,),
           literal=True, metavar="HOST"),
    EnvVar("PORT", int, 8000, "listen port when EPD_BIND is unset", (GUNICORN,),
           maximum=65535, metavar="PORT"),
    EnvVar("EPD_WORKERS", int, None, "gunicorn workers (gevent: one per core)", (GUNICORN,),
           default_from=lambda env: os.cpu_count() or 1, shown="number of cores"),
    # The app reads it only as the base of EPD_MAX_IN_FLIGHT's default.
    EnvVar("EPD_WORKER_CONNECTIONS", int, 1000, "concurrent connections per worker",
           (GUNICORN,)),
    # gunicorn accepts 0 for these three (no heartbeat limit, no grace, no keep-alive).
    EnvVar("EPD_WORKER_TIMEOUT", int, 60,
           "seconds a worker's loop may stay blocked before the master replaces it",
           (GUNICORN,), minimum=0),
    # A worker's drain takes it from gunicorn's configuration (post_worker_init).
    EnvVar("EPD_GRACEFUL_TIMEOUT", int, 600,
           "seconds old workers may finish their streams on reload/stop", (GUNICORN,),
           minimum=0),
    EnvVar("EPD_KEEPALIVE", int, 75, "seconds an idle client connection is kept open",
           (GUNICORN,), minimum=0),
    # Closing a kept-alive connection the client is just reusing loses that request ("closed
    # without response"), so connections busy a moment ago are left to gunicorn, which answers
    # what arrives on them with ``Connection: close``.
    EnvVar("EPD_DRAIN_IDLE_GRACE", float, 2.0,
           "seconds a kept-alive client connection must have been idle before a stopping "
           "worker closes it", (APP,)),
    EnvVar("EPD_MAX_IN_FLIGHT", int, None, "client requests one worker serves at once",
           (APP,), default_from=_in_flight, shown="90 % of `EPD_WORKER_CONNECTIONS`"),
    EnvVar("EPD_MAX_BODY_BYTES", int, 32 * 1024 * 1024, "request bodies above this get 413",
           (APP,)),
    EnvVar("EPD_POOL_MAXSIZE", int, 1024,
           "kept-alive upstream connections per instance per worker", (APP,)),
    # Below vLLM's own keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) with a second to spare.
    EnvVar("EPD_UPSTREAM_IDLE_TIMEOUT", float, 4.0,
           "seconds an idle upstream connection may still be reused", (APP,)),
    EnvVar("EPD_UPSTREAM_KEEPALIVE", bool, True,
           "off: one upstream connection per request", (APP,), shown="on"),
    EnvVar("EPD_UPSTREAM_CA_BUNDLE", str, None,
           "PEM bundle https:// instances are verified against", (APP,),
           shown="(system store)", metavar="FILE"),
    EnvVar("EPD_UPSTREAM_CLIENT_CERT", str, None,
           "client certificate shown to instances (mutual TLS)", (APP,), shown="",
           metavar="FILE"),
    EnvVar("EPD_UPSTREAM_CLIENT_KEY", str, None,
           "key of EPD_UPSTREAM_CLIENT_CERT", (APP,), shown="", metavar="FILE"),
    EnvVar("EPD_API_KEYS", tuple, (), "serving API keys, comma-separated", (APP,),
           shown="(none: open)", secret=True),
    EnvVar("EPD_API_KEYS_FILE", str, None, "serving API keys, one per line", (APP,),
           shown="(none: open)", metavar="FILE"),
    EnvVar("EPD_MAX_JSON_DEPTH", int, 64, "request bodies nested deeper get 400", (APP,)),
    # A trickled head or body holds a connection (and a body an in-flight slot) for as long
    # as the client likes; nginx in front sends both at once.
    EnvVar("EPD_HEADER_TIMEOUT", float, 10.0,
           "seconds a client may take to send a request's head", (APP,)),
    EnvVar("EPD_BODY_TIMEOUT", float, 60.0,
           "seconds a client may take to send a request's body", (APP,)),
    # A client that stops reading holds its stream's in-flight slot, and the decode sequence
    # (KV blocks) behind it, for as long as its connection stays open.
    EnvVar("EPD_CLIENT_WRITE_TIMEOUT", float, 30.0,
           "seconds a client may accept no byte of its answer", (APP,)),
    # vLLM's events are hundreds of bytes (kilobytes with logprobs); relaying one means
    # holding it whole until its end.
    EnvVar("EPD_MAX_EVENT_BYTES", int, 4 * 1024 * 1024,
           "longest SSE event relayed from decode", (APP,)),
    # Prefill's answer is one token plus handles, an encoder's a few references: kilobytes.
    EnvVar("EPD_MAX_UPSTREAM_BODY_BYTES", int, 8 * 1024 * 1024,
           "most read from a prefill, encoder or probe answer", (APP,)),
    EnvVar("EPD_ADMIN_PREFIX", str, "", "path prefix of the admin API", (APP,),
           shown="(none)", metavar="PATH"),
    EnvVar("EPD_INSTANCE_SCHEMES", tuple, ("http", "https"),
           "schemes an instance URL may be registered with", (APP,), shown="`http,https`"),
    EnvVar("EPD_INSTANCE_NETWORKS", tuple, (),
           "networks (CIDR) registered instance URLs must resolve into", (APP,),
           shown="(any)"),
    EnvVar("EPD_LOG_LEVEL", str, "info", "log level of gunicorn and the proxy",
           (GUNICORN, MASTER), choices=LOG_LEVELS),
    EnvVar("EPD_BACKEND_API_KEY", str, None,
           "sent to prefill and decode instead of the client's Authorization", (APP,),
           shown="unset", secret=True),
    EnvVar("EPD_LOG_FORMAT", str, "logfmt", "the one line per request: logfmt or json",
           (MASTER, APP), choices=LOG_FORMATS),
    EnvVar("EPD_LOG_UPSTREAM", bool, False, "also one line per upstream call", (APP,),
           shown="0"),
    EnvVar("EPD_DEBUG_ENDPOINTS", bool, False, "serve GET /debug/worker", (APP,), shown="0"),
    EnvVar("EPD_ACCESS_LOG", str, None, "gunicorn's access log file (`-` for stderr)",
           (GUNICORN,), shown="unset (no access log)", metavar="FILE"),
    EnvVar("PROMETHEUS_MULTIPROC_DIR", str, None, "where the workers write their metrics",
           (MASTER, APP), shown="a private temporary directory", metavar="DIR"),
    EnvVar("ADMIN_API_KEY", str, None, "key of the admin API; unset disables it",
           (MASTER, APP), shown="unset", secret=True),
    EnvVar("EPD_METRICS_KEY", str, None,
           "bearer token Prometheus sends for /metrics (and people for /status)", (APP,),
           shown="unset", secret=True),
    EnvVar("EPD_STATE_DIR", str, None,
           "runtime state the master shares with its workers", (MASTER, APP),
           shown="a fresh `/tmp/epd-flask-*` per master", metavar="DIR"),
    EnvVar("EPD_PIDFILE", str, None, "gunicorn writes the master's pid here", (GUNICORN,),
           shown="unset (`make run`: `.venv/gunicorn.pid`)", metavar="FILE"),
    EnvVar("FORWARDED_ALLOW_IPS", str, "127.0.0.1",
           "addresses whose X-Forwarded-* headers gunicorn trusts", (GUNICORN,),
           literal=True, metavar="A,B,..."),
    # OpenTelemetry's own variables, with the meaning its specification gives them: these the
    # app reads itself (whether tracing is on, and what a worker holds for export); the SDK
    # reads the others (sampler, resource, headers, timeouts; README "Tracing").
    EnvVar("OTEL_EXPORTER_OTLP_ENDPOINT", str, None,
           "OTLP/HTTP collector; set, tracing is on (spans to `<url>/v1/traces`)", (APP,),
           shown="unset (tracing off)", metavar="URL"),
    EnvVar("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", str, None,
           "the traces URL itself, instead of the one above; set, tracing is on", (APP,),
           shown="unset", metavar="URL"),
    # Only "true" disables, as the specification says: any other value is not an error.
    EnvVar("OTEL_SDK_DISABLED", str, None, "`true`: tracing off, whatever the endpoint",
           (APP,), shown="unset", metavar="true"),
    EnvVar("OTEL_BSP_MAX_QUEUE_SIZE", int, 2048,
           "finished spans a worker holds for export; past it they are dropped (counted)",
           (APP,)),
    EnvVar("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", int, 512,
           "spans per export request (at most OTEL_BSP_MAX_QUEUE_SIZE)", (APP,)),
    EnvVar("OTEL_BSP_SCHEDULE_DELAY", int, 5000,
           "milliseconds between exports of a batch not yet full", (APP,)),
)

_ADMISSION_KEYS = (
    RosterSetting("queue_timeout", float, 30.0,
                  "a request may wait this long for capacity, then 503 `overloaded`",
                  "seconds", gt=0, le=3600),
    RosterSetting("max_queue", int, 1000,
                  "requests one worker keeps waiting; beyond it the one that would go last "
                  "is refused (503 `overloaded`)",
                  "requests", ge=0, le=100_000),
    RosterSetting("tenant_header", str, "",
                  "a trusted request header naming the tenant", shown="none"),
    RosterSetting("store", str, "",
                  "redis:// URL of the rate-limit counters every proxy host shares",
                  shown="none (per host)"),
    RosterSetting("forward_priority", bool, False,
                  "set vLLM's `priority` from the tenant's class"),
    RosterSetting("share_by", Literal[SHARE_BY], "requests",
                  "what a tenant's weighted share counts: requests, or their tokens"),
    RosterSetting("reserve", int, 0,
                  "places of each instance with `max_concurrency` a class leaves free while "
                  "a better class's request arrived in the last 5 s",
                  "places", ge=0, le=100_000),
)


_ROSTER_SETTINGS = (
    # A name declared in connectorspecs.py; roster.py checks it against that list.
    RosterSetting("connector", str, "nixl",
                  "how prefill and decode meet"),
    # Only connectors whose decode can serve alone (nixl, none) honour "recompute".
    RosterSetting("prefill_failure", Literal[PREFILL_FAILURES], "fail",
                  "a failed prefill leg: fail the request, or let decode recompute"),
    RosterSetting("decode_retries", int, 1,
                  "retries of a 5xx or unreachable leg before the first byte", "attempts",
                  ge=0, le=10),
    RosterSetting("probe_interval", float, 5.0, "between GET /health probes", "seconds",
                  gt=0, le=3600),
    RosterSetting("probe_timeout", float, 2.0, "a probe slower than this failed", "seconds",
                  gt=0, le=600),
    # Read in the probe round that follows, so never more often than the probes.
    RosterSetting("engine_metrics_interval", float, 5.0,
                  "between reads of an instance's GET /metrics (its engine's queue) for "
                  "routing; 0 = never", "seconds", ge=0, le=3600),
    RosterSetting("fail_threshold", int, 3, "consecutive failures before eviction",
                  "failures", ge=1, le=100),
    RosterSetting("evicted_ttl", float, 0.0,
                  "forget an instance evicted this long; 0 keeps probing", "seconds", ge=0),
    RosterSetting("encoder_max_batch_size", int, 0,
                  "images per encoder request (0 = unlimited)", "items", ge=0),
    RosterSetting("encoder_concurrency", int, 8,
                  "encoder calls one request keeps in flight", "calls", ge=1, le=1024),
    RosterSetting("encoder_timeout", float, 300.0, "the whole encode stage of a request",
                  "seconds", gt=0),
    RosterSetting("rewrite_media", bool, True,
                  "send the next stage *_embeds references instead of the media"),
    # Per-stage read timeouts; each expiry is a client error naming the stage.
    RosterSetting("connect_timeout", float, 3.0, "connecting to any instance", "seconds",
                  gt=0, le=600),
    RosterSetting("prefill_timeout", float, 600.0, "waiting for prefill's answer", "seconds",
                  gt=0),
    RosterSetting("decode_timeout", float, 600.0,
                  "waiting for a stream's first byte (status line, then first event)",
                  "seconds", gt=0),
    RosterSetting("decode_chunk_timeout", float, 300.0,
                  "silence allowed between two chunks of decode's answer", "seconds", gt=0),
    # A non-stream answer's first byte is its last, so this is the only bound on one;
    # vLLM's own clients set none.
    RosterSetting("decode_total_timeout", float, 0.0,
                  "the whole decode call, first byte to last; 0 = no limit", "seconds", ge=0),
    # A role left out routes by the default policy; the names are checked against
    # policyspecs.POLICIES when a roster is read (roster.py), so a policy is one line there.
    RosterSetting("routing", dict[Literal[ROLES], str], {},
                  "the routing policy of each role", shown=f"`{policyspecs.DEFAULT}`"),
    RosterSetting("routing_load_factor", float, 1.25,
                  "prefix and session affinity spill past this multiple of the average load",
                  "factor", ge=1.0, le=100.0),
    # Off the request path: each worker publishes and reads in the background, and routing
    # reads its last snapshot (docs/behaviour.md#routing-policies 2).
    RosterSetting("load_store", str, "",
                  "redis:// URL where proxy hosts share their open calls per instance, so "
                  "routing counts every host's in prompt tokens", shown="none (per host)"),
    RosterSetting("kv_tokenize_timeout", float, 0.5,
                  "kv_aware's /tokenize call; past it the request routes by prefix", "seconds",
                  gt=0, le=10),
    RosterSetting("session_header", str, "",
                  "a request header naming the session for session affinity (before `user`)",
                  shown="none"),
    # Some clients and load balancers treat 503 specially; the answer when a stage has no
    # live instance is the operator's to choose, the same for every stage.
    RosterSetting("no_backend_status", int, 503,
                  "the HTTP status when a stage has no live instance", "status", ge=500,
                  le=599),
    RosterSetting("no_backend_message", str, "",
                  "the message then, for every stage; empty: one naming the stage (and model)",
                  shown="(names the stage)"),
    RosterSetting("disaggregate_min_prompt_tokens", int, 0,
                  "prompts leaving decode fewer tokens to compute skip prefill; 0 = never",
                  "tokens", ge=0),
    # Dynamo's conditional disaggregation: a decode with nothing to do computes a prompt
    # sooner than a prefill with a queue (docs/behaviour.md#routing-policies, 8).
    RosterSetting("disaggregate_max_prefill_queue_tokens", int, 0,
                  "while every prefill has this many prompt tokens queued, an idle decode "
                  "computes the prompt itself; 0 = never", "tokens", ge=0),
    # Absent (the default), nothing waits and nothing is counted: requests go out as they
    # arrive (docs/behaviour.md#admission).
    RosterSetting("admission", None, None,
                  "queue requests for capacity; tenants' limits and shares", keys=_ADMISSION_KEYS),
)


def _index(items: Iterable[Any]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for item in items:
        if item.name in table:
            raise ValueError(f"setting {item.name} is declared twice")
        table[item.name] = item
    return table


#: Environment variables by name.
ENV: dict[str, EnvVar] = _index(_ENV_VARS)
#: The roster's ``settings:`` keys by name.
ROSTER: dict[str, RosterSetting] = _index(_ROSTER_SETTINGS)
#: ``admission:``'s keys by name.
ADMISSION: dict[str, RosterSetting] = _index(_ADMISSION_KEYS)


def roster_rows() -> dict[str, RosterSetting]:
    """Every key an operator may write under ``settings:``, a nested one as
    ``admission.queue_timeout``: the README's table has one row each."""
    rows: dict[str, RosterSetting] = {}
    for setting in ROSTER.values():
        if setting.keys:
            rows.update((f"{setting.name}.{key.name}", key) for key in setting.keys)
        else:
            rows[setting.name] = setting
    return rows


def read(name: str, environ: Environ | None = None) -> Any:
    """The value of environment variable ``name`` (declared above) in ``environ``."""
    return ENV[name].read(environ)


def default(name: str) -> Any:
    """The declared default of an environment variable or a roster setting."""
    return ENV[name].default if name in ENV else ROSTER[name].default


def _int(name: str, raw: str, minimum: int, maximum: int | None) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be positive, got {value}" if minimum > 0
                         else f"{name} must not be negative, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value


def _float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {raw!r}")
    return value


def _bool(name: str, raw: str, default: bool) -> bool:
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be one of on/off, true/false, 1/0; got {value!r}")


def _choice(name: str, raw: str, choices: tuple[str, ...]) -> str:
    value = raw.strip().lower()
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value
