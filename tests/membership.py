"""Real etcd and dnsmasq (Debian's etcd-server and dnsmasq) started by the tests on free
loopback ports, for the membership sources (docs/behaviour.md#discovery).

Each server lives in a directory of the test's; nothing outside it is touched. With CI=true a
missing program fails the tests that need it instead of skipping them (``.ci/run`` installs
both), as the nginx and Prometheus tests do.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from epd_flask.control.roster import Instance, Roster, Settings
from epd_flask.control.statedir import StateDir
from epd_flask.control.urlpolicy import URLPolicy
from epd_flask.fleet.live import LiveFleet
from epd_flask.fleet.sources import Context
from epd_flask.upstream.etcd import EtcdClient
from tests.helpers import free_port, stop_group

SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/usr/sbin",
                               "/usr/local/bin", "/usr/local/sbin"])
START_TIMEOUT = 20.0
REQUIRED = os.environ.get("CI") == "true"
ETCD = shutil.which("etcd", path=SEARCH_PATH)
DNSMASQ = shutil.which("dnsmasq", path=SEARCH_PATH)


def needs(program: str | None, package: str) -> Any:
    """A skip mark for a missing program, except in CI, where its tests must run."""
    return pytest.mark.skipif(
        program is None and not REQUIRED,
        reason=f"{package} is not installed (Debian: apt-get install {package}; .ci/run "
               "installs it)")


needs_etcd = needs(ETCD, "etcd-server")
needs_dnsmasq = needs(DNSMASQ, "dnsmasq")


class Fleet(LiveFleet):
    """A worker's live fleet, real, that also keeps each offer a source made (newest last),
    so a test can tell what a source said from what the fleet serves of it."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(Roster(settings=Settings(**settings)))
        self.log: list[tuple[str, list[Instance], str]] = []

    def offer(self, source: str, instances: Any, origin: str = "") -> None:
        instances = tuple(instances)
        self.log.append((source, list(instances), origin))
        super().offer(source, instances, origin)

    @property
    def urls(self) -> list[str] | None:
        """The URLs of the last offer, None before any."""
        return [i.url for i in self.log[-1][1]] if self.log else None

    @property
    def served(self) -> list[str]:
        """The URLs the fleet routes by."""
        return [i.url for i in self.view.instances]

    def context(self, state: StateDir | None = None,
                policy: URLPolicy | None = None) -> Context:
        return Context(self, lambda: policy or URLPolicy(), state)


class Etcd:
    """One etcd member on loopback; ``stop()`` then ``start()`` brings it back on the same
    ports with the same data (an outage, not a new cluster)."""

    def __init__(self, directory: Path) -> None:
        assert ETCD, "etcd is not installed"
        self.directory = directory
        self.port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = EtcdClient([self.url])

    def start(self) -> Etcd:
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.directory / "etcd.log", "ab")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(
            [ETCD or "etcd", "--name", "t", "--data-dir", str(self.directory / "data"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {self.tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=1).json().get("health") == "true":
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"etcd not up after {START_TIMEOUT} s: {self.tail()}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None

    def put_record(self, prefix: str, ident: str, record: dict[str, Any]) -> None:
        self.client.put(f"{prefix}instances/{ident}", json.dumps(record).encode())

    def put_many(self, values: dict[str, bytes]) -> None:
        """Many keys in transactions of etcd's default limit (128 operations each)."""
        self._txn([{"request_put": {"key": base64.b64encode(k.encode()).decode(),
                                    "value": base64.b64encode(v).decode()}}
                   for k, v in values.items()])

    def delete_many(self, keys: list[str]) -> None:
        self._txn([{"request_delete_range": {"key": base64.b64encode(k.encode()).decode()}}
                   for k in keys])

    def _txn(self, ops: list[dict[str, Any]]) -> None:
        for start in range(0, len(ops), 128):
            answer = requests.post(self.url + "/v3/kv/txn",
                                   json={"success": ops[start:start + 128]}, timeout=10)
            answer.raise_for_status()

    def clear(self, prefix: str) -> None:
        for kv in self.client.range_prefix(prefix)[1]:
            self.client.delete(kv.key)

    def tail(self) -> str:
        path = self.directory / "etcd.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""


class Dnsmasq:
    """dnsmasq answering for ``svc.test`` only (authoritatively: a name it does not know is
    NXDOMAIN) from a hosts file the test edits; ``reload()`` is the SIGHUP that re-reads it.
    SRV records are fixed at start."""

    DOMAIN = "svc.test"

    def __init__(self, directory: Path, srv: list[tuple[str, str, int]] = (),  # type: ignore[assignment]
                 records: list[tuple[str, str]] = ()) -> None:  # type: ignore[assignment]
        assert DNSMASQ, "dnsmasq is not installed"
        self.directory = directory
        self.port = free_port()
        self.nameserver = f"127.0.0.1:{self.port}"
        self.hosts = directory / "hosts"
        self.srv = list(srv)
        self.proc: subprocess.Popen[bytes] | None = None
        self.write(records)

    def write(self, records: list[tuple[str, str]]) -> None:
        """The hosts file: (address, name) lines."""
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("".join(f"{addr} {name}\n" for addr, name in records))
        tmp.replace(self.hosts)

    def start(self) -> Dnsmasq:
        argv = [DNSMASQ or "dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts",
                f"--addn-hosts={self.hosts}", "--listen-address=127.0.0.1",
                f"--port={self.port}", "--bind-interfaces", f"--local=/{self.DOMAIN}/",
                "--user=root", f"--pid-file={self.directory / 'dnsmasq.pid'}",
                "--local-ttl=0", "--no-negcache", "--cache-size=0",
                f"--log-facility={self.directory / 'dnsmasq.log'}"]
        argv += [f"--srv-host={name},{target},{port}" for name, target, port in self.srv]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        import dns.resolver  # the tests' own check that it answers

        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port, resolver.lifetime = ["127.0.0.1"], self.port, 0.5
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("dnsmasq exited at start")
            try:
                resolver.resolve(f"nothing.{self.DOMAIN}", "A")
            except dns.resolver.NXDOMAIN:
                return self
            except dns.exception.DNSException:
                time.sleep(0.05)
        raise RuntimeError(f"dnsmasq not answering after {START_TIMEOUT} s")

    def reload(self, records: list[tuple[str, str]]) -> None:
        self.write(records)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)
            self.proc = None


class Relay:
    """A TCP relay in front of a server, which a test can cut: ``cut()`` closes every
    connection through it and refuses new ones until ``mend()``; a network partition between
    one client and a server that stays up for everyone else. ``freeze()`` is the silent kind."""

    def __init__(self, target_port: int) -> None:
        from gevent.server import StreamServer

        self.target_port = target_port
        self.open = True
        self.frozen = False
        self._pairs: list[tuple[Any, Any]] = []
        self._server = StreamServer(("127.0.0.1", 0), self._handle)
        self._server.start()
        self.port = self._server.server_port
        self.url = f"http://127.0.0.1:{self.port}"

    def _handle(self, client: Any, _address: Any) -> None:
        import gevent
        from gevent import socket

        if not self.open:
            client.close()
            return
        while self.frozen and self.open:  # accepted, and never answered
            gevent.sleep(0.05)
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        pair = (client, upstream)
        self._pairs.append(pair)

        def pump(src: Any, dst: Any) -> None:
            with contextlib.suppress(OSError):
                while chunk := src.recv(65536):
                    while self.frozen and self.open:  # held, as by a dead link: no FIN
                        gevent.sleep(0.05)
                    dst.sendall(chunk)
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

        gevent.joinall([gevent.spawn(pump, client, upstream), gevent.spawn(pump, upstream, client)])
        for s in pair:
            s.close()
        with contextlib.suppress(ValueError):
            self._pairs.remove(pair)

    def cut(self) -> None:
        from gevent import socket

        self.open = False
        for pair in list(self._pairs):
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def mend(self) -> None:
        self.open = True

    def freeze(self) -> None:
        """Go silent without closing anything: connections stay open, bytes stop, new
        connections are accepted and never answered (a host that vanished)."""
        self.frozen = True

    def stop(self) -> None:
        self.cut()
        self._server.stop()
