"""How the vLLM tier stops its servers (tests/vllm/fleet.py), with real process groups and no
vLLM: whatever in a group outlives SIGTERM by its grace is killed and reaped, stopping never
raises, and a topology holding such a server is stopped whole and no longer marked running."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from tests.helpers import eventually
from tests.vllm import fleet
from tests.vllm.reap import group_alive

GRACE = 0.5
#: A group leader with one child in its group (as vLLM's API server has its EngineCore and
#: worker); argv says which of the two ignores SIGTERM. Both print once their handler is set.
LEADER = """
import signal, subprocess, sys, time
leader_ignores, member_ignores = sys.argv[1] == "1", sys.argv[2] == "1"
member = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN if %s else "
          "signal.SIG_DFL); print('member ready', flush=True); time.sleep(300)" % member_ignores)
subprocess.Popen([sys.executable, "-c", member])
if leader_ignores:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("leader ready", flush=True)
time.sleep(300)
"""


@pytest.fixture(autouse=True)
def tier_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet, "LOG_DIR", tmp_path / "logs")
    monkeypatch.setattr(fleet, "RUN_DIR", tmp_path / "run")
    monkeypatch.setattr(fleet, "STOP_GRACE_SECONDS", GRACE)


def started(name: str, leader_ignores: bool, member_ignores: bool) -> fleet.Process:
    process = fleet.Process(name, [sys.executable, "-c", LEADER, str(int(leader_ignores)),
                                   str(int(member_ignores))], {}, "http://127.0.0.1:9")
    eventually(lambda: process.log_text().count("ready") == 2, 30,
               what=lambda: f"{name} setting its handlers: {process.tail()}")
    return process


@pytest.mark.parametrize(("leader_ignores", "member_ignores"), [(True, True), (False, True)],
                         ids=["leader-ignores", "only-its-child-ignores"])
def test_a_group_that_outlives_sigterm_is_killed_and_reaped(leader_ignores: bool,
                                                            member_ignores: bool) -> None:
    server = started("stubborn", leader_ignores, member_ignores)

    note = server.stop(grace=GRACE)

    assert note is not None and note.startswith("stubborn: outlived SIGTERM"), note
    assert note.endswith("killed")
    assert not group_alive(server.proc.pid)
    expected = -signal.SIGKILL if leader_ignores else -signal.SIGTERM
    assert server.proc.returncode == expected
    assert not server.pid_file.exists()


def test_a_group_that_ends_on_sigterm_stops_without_a_note() -> None:
    server = started("polite", False, False)

    assert server.stop(grace=30) is None
    assert server.proc.returncode == -signal.SIGTERM
    assert not group_alive(server.proc.pid)
    assert not server.pid_file.exists()


def test_stopping_a_topology_with_a_stubborn_server_stops_every_server() -> None:
    """The stubborn server comes first, so the others are stopped after it gave up waiting."""
    stubborn, polite = started("encode", True, True), started("decode", False, False)
    tier = fleet.Fleet()
    tier.current = fleet.Topology("ec", [fleet.VllmServer(stubborn, "encode"),
                                         fleet.VllmServer(polite, "decode")], started_in=0.0)

    tier.down()

    assert tier.current is None
    assert not group_alive(stubborn.proc.pid) and not group_alive(polite.proc.pid)
    assert [note.split(":")[0] for note in tier.stop_notes] == ["encode"], tier.stop_notes
    assert list(fleet.RUN_DIR.glob("*.pid")) == []
