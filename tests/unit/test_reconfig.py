"""Live reconfiguration without a server: the roster file editor, the state directory, health
carried across workers, the master's reload hook and where workers boot from."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from epd_flask.control import reload
from epd_flask.control.roster import (
    Instance,
    RoleConflict,
    Roster,
    RosterError,
    load,
    parse,
    parse_instance,
)
from epd_flask.control.rosterfile import RosterFileError, register, unregister
from epd_flask.control.statedir import STATE_DIR_ENV, StateDir, atomic_write, merge_health
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.policies import RouteRequest
from epd_flask.fleet.registry import Registry
from epd_flask.fleet.routing import Router

COMMENTED = """\
# Fleet of the tests. Keep this comment.
settings:
  probe_interval: 5      # seconds
instances:
  - {role: prefill, url: "http://127.0.0.1:8100"}   # the prefill
  - {role: decode,  url: "http://127.0.0.1:8200"}
"""


def decode(port: int, **fields: Any) -> Instance:
    return Instance(role="decode", url=f"http://127.0.0.1:{port}", **fields)


# -- parse_instance: the admin API validates like the file --------------------------------

@pytest.mark.parametrize(("doc", "words"), [
    ({"role": "decoder", "url": "http://h:1"}, ["'role'"]),
    ({"role": "decode"}, ["'url'", "required"]),
    ({"role": "decode", "url": "ftp://h:1"}, ["'url'", "http://"]),
    ({"role": "decode", "url": "http://h:x"}, ["'url'", "port"]),
    ({"role": "decode", "url": "http://h:1", "dp_size": 0}, ["'dp_size'"]),
    ({"role": "decode", "url": "http://h:1", "dp_sise": 2}, ["'dp_sise'", "unknown key"]),
    ({"role": "decode", "url": "http://h:1", "dp_size": 2, "ec_zmq_addrs": ["tcp://a:1"]},
     ["one address per"]),
    (["decode"], ["JSON object"]),
])
def test_instance_records_are_validated_like_roster_entries(doc: Any, words: list[str]) -> None:
    with pytest.raises(RosterError) as info:
        parse_instance(doc)
    assert not isinstance(info.value, RoleConflict)
    for word in words:
        assert word in str(info.value)


def test_role_rules_are_role_conflicts() -> None:
    with pytest.raises(RoleConflict):
        parse({"instances": [{"role": "prefill_decode", "url": "http://a:1"},
                             {"role": "decode", "url": "http://b:1"}]})
    with pytest.raises(RoleConflict):
        parse({"instances": [{"role": "decode", "url": "http://a:1"},
                             {"role": "prefill", "url": "http://a:1/"}]})


# -- the roster file editor ---------------------------------------------------------------

def test_register_keeps_comments_and_validates_like_a_reload(tmp_path: Path) -> None:
    path = tmp_path / "roster.yaml"
    path.write_text(COMMENTED)
    os.chmod(path, 0o640)
    change = register(path, decode(8300, dp_size=2))
    assert change.status == "registered"
    text = path.read_text()
    assert "# Fleet of the tests. Keep this comment." in text
    assert "# the prefill" in text and "# seconds" in text
    assert '{role: decode, url: "http://127.0.0.1:8300", dp_size: 2}' in text
    assert [i.url for i in load(path).instances][-1] == "http://127.0.0.1:8300"
    assert change.roster == load(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["roster.yaml"]  # no temp file left


def test_identical_registration_is_a_no_op_and_a_changed_one_updates(tmp_path: Path) -> None:
    path = tmp_path / "roster.yaml"
    path.write_text(COMMENTED)
    before = path.stat().st_mtime_ns, path.read_text()
    assert register(path, decode(8200)).status == "unchanged"
    assert (path.stat().st_mtime_ns, path.read_text()) == before
    change = register(path, decode(8200, dp_size=4))
    assert change.status == "updated"
    assert load(path).by_role("decode")[0].dp_size == 4
    assert len(load(path).instances) == 2


def test_role_change_and_mixing_are_refused_and_leave_the_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "roster.yaml"
    path.write_text(COMMENTED)
    with pytest.raises(RoleConflict, match="DELETE it first"):
        register(path, Instance(role="prefill", url="http://127.0.0.1:8200"))
    with pytest.raises(RoleConflict, match="never mixed"):
        register(path, Instance(role="prefill_decode", url="http://127.0.0.1:9000"))
    assert path.read_text() == COMMENTED


def test_unregister_and_unknown_urls(tmp_path: Path) -> None:
    path = tmp_path / "roster.yaml"
    path.write_text(COMMENTED)
    with pytest.raises(KeyError):
        unregister(path, "http://127.0.0.1:9999")
    change = unregister(path, "http://127.0.0.1:8200")
    assert change.status == "removed" and change.instance == decode(8200)
    assert [i.role for i in load(path).instances] == ["prefill"]
    assert "# the prefill" in path.read_text()


def test_an_invalid_file_is_not_edited(tmp_path: Path) -> None:
    path = tmp_path / "roster.yaml"
    path.write_text("instances:\n  - {role: decode, url: 'http://h:1', typo: 1}\n")
    with pytest.raises(RosterFileError, match="typo"):
        register(path, decode(8300))
    assert "typo" in path.read_text()


def test_a_symlinked_roster_keeps_its_link(tmp_path: Path) -> None:
    real = tmp_path / "real.yaml"
    real.write_text(COMMENTED)
    link = tmp_path / "roster.yaml"
    link.symlink_to(real)
    register(link, decode(8300))
    assert link.is_symlink()
    assert "8300" in real.read_text()


def test_atomic_write_never_shows_a_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    atomic_write(path, b"old")
    inode = path.stat().st_ino
    atomic_write(path, b"new content")
    assert path.read_bytes() == b"new content"
    assert path.stat().st_ino != inode  # replaced, not rewritten in place


# -- health across workers ----------------------------------------------------------------

def test_health_survives_a_move_to_a_new_registry() -> None:
    old = Registry([decode(1), decode(2), decode(3)], fail_threshold=2, evicted_ttl=100)
    for url in ("http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"):
        old.record_success(url)
    old.record_failure("http://127.0.0.1:2", "refused")
    old.record_failure("http://127.0.0.1:2", "refused")
    old.record_failure("http://127.0.0.1:3", "refused")
    exported = old.export()
    # The new worker's roster lost :1, kept :2 and :3, and added :4.
    new = Registry([decode(2), decode(3), decode(4)], fail_threshold=2, evicted_ttl=100)
    assert sorted(new.restore(exported)) == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    assert [i.url for i in new.live("decode")] == ["http://127.0.0.1:3", "http://127.0.0.1:4"]
    assert new.get("http://127.0.0.1:3").failures == 1
    assert new.get("http://127.0.0.1:4").live and not new.get("http://127.0.0.1:4").confirmed
    # The eviction TTL keeps counting from the original eviction.
    evicted_at = new.get("http://127.0.0.1:2").evicted_at
    assert evicted_at is not None and abs(evicted_at - old.get("http://127.0.0.1:2").evicted_at) < 1


def test_restore_ignores_other_roles_and_older_news() -> None:
    reg = Registry([decode(1)], fail_threshold=1)
    reg.record_success("http://127.0.0.1:1")
    stale = {"http://127.0.0.1:1": {"role": "decode", "live": False, "failures": 5,
                                    "changed_at": 1.0}}
    other = {"http://127.0.0.1:1": {"role": "prefill", "live": False, "failures": 5,
                                    "changed_at": time.time() + 5}}
    assert reg.restore(stale) == [] and reg.restore(other) == []
    assert reg.live("decode")


def test_readiness_counts_only_instances_that_answered() -> None:
    reg = Registry([decode(1), decode(2)])
    assert len(reg.live("decode")) == 2 and reg.confirmed("decode") == []
    reg.record_success("http://127.0.0.1:2")
    assert [i.url for i in reg.confirmed("decode")] == ["http://127.0.0.1:2"]
    assert len(reg.live("decode")) == 2  # routing stays optimistic


def test_passive_failures_evict_at_the_threshold_like_probes() -> None:
    reg = Registry([decode(1), decode(2)], fail_threshold=3)
    for url in ("http://127.0.0.1:1", "http://127.0.0.1:2"):
        reg.record_success(url)
    reg.record_failure("http://127.0.0.1:1", "probe failed")
    reg.record_failure("http://127.0.0.1:1", "connection refused")
    assert len(reg.live("decode")) == 2
    reg.record_failure("http://127.0.0.1:1", "connection refused")
    assert [i.url for i in reg.live("decode")] == ["http://127.0.0.1:2"]


def test_new_workers_start_their_rotation_at_random_places() -> None:
    roster = Roster(instances=tuple(decode(p) for p in range(1, 9)))
    firsts = set()
    for _ in range(40):
        router = Router(LiveFleet(roster))  # no seed, as under gunicorn
        firsts.add(router.pick("decode", RouteRequest(), lambda role, d: None).url)
    # A fixed start would send every new worker's first request to the same instance.
    assert len(firsts) > 1


def test_state_dir_publishes_generations_and_merges_health(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    state.ensure()
    roster = parse({"instances": [{"role": "decode", "url": "http://h:1"}]})
    assert state.published() is None and state.signature() is None
    with state.lock():
        assert state.publish(roster, "test") == 1
        assert state.publish(roster, "test again") == 2
    published = state.published()
    assert published is not None and published.generation == 2 and published.roster == roster
    state.write_health(os.getpid(), {"http://h:1": {"role": "decode", "live": True,
                                                    "changed_at": 10.0}})
    state.write_health(1 << 22, {"http://h:1": {"role": "decode", "live": False,
                                                "changed_at": 20.0}})
    assert state.read_health()["http://h:1"]["live"] is False  # the newer observation
    state.prune_health(os.getpid())  # pid 1<<22 is not running
    assert sorted(p.name for p in tmp_path.glob("health-*")) == [f"health-{os.getpid()}.json"]


def test_an_eviction_outranks_a_newer_failure_below_the_threshold() -> None:
    evicted = {"role": "decode", "live": False, "failures": 3, "changed_at": 20.0}
    failing = {"role": "decode", "live": True, "failures": 1, "changed_at": 30.0}
    rejoined = {"role": "decode", "live": True, "failures": 0, "changed_at": 25.0}
    assert merge_health([failing, evicted]) is evicted
    assert merge_health([evicted, failing]) is evicted
    # An answer seen after the eviction undoes it, and a later failure does not bring it back.
    assert merge_health([evicted, rejoined, failing]) is failing
    assert merge_health([evicted, {**rejoined, "changed_at": 40.0}]) is not evicted
    assert merge_health([failing, {**failing, "failures": "x"}]) is not None


def test_the_lock_excludes_other_holders(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    with state.lock(), pytest.raises(TimeoutError), state.lock(timeout=0.05):
        pass


FORK_WHILE_LOCKED = """
import os, sys, threading, time
from epd_flask.control.statedir import StateDir

state = StateDir(sys.argv[1])
held, forked = threading.Event(), threading.Event()

def writer():  # the master's reload thread, publishing
    with state.lock():
        held.set()
        forked.wait(10)

t = threading.Thread(target=writer)
t.start()
held.wait(10)
child = os.fork()  # gunicorn's main thread spawning a worker meanwhile
if child == 0:
    time.sleep(3)  # a worker lives on
    os._exit(0)
forked.set()
t.join()
try:
    with state.lock(timeout=1):
        print("free")
except TimeoutError as exc:
    print(exc)
os.kill(child, 9)
os.waitpid(child, 0)
"""


def test_a_process_forked_while_the_lock_is_held_does_not_keep_it(tmp_path: Path) -> None:
    """The holder releases the lock when it is done, whatever it forked meanwhile (run in a
    plain interpreter: this process is patched by gevent)."""
    done = subprocess.run([sys.executable, "-c", FORK_WHILE_LOCKED, str(tmp_path)],
                          capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "free"


# -- the master's hooks and the worker's boot ---------------------------------------------

class FakeArbiter:
    """What the hooks use of gunicorn's arbiter: a logger and attributes."""

    def __init__(self) -> None:
        self.log = logging.getLogger("test.master")


@pytest.fixture
def master(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    path = tmp_path / "roster.yaml"
    path.write_text(COMMENTED)
    monkeypatch.setenv("EPD_ROSTER", str(path))
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    monkeypatch.setattr(reload, "_inherited", None)
    server = FakeArbiter()
    reloader = reload.start(server)
    yield reloader, path
    reloader.cleanup()


def test_master_publishes_a_good_roster_and_keeps_it_on_a_bad_edit(
        master: Any, caplog: pytest.LogCaptureFixture) -> None:
    reloader, path = master
    state = StateDir.from_env()
    assert state is not None and state.published().generation == 1
    assert reload.of(reloader.server) is reloader and reloader.state.path == state.path
    path.write_text(COMMENTED + '  - {role: decode, url: "http://127.0.0.1:8300"}\n')
    reloader.refresh()
    assert state.published().generation == 2
    assert len(state.published().roster.instances) == 3
    reloader.refresh()  # nothing changed: no new generation
    assert state.published().generation == 2
    path.write_text("instances: [{role: decode, url: 'http://h:1', dp_sise: 2}]\n")
    with caplog.at_level(logging.ERROR, logger="test.master"):
        reloader.refresh()
    assert "REJECTED" in caplog.text and "dp_sise" in caplog.text
    assert state.published().generation == 2
    reload.inherit(reloader.server)  # a worker forked now
    roster, generation = reload.boot_roster(str(path), state)
    assert generation == 2 and len(roster.instances) == 3
    path.write_text("instances: [\n")
    reloader.refresh()  # broken YAML: rejected too, never raised
    assert "not valid YAML" in caplog.text
    # Every pass is counted where the workers' /metrics reads it (the start is not a reload).
    assert state.reloads() == {"sighup/ok": 2, "sighup/rejected": 2}


def test_a_new_master_counts_reloads_from_zero(master: Any) -> None:
    reloader, _ = master
    state = StateDir.from_env()
    assert state is not None
    reloader.refresh()
    assert state.reloads() == {"sighup/ok": 1}
    reload.start(FakeArbiter())
    assert state.reloads() == {}


def test_workers_boot_from_the_master_copy_when_the_state_dir_is_gone(master: Any) -> None:
    reloader, path = master
    reload.inherit(reloader.server)  # what post_fork does in a new worker
    state = StateDir.from_env()
    path.write_text("garbage: [")  # a worker must never read this
    (state.path / "roster.json").unlink()
    roster, generation = reload.boot_roster(str(path), state)
    assert generation == 1 and len(roster.instances) == 2


def test_a_bad_roster_stops_start_up_with_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "roster.yaml"
    path.write_text("instances: [{role: decoder, url: 'http://h:1'}]\n")
    monkeypatch.setenv("EPD_ROSTER", str(path))
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "state"))
    with pytest.raises(RuntimeError, match=r"cannot start.*'role'"):
        reload.start(FakeArbiter())


def test_no_master_means_the_file_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reload, "_inherited", None)
    path = tmp_path / "roster.yaml"
    path.write_text(yaml.safe_dump({"instances": [{"role": "decode", "url": "http://h:1"}]}))
    roster, generation = reload.boot_roster(str(path), None)
    assert generation == 0 and roster.instances[0].url == "http://h:1"
