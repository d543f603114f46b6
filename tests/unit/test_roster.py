"""Roster validation: errors an operator can act on, and the check command's exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_flask.control.roster import RosterError, load, main, parse

GOOD = {
    "settings": {"connector": "nixl", "decode_retries": 2},
    "instances": [
        {"role": "prefill", "url": "http://127.0.0.1:8100/"},
        {"role": "decode", "url": "http://127.0.0.1:8200", "dp_size": 2},
    ],
}


def test_good_roster_normalises_urls_and_keeps_settings() -> None:
    roster = parse(GOOD)
    assert [i.url for i in roster.instances] == ["http://127.0.0.1:8100", "http://127.0.0.1:8200"]
    assert roster.settings.decode_retries == 2
    assert roster.by_role("decode")[0].dp_size == 2
    assert not roster.combined


def test_defaults_are_sane() -> None:
    roster = parse({"instances": [{"role": "prefill_decode", "url": "http://h:1"}]})
    assert roster.settings.connector == "nixl"
    assert roster.settings.decode_retries == 1
    assert roster.combined


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"instances": [{"role": "decoder", "url": "http://h:1"}]},
         ["instances[0] (http://h:1)", "'role'"]),
        ({"instances": [{"role": "decode", "url": "ftp://h:1"}]}, ["instances[0]", "http://"]),
        ({"instances": [{"role": "decode", "url": "http://h:1", "dp_size": 0}]},
         ["instances[0] (http://h:1)", "'dp_size'"]),
        ({"instances": [{"role": "decode", "url": "http://h:1", "dp_sise": 2}]},
         ["'dp_sise'", "unknown key"]),
        ({"settings": {"conector": "nixl"}, "instances": []}, ["conector", "unknown key"]),
        ({"settings": {"connector": "carrier"}}, ["settings field 'connector'"]),
        ({"instances": [{"role": "decode", "url": "http://h:1"},
                        {"role": "prefill", "url": "http://h:1/"}]},
         ["http://h:1", "more than once"]),
        ({"instances": [{"role": "prefill_decode", "url": "http://a:1"},
                        {"role": "decode", "url": "http://b:1"}]}, ["cannot be mixed"]),
        ({"instances": [{"role": "decode", "url": "http://a:1", "dp_size": 2,
                         "ec_zmq_addrs": ["tcp://a:1"]}]}, ["one address per", "dp_size is 2"]),
        (["not", "a", "mapping"], ["top level must be a mapping"]),
    ],
)
def test_bad_rosters_name_the_problem(doc: object, words: list[str]) -> None:
    with pytest.raises(RosterError) as info:
        parse(doc, "etc/roster.yaml")
    message = str(info.value)
    assert message.startswith("etc/roster.yaml: ")
    for word in words:
        assert word in message


def test_load_reports_yaml_and_io_errors(tmp_path: Path) -> None:
    bad = tmp_path / "r.yaml"
    bad.write_text("instances: [\n")
    with pytest.raises(RosterError, match="not valid YAML"):
        load(bad)
    with pytest.raises(RosterError, match="cannot read"):
        load(tmp_path / "missing.yaml")


def test_shipped_roster_is_valid() -> None:
    roster = load(Path(__file__).resolve().parents[2] / "etc" / "roster.yaml")
    assert {i.role for i in roster.instances} == {"prefill", "decode"}


def test_check_command_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("instances:\n  - {role: decode, url: 'http://127.0.0.1:1'}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("instances:\n  - {role: decode, url: 'http://127.0.0.1:1', typo: 1}\n")
    assert main([str(good)]) == 0
    assert "ok:" in capsys.readouterr().out
    assert main([str(good), str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "typo" in err
