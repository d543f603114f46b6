"""Roster reloads as the gunicorn master sees them, and the roster a worker boots from.

The master reads and validates the roster at start and on every SIGHUP, keeps the last good
copy and publishes it to the state directory; a roster that fails validation is logged and
ignored, so a bad edit can neither stop the master nor make new workers fail to boot (which
would make gunicorn halt). That state is one ``Reloader`` per master, kept on gunicorn's
arbiter. Workers boot from the newest validated copy (published, or the one inherited through
fork) and never read an unvalidated file when a master prepared one.
Imported by the master: light (no ssl, no gevent, no sockets).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from epd_flask.control import settings
from epd_flask.control.roster import (
    Roster,
    RosterError,
    admin_write_problem,
    load,
    roster_path,
)
from epd_flask.control.statedir import STATE_DIR_ENV, StateDir

STATE_DIR_PREFIX = "epd-flask-"
#: The reload tally's source label for what the master does on SIGHUP.
SIGHUP = "sighup"


@dataclass(frozen=True)
class Handoff:
    """What the master validated last; a forked worker inherits it (``inherit``)."""

    roster: Roster
    generation: int
    path: str


#: The attribute of gunicorn's arbiter that holds its ``Reloader``: the arbiter lives as long
#: as the master, while gunicorn executes its configuration file afresh on every SIGHUP.
ATTRIBUTE = "epd_reloader"
#: In a worker, the roster its master had validated when it forked it (``inherit``); None
#: in the master and outside gunicorn.
_inherited: Handoff | None = None


class Reloader:
    """The gunicorn master's roster: the last validated copy (``handoff``), when the file was
    last read, and the thread the SIGHUP handler wakes. One per master, made by ``start``."""

    def __init__(self, server: Any, state: StateDir, owns_state_dir: bool) -> None:
        self.server = server
        self.state = state
        #: The master made the state directory itself, so it removes it on exit.
        self.owns_state_dir = owns_state_dir
        self.handoff: Handoff | None = None
        self._last_read: tuple[int, int, int] | None = None
        #: When the last refresh started reading, and when the last SIGHUP arrived
        #: (monotonic): a refresh that started after the signal already saw what the
        #: signal asked for.
        self._read_at = -1.0
        self._hup_at = 0.0
        #: One refresh at a time: the reload thread's, or gunicorn's on_reload in the main
        #: thread.
        self._lock = threading.Lock()
        #: The SIGHUP handler writes a byte here, the reload thread reads it (a pipe, not an
        #: Event: a handler that takes a lock can deadlock against itself when two signals
        #: arrive at once).
        self._wake: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    def install_hup_handler(self) -> None:
        """``when_ready``: re-read the roster the moment SIGHUP arrives, ahead of gunicorn.

        gunicorn queues signals and handles them one by one in its main loop, and its reload
        waits there until the old workers have finished their streams (up to
        graceful_timeout, minutes for long generations, and as long as an idle keep-alive
        connection from nginx stays open). A second edit + SIGHUP in that window would wait
        too. So this handler, run when the signal arrives, wakes a thread of the master that
        validates and publishes the roster, and running workers follow within
        SYNC_INTERVAL; gunicorn's queued reload still happens later and finds the work done.
        The handler itself only writes a byte to a pipe and chains to gunicorn's: parsing a
        roster inside a signal handler would hold the master wherever the signal interrupted
        it (seconds for a large file). SIGHUPs that arrive while a refresh runs fold into one
        more pass.
        """
        previous = signal.getsignal(signal.SIGHUP)
        if getattr(previous, "epd_early_reload", False):
            return
        master_pid = os.getpid()
        if self._thread is None or not self._thread.is_alive():
            self._wake = os.pipe()
            os.set_blocking(self._wake[1], False)
            self._thread = threading.Thread(target=self._reload_loop, args=(self._wake[0],),
                                            daemon=True, name="epd-roster-reload")
            self._thread.start()
        wake = self._wake

        def on_hup(signum: int, frame: Any) -> None:
            if os.getpid() == master_pid and wake is not None:
                self._hup_at = time.monotonic()
                with contextlib.suppress(OSError):  # full pipe: a refresh is pending anyway
                    os.write(wake[1], b"!")
            if callable(previous):
                previous(signum, frame)

        on_hup.epd_early_reload = True  # type: ignore[attr-defined]
        signal.signal(signal.SIGHUP, on_hup)

    def _reload_loop(self, wake: int) -> None:
        while os.read(wake, 4096):  # every SIGHUP that arrived meanwhile, in one pass
            with contextlib.suppress(Exception), self._lock:
                # gunicorn's on_reload may have got there first (same file, read after the
                # signal): reading it again would only log the same rejection twice.
                if self._read_at < self._hup_at \
                        or _file_signature(roster_path()) != self._last_read:
                    self._refresh_once()

    def on_reload(self) -> None:
        """gunicorn's ``on_reload``: the reload thread normally did the work already (waited
        for here, so new workers start from its result); re-read only a file that changed
        since (or when the handler is not installed)."""
        with self._lock:
            if self._last_read is not None \
                    and _file_signature(roster_path()) == self._last_read:
                return
            self._refresh_once()

    def refresh(self) -> None:
        """Adopt a valid roster, keep the last good one otherwise; never raises (an exception
        escaping a master hook would exit the master)."""
        with self._lock:
            self._refresh_once()

    def _refresh_once(self) -> None:
        server, state = self.server, self.state
        path = roster_path()
        self._read_at = time.monotonic()
        self._last_read = _file_signature(path)
        try:
            roster = load(path)
        except RosterError as exc:
            last = self.handoff
            server.log.error(
                "roster reload REJECTED, still serving the last good roster%s: %s",
                f" (generation {last.generation}, {_summary(last.roster)})" if last else "",
                exc)
            self._count("rejected")
            return
        except Exception:
            server.log.exception("roster reload failed; still serving the last good roster")
            self._count("rejected")
            return
        generation = (self.handoff.generation if self.handoff else 0) + 1
        try:
            with state.lock():
                current = state.published()
                if current is not None and current.roster == roster:
                    generation = current.generation
                else:
                    generation = state.publish(roster, f"reload of {path}")
                    _log_diff(server, current.roster if current else None, roster)
        except Exception:
            server.log.exception("cannot publish the reloaded roster to %s; workers started "
                                 "now inherit it directly", state.path)
        self.handoff = Handoff(roster, generation, path)
        server.log.info("roster %s reloaded: generation %d, %s", path, generation,
                        _summary(roster))
        self._count("ok")

    def _count(self, outcome: str) -> None:
        """Tally the reload in the state directory (``epd_roster_reloads_total``); never
        raises."""
        try:
            with self.state.lock():
                self.state.record_reload(SIGHUP, outcome)
        except Exception:
            self.server.log.exception("cannot count the roster reload in %s", self.state.path)

    def cleanup(self) -> None:
        """``on_exit``: remove a state directory this master created for itself."""
        if self.owns_state_dir:
            shutil.rmtree(self.state.path, ignore_errors=True)


def start(server: Any) -> Reloader:
    """``on_starting``: validate and publish the roster, and keep the master's ``Reloader``
    on ``server``. A roster that does not validate stops start-up with the reason (a
    RuntimeError is what gunicorn prints as ``Error: ...`` before exiting 1)."""
    state = StateDir.from_env()
    owns = state is None
    if state is None:
        state = StateDir(tempfile.mkdtemp(prefix=STATE_DIR_PREFIX))
        os.environ[STATE_DIR_ENV] = str(state.path)  # inherited by every worker
    reloader = Reloader(server, state, owns)
    state.ensure()
    path = roster_path()
    try:
        roster = load(path)
    except RosterError as exc:
        reloader.cleanup()
        raise RuntimeError(f"cannot start epd-flask: {exc}") from None
    except BaseException:
        reloader.cleanup()  # whatever stops start-up, the state directory goes with it
        raise
    # With an etcd store the admin API writes there (docs/behaviour.md#discovery); only an
    # edit of an instance the file lists touches the file, and is refused on its own.
    writes_file = settings.read("ADMIN_API_KEY") and roster.discovery.etcd is None
    problem = admin_write_problem(path) if writes_file else None
    if problem:
        reloader.cleanup()
        raise RuntimeError(
            f"cannot start epd-flask: ADMIN_API_KEY enables the admin API, which writes the "
            f"roster file {path}, but {problem}. Mount the roster writable, or leave "
            "ADMIN_API_KEY unset and change the roster by editing it and sending SIGHUP.")
    with state.lock():
        state.reset_reloads()
        generation = state.publish(roster, f"start from {path}")
    reloader.handoff = Handoff(roster, generation, path)
    setattr(server, ATTRIBUTE, reloader)
    server.log.info("roster %s: generation %d, %s; state in %s", path, generation,
                    _summary(roster), state.path)
    return reloader


def of(server: Any) -> Reloader | None:
    """The master's ``Reloader``; None before ``start`` or when it failed."""
    return getattr(server, ATTRIBUTE, None)


def inherit(server: Any) -> None:
    """``post_fork``, in the new worker: keep what the master had validated when it forked
    this worker, for ``boot_roster`` (the state directory may be gone, or its copy older)."""
    global _inherited
    reloader = of(server)
    _inherited = reloader.handoff if reloader is not None else None


def boot_roster(path: str, state: StateDir | None) -> tuple[Roster, int]:
    """The roster a worker starts with: the newest validated copy, else the file itself (no
    master prepared one, e.g. another WSGI server)."""
    candidates: list[tuple[int, Roster]] = []
    published = state.published() if state is not None else None
    if published is not None:
        candidates.append((published.generation, published.roster))
    if _inherited is not None:
        candidates.append((_inherited.generation, _inherited.roster))
    if candidates:
        generation, roster = max(candidates, key=lambda c: c[0])
        return roster, generation
    return load(path), 0


def _file_signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _summary(roster: Roster) -> str:
    counts: dict[str, int] = {}
    for inst in roster.instances:
        counts[inst.role] = counts.get(inst.role, 0) + 1
    return ", ".join(f"{n} {role}" for role, n in counts.items()) or "no instances"


def _log_diff(server: Any, before: Roster | None, after: Roster) -> None:
    old = {i.url: i for i in before.instances} if before else {}
    new = {i.url: i for i in after.instances}
    added = sorted(set(new) - set(old))
    removed = sorted(set(old) - set(new))
    changed = sorted(u for u in set(old) & set(new) if old[u] != new[u])
    server.log.info("roster change: added %s; removed %s; changed %s",
                    added or "none", removed or "none", changed or "none")
