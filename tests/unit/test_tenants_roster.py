"""The roster's admission contract (docs/behaviour.md#admission): ``settings.admission``,
``tenants``, an instance's ``max_concurrency`` and the API keys file's tenants, checked where
the master checks rosters."""

from __future__ import annotations

import pytest

from epd_flask.control.config import ProxyConfig
from epd_flask.control.roster import RosterError, parse, parse_text
from epd_flask.web.edge import KeyRing

CONTRACT = """
settings:
  admission:
    queue_timeout: 30
    max_queue: 1000
    tenant_header: X-Tenant
    store: redis://127.0.0.1:6379/0
    forward_priority: false
tenants:
  default: {weight: 1}
  chat:  {weight: 4, priority: high}
  batch: {weight: 1, priority: low, requests_per_minute: 600, tokens_per_minute: 2000000}
instances:
  - {role: decode, url: "http://10.0.0.7:8000", max_concurrency: 64}
  - {role: prefill, url: "http://10.0.0.8:8000"}
"""


def test_the_documented_roster_is_read_as_written() -> None:
    roster = parse_text(CONTRACT, "roster.yaml")
    admission = roster.settings.admission
    assert (admission.queue_timeout, admission.max_queue, admission.tenant_header,
            admission.store, admission.forward_priority, admission.share_by) == \
        (30, 1000, "X-Tenant", "redis://127.0.0.1:6379/0", False, "requests")
    assert roster.tenants["chat"].priority == "high" and roster.tenants["chat"].weight == 4
    assert roster.tenants["batch"].tokens_per_minute == 2_000_000
    assert roster.instances[0].max_concurrency == 64 and roster.admission
    assert roster.tenant("unknown") is roster.tenants["default"]


def test_without_any_of_it_admission_is_off() -> None:
    roster = parse({"instances": [{"role": "decode", "url": "http://10.0.0.7:8000"}]})
    assert roster.settings.admission is None and not roster.tenants and not roster.admission
    assert roster.tenant("anyone").weight == 1 and not roster.tenant("anyone").limited


@pytest.mark.parametrize("field", [
    {"settings": {"admission": {}}},
    {"tenants": {"chat": {}}},
    {"instances": [{"role": "decode", "url": "http://10.0.0.7:8000", "max_concurrency": 1}]},
])
def test_any_of_the_three_turns_it_on(field) -> None:
    assert parse(field).admission


@pytest.mark.parametrize(("doc", "words"), [
    ({"tenants": {"a b": {}}}, "tenants: Value error, tenant name 'a b' must be 1 to 64"),
    ({"tenants": {"x" * 65: {}}}, "must be 1 to 64 letters"),
    ({"tenants": {"x": {"priority": "urgent"}}},
     "tenants.x field 'priority': Input should be 'high', 'normal' or 'low'"),
    ({"tenants": {"x": {"weight": 0}}}, "tenants.x field 'weight': Input should be greater than 0"),
    ({"tenants": {"x": {"requests_per_minute": 0}}}, "field 'requests_per_minute'"),
    ({"tenants": {"x": {"burst": 3}}}, "tenants.x field 'burst': unknown key"),
    ({"tenants": {f"t{n}": {} for n in range(257)}}, "names 257 tenants, more than 256"),
    ({"settings": {"admission": {"store": "http://10.0.0.1:6379"}}},
     "settings field 'admission.store': Value error, must be a redis://, rediss://, unix://"),
    ({"settings": {"admission": {"store": "redis://:6379"}}}, "must name the Redis host"),
    ({"settings": {"admission": {"queue_timeut": 3}}},
     "settings field 'admission.queue_timeut': unknown key"),
    ({"settings": {"admission": {"share_by": "bytes"}}}, "'requests' or 'tokens'"),
    ({"instances": [{"role": "encode", "url": "http://10.0.0.1:1", "max_concurrency": 3}]},
     "instance http://10.0.0.1:1 (encode): max_concurrency bounds"),
    ({"instances": [{"role": "decode", "url": "http://10.0.0.1:1", "max_concurrency": 0}]},
     "field 'max_concurrency': Input should be greater than or equal to 1"),
])
def test_a_bad_admission_roster_is_refused_naming_the_field(doc, words) -> None:
    with pytest.raises(RosterError) as err:
        parse(doc, "roster.yaml")
    assert words in str(err.value)
    assert str(err.value).startswith("roster.yaml: ")


def test_a_key_file_line_may_name_the_keys_tenant(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# the serving keys\nsk-open\nsk-chat-1 chat\n  sk-batch batch  \n")
    config = ProxyConfig(api_keys_file=str(keys))
    assert config.api_keys == ("sk-open", "sk-chat-1", "sk-batch")
    assert dict(config.key_tenants) == {"sk-chat-1": "chat", "sk-batch": "batch"}
    ring = KeyRing(config.api_keys, config.key_tenants)
    assert ring.check("Bearer sk-chat-1") == "chat"
    assert ring.check("Bearer sk-open") is None


@pytest.mark.parametrize("line", ["sk-1 chat extra", "sk-1 bad/tenant"])
def test_a_bad_key_file_line_is_refused_without_quoting_it(tmp_path, line) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"sk-0\n{line}\n")
    with pytest.raises(ValueError) as err:
        ProxyConfig(api_keys_file=str(keys))
    assert "line 2" in str(err.value) and "sk-1" not in str(err.value)
