"""Which registrations the admin API accepts, over real HTTP: the table of addresses an
operator could send, each accepted or refused, and why (printed with ``-s``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from epd_flask.control.urlpolicy import URLPolicy, URLPolicyError, check_instance_url
from tests.rosters import roster

KEY = "s3cret-admin"
LOOP = "__proxy_port__"

#: (field, value, accepted): every spelling of link-local refused, loopback kept except the
#: proxy's own port, transfer addresses held to the same rules, no control characters.
TABLE: list[tuple[str, str, bool]] = [
    ("url", "http://127.0.0.1:18001", True),
    ("url", "http://localhost:18002", True),
    ("url", "http://[::1]:18003", True),
    ("url", "http://10.0.0.5:18004", True),
    ("url", f"http://127.0.0.1:{LOOP}", False),
    ("url", f"http://localhost:{LOOP}/v1", False),
    ("url", f"http://[::ffff:127.0.0.1]:{LOOP}", False),
    ("url", "http://169.254.169.254", False),
    ("url", "http://[::169.254.169.254]", False),
    ("url", "http://[::ffff:169.254.169.254]", False),
    ("url", "http://[::ffff:a9fe:a9fe]", False),
    ("url", "http://[64:ff9b::a9fe:a9fe]", False),
    ("url", "http://[64:ff9b::169.254.169.254]", False),
    ("url", "http://[2002:a9fe:a9fe::1]", False),
    ("url", "http://[fe80::1]:8000", False),
    ("url", "http://[fe80::1%25eth0]:8000", False),
    ("url", "http://2852039166/", False),
    ("url", "http://0xa9fea9fe/", False),
    ("url", "http://169.254.43518/", False),
    ("url", "http://0.0.0.0:8000", False),
    ("url", "http://[::]:8000", False),
    ("url", "http://10.0.0.5:8000/v1\r\nX-Injected: 1", False),
    ("url", "http://10.0.0.5:8000/a\tb", False),
    ("bootstrap_url", "http://10.0.0.6:8998", True),
    ("bootstrap_url", "http://169.254.169.254:8998", False),
    ("bootstrap_url", f"http://127.0.0.1:{LOOP}", False),
    ("kv_zmq_addr", "10.0.0.2:22001", True),
    ("kv_zmq_addr", "tcp://127.0.0.1:22002", True),
    ("kv_zmq_addr", "169.254.169.254:22001", False),
    ("kv_zmq_addr", "[64:ff9b::a9fe:a9fe]:22001", False),
    ("kv_zmq_addr", f"127.0.0.1:{LOOP}", False),
    ("kv_zmq_addr", "10.0.0.2:22001\r\nX-Injected: 1", False),
    ("kv_zmq_addr", "http://10.0.0.2:22001", False),
    ("kv_zmq_addr", "10.0.0.2", False),
]


@pytest.fixture
def admin(sim, proxy, tmp_path: Path) -> Any:
    p, d = sim("prefill"), sim("decode")
    doc = roster([p], [d])
    path = tmp_path / "roster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return proxy(doc, roster_path=str(path), admin_api_key=KEY), path


def test_registration_table(admin) -> None:
    px, path = admin
    port = px.url.rsplit(":", 1)[1]
    rows, wrong = [], []
    for n, (field, value, accepted) in enumerate(TABLE):
        value = value.replace(LOOP, port)
        record = {"role": "decode", "url": f"http://10.9.0.{n + 1}:8000", field: value}
        r = requests.post(px.url + "/instances", json=record, headers={"X-API-Key": KEY},
                          timeout=10)
        got = r.status_code in (200, 201)
        reason = "" if got else r.json()["error"]["message"]
        rows.append(f"{field:14} {value!r:48} {'accepted' if got else 'refused '} "
                    f"{r.status_code} {reason[:90]}")
        if got != accepted or (not got and r.status_code != 422):
            wrong.append(rows[-1])
    print("\nregistration table:\n" + "\n".join(rows))
    assert not wrong, "\n".join(wrong)
    on_file = yaml.safe_load(path.read_text())["instances"]
    assert len(on_file) == 2 + sum(accepted for _, _, accepted in TABLE)


@pytest.mark.parametrize(("url", "refused"), [
    ("http://10.0.0.7:8000", True),      # one of this host's addresses, the proxy's port
    ("http://127.0.0.1:8000", True),
    ("http://[::1]:8000", True),
    ("http://10.0.0.7:8001", False),     # another port on this host: a co-located vLLM
    ("http://10.0.0.8:8000", False),     # the same port elsewhere
])
def test_a_proxy_listening_on_every_address_refuses_each_of_its_own(url, refused) -> None:
    policy = URLPolicy(own=(("0.0.0.0", 8000),))
    mine = {"10.0.0.7", "127.0.0.1", "::1"}
    check = lambda: check_instance_url(url, policy, local=lambda a: str(a) in mine)  # noqa: E731
    if refused:
        with pytest.raises(URLPolicyError, match="this proxy itself"):
            check()
    else:
        check()
