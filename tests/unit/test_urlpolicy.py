"""Which instance URLs may be registered (SSRF guard), with resolution faked per test."""

from __future__ import annotations

import pytest

from epd_flask.control.urlpolicy import URLPolicy, URLPolicyError, check_instance_url

OPEN = URLPolicy.build(("http", "https"), ())
PRIVATE = URLPolicy.build(("http", "https"), ("10.0.0.0/8", "127.0.0.1/32", "fd00::/8"))


def resolver(table: dict[str, list[str]]):
    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError("Name or service not known")
        return table[host]
    return resolve


DNS = resolver({"decode-0.svc": ["10.1.2.3"], "split.example": ["10.1.2.3", "203.0.113.9"],
                "metadata.example": ["169.254.169.254"]})


@pytest.mark.parametrize(("url", "policy"), [
    ("http://10.1.2.3:8000", PRIVATE),
    ("https://decode-0.svc:8443", PRIVATE),
    ("http://127.0.0.1:8200", PRIVATE),
    ("http://[fd00::5]:8000", PRIVATE),
    ("http://203.0.113.9:8000", OPEN),
    ("http://decode-0.svc", OPEN),
])
def test_allowed(url: str, policy: URLPolicy) -> None:
    check_instance_url(url, policy, DNS)


@pytest.mark.parametrize(("url", "policy", "words"), [
    ("file:///etc/passwd", OPEN, "scheme 'file'"),
    ("gopher://10.1.2.3:70", OPEN, "scheme 'gopher'"),
    ("http://10.1.2.3:8000", URLPolicy.build(("https",), ()), "scheme 'http'"),
    ("http://203.0.113.9:8000", PRIVATE, "outside the networks"),
    ("http://split.example:8000", PRIVATE, "outside the networks"),
    ("http://169.254.169.254/latest", OPEN, "link-local"),
    ("http://metadata.example/", OPEN, "link-local"),
    ("http://[::ffff:169.254.169.254]/", OPEN, "link-local"),
    ("http://0.0.0.0:8000", OPEN, "unspecified"),
    ("http://user:pw@10.1.2.3:8000", OPEN, "credentials"),
    ("http://10.1.2.3:8000/?x=1", OPEN, "query"),
    ("http://nowhere.invalid:8000", OPEN, "does not resolve"),
    ("http://10.1.2.3:99999", OPEN, "not a valid URL"),
    ("http:///v1", OPEN, "no host"),
])
def test_refused(url: str, policy: URLPolicy, words: str) -> None:
    with pytest.raises(URLPolicyError) as info:
        check_instance_url(url, policy, DNS)
    assert words in str(info.value)


def test_an_allowed_network_may_include_link_local_on_purpose() -> None:
    policy = URLPolicy.build(("http",), ("169.254.10.0/24",))
    check_instance_url("http://169.254.10.7:8000", policy, DNS)


@pytest.mark.parametrize(("schemes", "networks"), [(("ftp",), ()), (("http",), ("10.0.0.0/33",))])
def test_bad_policy_settings_are_refused(schemes, networks) -> None:
    with pytest.raises(ValueError):
        URLPolicy.build(schemes, networks)
