"""The roster: which instances exist, in which role, and the fleet-wide settings.

Schema, loading and validation of ``etc/roster.yaml``. Imported by the gunicorn master, so it
stays light (pydantic and PyYAML only, nothing that opens sockets or loads ``ssl``) and imports
nothing of ours but the declarations of settings, connectors and membership sources
(settings.py, connectorspecs.py, sourcespecs.py). ``epd-flask-check-roster FILE`` validates
a file without starting anything.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import stat
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator
from pydantic_core import PydanticCustomError

from epd_flask.control import connectorspecs, policyspecs, sourcespecs
from epd_flask.control import settings as declared
from epd_flask.control.roles import DECODE, PREFILL, PREFILL_DECODE, ROLES, SPLIT

#: The keys of a roster document; a file with others is some other file.
TOP_LEVEL_KEYS = ("settings", "discovery", "tenants", "instances")
#: The address an ``instance:`` template of a DNS entry is checked with (TEST-NET-1).
SAMPLE_HOST = "192.0.2.1"
#: Flow brackets deeper than this are refused before parsing; a roster nests four levels.
MAX_FLOW_DEPTH = 100
#: The most model names one instance serves: its roster ``models``, or the cards of its
#: ``/v1/models`` answer (``fleet/models.py``). Each is a value of the per-model metrics'
#: ``model`` label and a candidate of every request's model lookup.
MAX_MODELS = 1024
#: The longest model name a roster may list: well past a Hugging Face id (96 characters a
#: side of the slash) or a model's local path; anything longer is pasted text.
MAX_MODEL_NAME = 512
_QUOTED = re.compile(r"'[^'\n]*'")
#: The most tenants a roster names: each is a label value of the admission metrics.
MAX_TENANTS = 256
#: A tenant's name: it is a metric label, a key of the shared rate-limit store and a word of
#: the API keys file, so it is short and plain.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
#: The tenant of a request nothing else names (docs/behaviour.md#admission).
DEFAULT_TENANT = "default"
#: The schemes of ``admission.store`` and ``load_store``: Redis over TCP, over TLS, or a UNIX
#: socket.
STORE_SCHEMES = ("redis", "rediss", "unix")

Role = Literal[ROLES]
PrefillFailure = Literal[declared.PREFILL_FAILURES]
Priority = Literal[declared.PRIORITIES]


class RosterError(ValueError):
    """A roster that must not be served; the message is written for the operator."""


class RosterTooLarge(RosterError):
    """More bytes or instances than the limits allow (``EPD_ROSTER_MAX_BYTES``,
    ``EPD_ROSTER_MAX_INSTANCES``); the admin API answers 409 for it."""


class RoleConflict(RosterError):
    """Two records disagree about an instance's role, or combined and split roles mix
    (docs/behaviour.md#roster).

    Separate from field errors so the admin API can answer 409 instead of 422.
    """


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Instance(_Strict):
    role: Role
    url: str
    dp_size: int = Field(default=1, ge=1, le=1024)
    ec_zmq_addrs: tuple[str, ...] | None = None
    bootstrap_url: str | None = None
    kv_zmq_addr: str | None = None
    #: Where the instance publishes its KV-cache events (vLLM's ``--kv-events-config``
    #: endpoint, as a subscriber connects to it), for ``kv_aware`` routing.
    kv_events: str | None = None
    #: The model names (LoRA adapters included) this instance serves, as clients name them.
    #: None: discovered from the instance's ``/v1/models`` (docs/behaviour.md#models).
    models: tuple[str, ...] | None = None
    #: Requests this proxy host may have running on the instance at once; with admission,
    #: more wait in the proxy's queue (docs/behaviour.md#admission). None: no bound.
    max_concurrency: int | None = Field(default=None, ge=1, le=1_000_000)

    @field_validator("models")
    @classmethod
    def _model_names(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if len(value) > MAX_MODELS:
            raise ValueError(f"lists {len(value)} model names, more than {MAX_MODELS} (the "
                             "most one instance may serve)")
        names = tuple(v.strip() for v in value)
        if not names or any(not n for n in names):
            raise ValueError("must list at least one model name, and no empty names "
                             "(leave models out to discover them from /v1/models)")
        longest = max(names, key=len)
        if len(longest) > MAX_MODEL_NAME:
            raise ValueError(f"lists a model name of {len(longest)} characters, more than "
                             f"{MAX_MODEL_NAME}")
        dupes = [n for n, count in Counter(names).items() if count > 1]
        if dupes:
            raise ValueError(f"lists {min(dupes)!r} more than once")
        return names

    @field_validator("url", "bootstrap_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return None if value is None else normalize_url(value)

    @field_validator("kv_zmq_addr")
    @classmethod
    def _kv_address(cls, value: str | None) -> str | None:
        return None if value is None else transfer_address(value)

    @field_validator("kv_events")
    @classmethod
    def _events_endpoint(cls, value: str | None) -> str | None:
        return None if value is None else events_endpoint(value)

    @field_validator("ec_zmq_addrs")
    @classmethod
    def _ec_addresses(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if value is None else tuple(transfer_address(v) for v in value)

    def record(self) -> dict[str, Any]:
        """The fields an operator wrote (defaults left out), as the roster file spells them."""
        return self.model_dump(mode="json", exclude_defaults=True) | {
            "role": self.role, "url": self.url}

    def addresses(self) -> list[tuple[str, str, bool]]:
        """(field, value, is a URL) of every address this record makes someone connect to:
        the URLs are requests the proxy will make, the rest connections the proxy's workers
        (``kv_events``) or the instances make on the proxy's word. The URL policy checks
        them all (control/urlpolicy.check_addresses)."""
        found = [("url", self.url, True)]
        if self.bootstrap_url is not None:
            found.append(("bootstrap_url", self.bootstrap_url, True))
        if self.kv_zmq_addr is not None:
            found.append(("kv_zmq_addr", self.kv_zmq_addr, False))
        if self.kv_events is not None:
            found.append(("kv_events", self.kv_events, False))
        found += [(f"ec_zmq_addrs[{n}]", a, False) for n, a in enumerate(self.ec_zmq_addrs or ())]
        return found


def normalize_url(value: str) -> str:
    """An instance's identity: its base URL without a trailing slash (docs/behaviour.md#roster)."""
    value = value.strip().rstrip("/")
    _printable(value)
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError(f"has an invalid port, got {value!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL with a host, got {value!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"must not carry a query or fragment, got {value!r}")
    return value


def transfer_address(value: str) -> str:
    """A KV/EC transfer address: ``host:port`` or ``tcp://host:port``. It travels in request
    headers (the P2P NCCL request id) and bodies, so it is held to that shape."""
    value = value.strip()
    _printable(value)
    parts = urlsplit(value if "://" in value else "tcp://" + value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path \
            or parts.query or parts.fragment or "@" in parts.netloc:
        raise ValueError(f"must be host:port or tcp://host:port, got {value!r}")
    return value


def events_endpoint(value: str) -> str:
    """A KV-event endpoint to connect a ZMQ subscriber to: ``tcp://host:port``
    (``host:port`` is read as that). vLLM *binds* ``tcp://*:port``; a subscriber must name
    the host."""
    value = transfer_address(value)
    value = value if "://" in value else "tcp://" + value
    if urlsplit(value).port == 0:
        raise ValueError(f"must name the port the instance bound, not 0, got {value!r}")
    if urlsplit(value).hostname in ("*", "0.0.0.0", "::"):
        raise ValueError(f"must name the instance's host (vLLM binds {value}; connect to "
                         f"tcp://<its host>:<port>), got {value!r}")
    return value


def _printable(value: str) -> None:
    """Control characters (a CR LF) in an address would reach request lines and headers."""
    if any(ord(c) < 0x21 or 0x7f <= ord(c) < 0xa0 for c in value):
        raise ValueError(f"must not contain spaces or control characters, got {value!r}")


def _known_connector(cls: Any, value: Any) -> Any:
    """The connector is a name declared in connectorspecs.py; anything else is refused in
    pydantic's own words for a choice outside a list."""
    if not isinstance(value, str) or value not in connectorspecs.CONNECTORS:
        raise PydanticCustomError("literal_error", "Input should be {expected}",
                                  {"expected": connectorspecs.expected()})
    return value


def _known_policies(cls: Any, value: Any) -> Any:
    """Each role's policy is a name declared in policyspecs.py, refused in pydantic's own words
    otherwise (the role names are checked by the schema)."""
    if isinstance(value, dict):
        for role, name in value.items():
            if not isinstance(name, str) or name not in policyspecs.POLICIES:
                raise PydanticCustomError(
                    "literal_error", "Input should be {expected} (for role {role})",
                    {"expected": policyspecs.expected(), "role": str(role)})
    return value


def _store_url(cls: Any, value: Any) -> Any:
    """``admission.store`` and ``load_store`` name a Redis server: checked here, in the
    master, so a typo stops a reload instead of leaving every host on its own counters."""
    if not isinstance(value, str) or not value:
        return value
    _printable(value)
    parts = urlsplit(value)
    if parts.scheme not in STORE_SCHEMES:
        raise ValueError(f"must be a {', '.join(s + '://' for s in STORE_SCHEMES)} URL, got "
                         f"scheme {parts.scheme or '(none)'!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError("has an invalid port") from None
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError("must name the Redis host")
    return value


def _field(setting: declared.RosterSetting) -> tuple[Any, Any]:
    """A declared setting as a pydantic field; one with keys of its own as a model of them,
    absent by default."""
    if setting.keys:
        return (_nested(setting) | None, Field(default=None, description=setting.help))
    return (setting.type, Field(default=setting.default, description=setting.help,
                                **setting.bounds()))


def _nested(setting: declared.RosterSetting) -> Any:
    validators = {"_store_url": field_validator("store")(_store_url)} \
        if setting.name == "admission" else {}
    return create_model(
        setting.name.title(), __base__=_Strict, __module__=__name__, __doc__=setting.help,
        __validators__=validators, **{k.name: _field(k) for k in setting.keys})


#: Fleet-wide behaviour; every value has a default an operator can start from. Generated from
#: the declarations in ``settings.py`` (type, default, bounds, help), which the README's
#: table is checked against.
Settings = create_model(
    "Settings", __base__=_Strict, __module__=__name__,
    __doc__="Fleet-wide behaviour; every value has a default an operator can start from.",
    __validators__={
        "_known_connector": field_validator("connector", mode="before")(_known_connector),
        "_known_policies": field_validator("routing", mode="before")(_known_policies),
        "_store_url": field_validator("load_store")(_store_url)},
    **{s.name: _field(s) for s in declared.ROSTER.values()},
)
#: The ``admission:`` block of ``settings:`` (docs/behaviour.md#admission).
Admission = Settings.model_fields["admission"].annotation.__args__[0]  # type: ignore[union-attr]


class Tenant(_Strict):
    """One tenant of the fleet: its class and share when capacity is short, and its rate
    limits (docs/behaviour.md#admission)."""

    weight: float = Field(default=1.0, gt=0, le=1_000_000)
    priority: Priority = "normal"
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


def _tenant_names(cls: Any, value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) > MAX_TENANTS:
            raise ValueError(f"names {len(value)} tenants, more than {MAX_TENANTS}")
        for name in value:
            if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
                raise ValueError(
                    f"tenant name {str(name)[:80]!r} must be 1 to 64 letters, digits and "
                    "'_.:-', starting with a letter or digit")
    return value


#: Where else the fleet's members come from (docs/behaviour.md#discovery): one optional
#: field per source declared in ``sourcespecs.py``, of the type declared there.
Discovery = create_model(
    "Discovery", __base__=_Strict, __module__=__name__,
    __doc__="Membership sources besides the file's own instances.",
    **{name: (spec.options | None, None) for name, spec in sourcespecs.SOURCES.items()},
)


class Roster(_Strict):
    settings: Settings = Settings()
    discovery: Discovery = Discovery()
    tenants: dict[str, Tenant] = Field(default_factory=dict)
    instances: tuple[Instance, ...] = ()

    _tenant_names = field_validator("tenants", mode="before")(_tenant_names)

    @property
    def sources(self) -> dict[str, Any]:
        """The membership sources this roster configures, by name, with their options."""
        return {name: value for name in sourcespecs.SOURCES
                if (value := getattr(self.discovery, name)) not in (None, ())}

    def tenant(self, name: str) -> Tenant:
        """``name``'s record; ``default`` (weight 1, normal) when the roster lists none."""
        return tenant_of(self.tenants, name)

    @property
    def admission(self) -> bool:
        """Whether requests pass admission control at all: the roster configures it, names
        tenants or bounds an instance's concurrency (docs/behaviour.md#admission)."""
        return admits(self.settings, self.tenants, self.instances)

    def by_role(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    @property
    def combined(self) -> bool:
        """True when decode work goes to prefill_decode instances (no separate prefill)."""
        return any(i.role == PREFILL_DECODE for i in self.instances)


def tenant_of(tenants: Mapping[str, Tenant], name: str) -> Tenant:
    """``name``'s record; ``default``'s when the roster does not list it (weight 1, normal
    and unlimited when it lists no ``default`` either)."""
    found = tenants.get(name)
    if found is None:
        found = tenants.get(DEFAULT_TENANT) or DEFAULT_RECORD
    return found


DEFAULT_RECORD = Tenant()


def admits(settings: Any, tenants: Mapping[str, Tenant], instances: Iterable[Instance]) -> bool:
    """Whether requests pass admission control (docs/behaviour.md#admission)."""
    return settings.admission is not None or bool(tenants) \
        or any(i.max_concurrency is not None for i in instances)


def check_rules(roster: Roster) -> None:
    """The cross-instance rules a schema cannot express (docs/behaviour.md#roster)."""
    urls = Counter(i.url for i in roster.instances)
    dupes = sorted(u for u, n in urls.items() if n > 1)
    if dupes:
        raise RoleConflict(
            f"instance {dupes[0]} is listed more than once; an instance is identified by its "
            "URL, so list it once with a single role"
        )
    roles = {i.role for i in roster.instances}
    if PREFILL_DECODE in roles and roles & set(SPLIT):
        raise RoleConflict(
            "prefill_decode instances cannot be mixed with standalone prefill/decode instances "
            "in one roster; use either combined (prefill_decode) or split (prefill + decode)"
        )
    for inst in roster.instances:
        missing = connector_problem(roster.settings, inst)
        if missing:
            raise RosterError(missing)
        check_instance(inst)
    check_ec_consumers(roster)
    check_models(roster)
    check_discovery(roster)


def check_discovery(roster: Roster) -> None:
    """Every instance a DNS entry can find must pass the checks a registration does
    (docs/behaviour.md#discovery): its ``instance:`` template is checked here, with
    ``{host}`` standing for a sample address, so a bad template stops a reload instead of
    dropping every instance the name finds."""
    for n, entry in enumerate(roster.discovery.dns or ()):
        where = f"discovery.dns[{n}] ({entry.name})"
        record = {**sourcespecs.render(entry.instance, SAMPLE_HOST), "role": entry.role,
                  "url": f"{entry.scheme}://{SAMPLE_HOST}:{entry.port or 8000}"}
        try:
            problem = connector_problem(roster.settings, parse_instance(record, "instance"))
        except RosterError as exc:
            problem = str(exc).removeprefix("instance: ")
        if problem is not None:
            message = problem.replace(f"instance {record['url']}: ", "")
            raise RosterError(f"{where}: instance template: {message}")


def connector_problem(settings: Settings, inst: Instance) -> str | None:
    """What ``inst`` lacks that the roster's connector needs on its role (None: nothing)."""
    for need in connectorspecs.CONNECTORS[settings.connector].needs:
        if inst.role in need.roles and not getattr(inst, need.field):
            return f"instance {inst.url}: {need.message}"
    return None


def mixes_roles(role: str, present: Iterable[str]) -> bool:
    """Whether an instance of ``role`` beside instances of the ``present`` roles would mix
    combined and split serving, which one fleet never does (docs/behaviour.md#roster)."""
    roles = set(present)
    return (role == PREFILL_DECODE and bool(roles & set(SPLIT))) \
        or (role in SPLIT and PREFILL_DECODE in roles)


def check_models(roster: Roster) -> None:
    """A model listed on a prefill must be servable by some decode (docs/behaviour.md#models):
    its KV would be computed for nobody. A decode without ``models`` may serve anything until
    its ``/v1/models`` is read, so only a split roster whose every decode lists its models
    can be judged here."""
    decodes = roster.by_role("decode")
    if not decodes or any(d.models is None for d in decodes):
        return
    decodable = {m for d in decodes for m in d.models or ()}
    for inst in roster.by_role("prefill"):
        for model in inst.models or ():
            if model not in decodable:
                raise RosterError(
                    f"instance {inst.url} (prefill) lists model {model!r}, but no decode "
                    f"instance serves it (decodes list: {', '.join(sorted(decodable))}); add "
                    f"{model!r} to a decode's models or remove it from this prefill")


#: The roles whose instances may consume pushed encoder output: the stage that runs the
#: request's prompt (docs/behaviour.md#routing).
EC_CONSUMERS = (PREFILL, PREFILL_DECODE)


def check_ec_consumers(roster: Roster) -> None:
    """Encoders push Mooncake EC embeddings to one replica of the stage that computes the
    prompt (docs/behaviour.md#routing): a prefill_decode instance (E+PD) or a prefill
    (E+P+D), whose replica the role's policy picks and the proxy names to both the encoders
    and the request. A fleet where only some of those instances take pushes would send some
    requests where no push was addressed (docs/behaviour.md#roster)."""
    for inst in roster.instances:
        if inst.ec_zmq_addrs is not None and inst.role not in EC_CONSUMERS:
            raise RosterError(
                f"instance {inst.url} ({inst.role}): ec_zmq_addrs (Mooncake EC consumer "
                "addresses) belong on the stage that computes the prompt: prefill_decode "
                "instances (E+PD) or prefill instances (E+P+D). Remove them here")
    for role in EC_CONSUMERS:
        consumers = roster.by_role(role)
        pushing = [i.url for i in consumers if i.ec_zmq_addrs is not None]
        if pushing and len(pushing) != len(consumers):
            missing = next(i.url for i in consumers if i.ec_zmq_addrs is None)
            raise RosterError(
                f"instance {missing}: every {role} instance needs ec_zmq_addrs once one "
                f"has them ({pushing[0]} does); encoders must know where each request runs"
            )


#: The roles whose instances a request waits for when they are full.
ADMITTED_ROLES = (PREFILL, DECODE, PREFILL_DECODE)


def check_instance(inst: Instance) -> None:
    """Rules within one record that its fields alone cannot express (docs/behaviour.md#roster)."""
    if inst.max_concurrency is not None and inst.role not in ADMITTED_ROLES:
        raise RosterError(
            f"instance {inst.url} ({inst.role}): max_concurrency bounds the requests an "
            "instance that computes prompts or tokens runs (prefill, decode, prefill_decode); "
            "an encoder's calls are not queued. Remove it here")
    if inst.ec_zmq_addrs is not None and len(inst.ec_zmq_addrs) != inst.dp_size:
        raise RosterError(
            f"instance {inst.url}: ec_zmq_addrs has {len(inst.ec_zmq_addrs)} entries but "
            f"dp_size is {inst.dp_size}; give exactly one address per data-parallel replica"
        )


def parse(doc: Any, source: str = "<roster>", text: str | None = None) -> Roster:
    """Validate a parsed YAML document; errors name the source, the instance and the field.

    A mapping with other top-level keys is a roster with a misspelt key when it has a
    roster's key too, and those keys are named; without one it is some other file the path
    points at (a secret, ``/etc/shadow``, whose keys are its content), and only the lines of
    its keys are given. ``text`` (the file) gives those lines.
    """
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise RosterError(f"{source}: the top level must be a mapping with 'instances' and "
                          f"optional 'settings', 'discovery' and 'tenants', got "
                          f"{type(doc).__name__}")
    foreign = [k for k in doc if k not in TOP_LEVEL_KEYS]
    if foreign:
        what = _foreign_keys(foreign, text) if len(foreign) < len(doc) \
            else _other_file(foreign, text)
        raise RosterError(f"{source}: not a roster: {what}; a roster has only "
                          f"{', '.join(repr(k) for k in TOP_LEVEL_KEYS)}")
    instances = doc.get("instances")
    limit = declared.read("EPD_ROSTER_MAX_INSTANCES")
    if isinstance(instances, list) and len(instances) > limit:
        raise RosterTooLarge(f"{source}: {len(instances)} instances, more than "
                             f"EPD_ROSTER_MAX_INSTANCES ({limit})")
    try:
        roster = Roster.model_validate(doc)
    except ValidationError as exc:
        raise RosterError(
            f"{source}: " + "; ".join(_describe(e, doc) for e in exc.errors())
        ) from None
    try:
        check_rules(roster)
    except RosterError as exc:
        raise type(exc)(f"{source}: {exc}") from None
    return roster


def parse_instance(doc: Any, source: str = "instance") -> Instance:
    """One instance record, validated exactly like an entry of the roster file."""
    if not isinstance(doc, dict):
        raise RosterError(f"{source}: an instance must be a JSON object with 'role' and "
                          f"'url', got {type(doc).__name__}")
    try:
        inst = Instance.model_validate(doc)
    except ValidationError as exc:
        fields = (
            f"field {'.'.join(str(p) for p in e.get('loc', ())) or 'record'!r}: {_message(e)}"
            for e in exc.errors())
        raise RosterError(f"{source}: " + "; ".join(fields)) from None
    try:
        check_instance(inst)
    except RosterError as exc:
        raise RosterError(f"{source}: {exc}") from None
    return inst


def load(path: str | os.PathLike[str]) -> Roster:
    return parse_text(read_text(path), str(path))


def read_text(path: str | os.PathLike[str]) -> str:
    """The roster file's text, refused by its size before a byte is read (a 100 MB file
    would hold the master in PyYAML for a minute), and when it is not a regular file (a FIFO
    would block the read, a device never end)."""
    source = str(path)
    limit = declared.read("EPD_ROSTER_MAX_BYTES")
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise RosterError(f"{source}: not a regular file")
        if st.st_size > limit:
            raise RosterTooLarge(f"{source}: {st.st_size} bytes, larger than "
                                 f"EPD_ROSTER_MAX_BYTES ({limit})")
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise RosterError(f"{source}: cannot read roster file: {exc.strerror or exc}") from None
    if len(data) > limit:  # it grew between stat and read
        raise RosterTooLarge(f"{source}: larger than EPD_ROSTER_MAX_BYTES ({limit})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RosterError(f"{source}: not UTF-8 text (byte {exc.start})") from None


def parse_text(text: str, source: str = "<roster>") -> Roster:
    """Parse and validate roster text; errors give positions, never the text itself."""
    depth = _flow_depth(text)
    if depth > MAX_FLOW_DEPTH:
        raise RosterError(f"{source}: nested more than {MAX_FLOW_DEPTH} levels deep")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RosterError(f"{source}: not valid YAML{yaml_error(exc)}") from None
    except RecursionError:
        raise RosterError(f"{source}: nested too deeply to be a roster") from None
    return parse(doc, source, text)


def yaml_error(exc: Exception) -> str:
    """Where and what, without the snippet of the file YAML parsers add to their messages
    (the file may be a secret the roster path was pointed at by mistake)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or ""
    return where + (f": {_QUOTED.sub(_keep_short, problem)}" if problem else "")


def _keep_short(match: re.Match[str]) -> str:
    """A quoted token name (``'<scalar>'``) or a single character stays; longer quoted text
    came from the file."""
    inner = match.group(0)[1:-1]
    return match.group(0) if len(inner) <= 2 or re.fullmatch(r"<[\w ]+>", inner) else "'...'"


def _flow_depth(text: str) -> int:
    """An upper bound of the flow-collection nesting (brackets in strings and comments
    counted too): PyYAML's scanner costs quadratic time in it, 3 s at 50,000 levels."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}" and depth:
            depth -= 1
    return deepest


def _key_lines(text: str | None) -> dict[str, int]:
    """The line of each top-level key of ``text``."""
    if text is None:
        return {}
    with contextlib.suppress(yaml.YAMLError, RecursionError):
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if isinstance(node, yaml.MappingNode):
            return {str(k.value): k.start_mark.line + 1 for k, _ in node.value}
    return {}


def _foreign_keys(keys: list[Any], text: str | None) -> str:
    """A roster's misspelt keys, named."""
    lines = _key_lines(text)
    named = [f"{str(k)[:40]!r}" + (f" (line {lines[str(k)]})" if str(k) in lines else "")
             for k in keys[:5]]
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return f"unknown top-level key{'s' if len(keys) > 1 else ''} {', '.join(named)}{more}"


def _other_file(keys: list[Any], text: str | None) -> str:
    """Some other file: where its keys are, and which look like a misspelt roster key (ours
    named, never theirs)."""
    lines = _key_lines(text)
    found = [lines[str(k)] for k in keys[:5] if str(k) in lines]
    where = f" (line{'s' if len(found) > 1 else ''} {', '.join(map(str, found))}" \
        f"{', ...' if len(keys) > 5 else ''})" if found else ""
    hints = [f"line {lines[str(k)]} looks like {close[0]!r}" for k in keys[:5]
             if str(k) in lines and len(str(k)) <= 2 * max(map(len, TOP_LEVEL_KEYS))
             and (close := difflib.get_close_matches(str(k), TOP_LEVEL_KEYS, 1, 0.75))]
    keys_are = f"its {len(keys)} top-level keys{where} are" if len(keys) > 1 \
        else f"its top-level key{where} is"
    return (f"{keys_are} not a roster's (not shown: the file may be something else)"
            + (f"; {', '.join(hints)}" if hints else ""))


def admin_write_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the admin API could not replace the roster file at ``path``, or None if it can.

    It replaces the file the path resolves to (a symlink keeps its link) by writing a new
    file beside it, so that file's directory must be writable: a read-only mount (a
    Kubernetes ConfigMap) is not.
    """
    folder = os.path.dirname(os.path.realpath(path))
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"its directory {folder} is not writable (a read-only mount?)"
    return None


def roster_path(environ: dict[str, str] | None = None) -> str:
    return declared.read("EPD_ROSTER", environ)


def _describe(error: Any, doc: dict[str, Any]) -> str:
    loc = list(error.get("loc", ()))
    where = ".".join(str(p) for p in loc) or "roster"
    if len(loc) >= 2 and loc[0] == "instances" and isinstance(loc[1], int):
        where = f"instances[{loc[1]}]"
        instances = doc.get("instances")
        if isinstance(instances, list) and loc[1] < len(instances):
            entry = instances[loc[1]]
            if isinstance(entry, dict) and entry.get("url"):
                where += f" ({entry['url']})"
        field = ".".join(str(p) for p in loc[2:])
        if field:
            where += f" field {field!r}"
    elif loc and loc[0] == "settings" and len(loc) > 1:
        where = f"settings field {'.'.join(str(p) for p in loc[1:])!r}"
    elif loc and loc[0] == "discovery" and len(loc) > 1:
        where = "discovery." + ".".join(str(p) for p in loc[1:])
        if len(loc) > 2 and loc[1] == "dns" and isinstance(loc[2], int):
            where = f"discovery.dns[{loc[2]}]" + "".join(f".{p}" for p in loc[3:])
    elif loc and loc[0] == "tenants" and len(loc) > 1:
        where = f"tenants.{loc[1]}" + (f" field {'.'.join(str(p) for p in loc[2:])!r}"
                                       if len(loc) > 2 else "")
    return f"{where}: {_message(error)}"


def _message(error: Any) -> str:
    if error.get("type") == "extra_forbidden":
        return "unknown key (check the spelling; unknown keys are not ignored)"
    return str(error.get("msg", "invalid"))


def main(argv: Iterable[str] | None = None) -> int:
    """Validate roster files for CI pipelines and before a reload; exit 0 when all are good."""
    args = list(sys.argv[1:] if argv is None else argv) or [roster_path()]
    status = 0
    for path in args:
        try:
            roster = load(path)
        except RosterError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
            continue
        counts = Counter(i.role for i in roster.instances)
        summary = ", ".join(f"{counts[r]} {r}" for r in ROLES if counts[r]) or "no instances"
        print(f"ok: {path}: {summary}; connector {roster.settings.connector}")
    return status


if __name__ == "__main__":
    sys.exit(main())
