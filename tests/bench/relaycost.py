"""CPU time per relayed SSE event, in process: the relay generator alone, gunicorn's write
path alone, and both together as the worker runs them (werkzeug's response iterable, the
relay, gunicorn's ``Response.write`` onto a gevent socket).

Each figure is the slope between a long and a short stream (so the per-stream set-up and
``ctx.finish`` drop out), in ``time.thread_time`` CPU time, the minimum of the repeats: a busy
machine's descheduling does not count. The upstream read is not included (upstream/'s own).

    .venv/bin/python -m gevent.monkey --module tests.bench.relaycost [--repeats 7]
        [--report docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import gevent.socket
from gunicorn.http.wsgi import Response as GunicornResponse
from werkzeug.wrappers import Response as WerkzeugResponse

from epd_flask.serving import relay
from epd_flask.serving.context import RequestContext
from epd_flask.sim import stream as simstream
from epd_flask.sim.roles import Answer
from epd_flask.upstream.transport import Transport
from epd_flask.web import worker

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report

LONG, SHORT = 200, 8


class _Resp:
    deadline = None  # no total timeout: the relay arms no timer

    def close(self) -> None:
        pass


class _Req:
    version = (1, 1)
    method = "POST"

    def should_close(self) -> bool:
        return False


class _Cfg:
    is_ssl = False
    sendfile = False


def decode_events(tokens: int) -> list[bytes]:
    """A chat stream as the simulator (and vLLM) sends it: role chunk, one event per token,
    the usage chunk, [DONE]."""
    answer = Answer(request_id="chatcmpl-0123456789abcdef", pieces=[["tok "] * tokens],
                    finish_reasons=["length"], prompt_tokens=12)
    events = simstream.plan_events(answer, chat=True, include_usage=True, model="tiny-llama",
                                   fingerprint="fp_sim", ttft=0.0, token_delay=0.0)
    return [data for _, data in events]


def _min_time(run: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        run()
        best = min(best, time.thread_time() - started)
    return best


Make = Callable[[list[bytes], int], Callable[[], None]]


def _per_event(make: Make, repeats: int, streams: int) -> float:
    """Microseconds per event: the slope between a LONG and a SHORT stream."""
    long_events, short_events = decode_events(LONG), decode_events(SHORT)
    t_long = _min_time(make(long_events, streams), repeats)
    t_short = _min_time(make(short_events, streams), repeats)
    per_stream = (t_long - t_short) / streams
    return per_stream / (len(long_events) - len(short_events)) * 1e6


def _relay(pieces: Iterable[bytes], rewrite: Callable[[bytes], bytes] | None) -> Any:
    ctx = RequestContext("r", "/v1/chat/completions", {})
    return relay.sse(_TRANSPORT, _Resp(), ctx,  # type: ignore[arg-type]
                     chunks=pieces, rewrite=rewrite)


_TRANSPORT = Transport()


def relay_only(events: list[bytes], streams: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(streams):
            for _piece in _relay(events, None):
                pass
    return run


class _Sink:
    """A connected TCP pair: gunicorn writes to ``sock`` (a gevent socket, as a worker's
    client socket is); the peer is drained after each stream, in the measured thread, a few
    large ``recv`` calls that cost both variants alike."""

    def __init__(self, ours: bool) -> None:
        listener = gevent.socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        self.sock = gevent.socket.create_connection(listener.getsockname())
        self.peer, _ = listener.accept()
        listener.close()
        for s in (self.sock, self.peer):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        if ours:
            worker.lean_client_socket(self.sock)
        assert type(self.sock) is (worker.LeanSendSocket if ours else gevent.socket.socket)

    def drain(self) -> None:
        self.peer.setblocking(False)
        try:
            while self.peer.recv(1 << 20):
                pass
        except BlockingIOError:
            pass

    def response(self) -> GunicornResponse:
        resp = GunicornResponse(_Req(), self.sock, _Cfg())
        resp.chunked = True
        resp.headers_sent = True
        return resp


def write_only(sink: _Sink) -> Make:
    def make(events: list[bytes], streams: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(streams):
                resp = sink.response()
                for piece in events:
                    resp.write(piece)
                sink.drain()
        return run
    return make


def full(sink: _Sink) -> Make:
    """What the worker runs per event: werkzeug's iterable around the relay, gunicorn's
    write of each piece."""
    environ = {"REQUEST_METHOD": "POST", "SERVER_PROTOCOL": "HTTP/1.1"}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        pass

    def make(events: list[bytes], streams: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(streams):
                resp = sink.response()
                body = WerkzeugResponse(_relay(events, None), status=200,
                                        mimetype="text/event-stream",
                                        direct_passthrough=True)
                app_iter = body(environ, start_response)
                for item in app_iter:
                    resp.write(item)
                app_iter.close()
                sink.drain()
        return run
    return make


#: The peer process: a decode server that sends one SSE event per chunk with a pause between
#: them (so each token arrives in its own read, as under load), and the client that drains
#: what the proxy side writes. Neither runs in the measured thread.
_PEER = r"""
import socket, sys, threading, time
from tests.bench.relaycost import decode_events
gap = float(sys.argv[1])
sink = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
threading.Thread(target=lambda: [None for _ in iter(lambda: sink.recv(1 << 20), b"")],
                 daemon=True).start()
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = b""
while True:
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            sys.exit(0)
        buf += data
    head, _, buf = buf.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(buf) < length:
        buf += conn.recv(65536)
    tokens, buf = int(buf[:length]), buf[length:]
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
    for event in decode_events(tokens):
        time.sleep(gap)
        conn.sendall(b"%X\r\n%s\r\n" % (len(event), event))
    conn.sendall(b"0\r\n\r\n")
"""


def upstream_to_client(ours: bool, gap: float) -> Make:
    """Everything the worker does per token: the upstream read (``Transport.iter_raw``, one
    hub wait per token), the relay, werkzeug's iterable, gunicorn's write."""
    listener = gevent.socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(gap),
                             str(listener.getsockname()[1])], stdout=subprocess.PIPE)
    assert peer.stdout is not None
    port = int(peer.stdout.readline())
    client, _ = listener.accept()
    listener.close()
    if ours:
        worker.lean_client_socket(client)
    transport = Transport()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    environ = {"REQUEST_METHOD": "POST", "SERVER_PROTOCOL": "HTTP/1.1"}
    _PEERS.append(peer)

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        pass

    def make(events: list[bytes], streams: int) -> Callable[[], None]:
        tokens = len(events) - 3

        def run() -> None:
            for _ in range(streams):
                up = transport.send("POST", url, stage="decode", headers={},
                                    body=str(tokens).encode(), read_timeout=10.0,
                                    chunk_timeout=10.0)
                ctx = RequestContext("r", "/v1/chat/completions", {})
                resp = GunicornResponse(_Req(), client, _Cfg())
                resp.chunked = True
                resp.headers_sent = True
                body = WerkzeugResponse(relay.sse(transport, up, ctx), status=200,
                                        mimetype="text/event-stream", direct_passthrough=True)
                app_iter = body(environ, start_response)
                for item in app_iter:
                    resp.write(item)
                app_iter.close()
        return run
    return make


_PEERS: list[Any] = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--e2e-streams", type=int, default=6,
                        help="streams per repeat through a real upstream socket (0: skip)")
    parser.add_argument("--gap", type=float, default=0.0005,
                        help="seconds between two events from the decode peer")
    parser.add_argument("--report", default="",
                        help="markdown file whose `relaycost` block the figures replace")
    args = parser.parse_args()
    started, info = report.now(), report.machine()
    logging.disable(logging.CRITICAL)
    streams, repeats = args.streams, args.repeats
    rows: list[tuple[str, float]] = []

    def show(what: str, us: float) -> None:
        rows.append((what, us))
        print(f"  {what:45s} {us:6.2f}")

    print(f"us of CPU per relayed event (slope {LONG} vs {SHORT} tokens, "
          f"{streams} streams, min of {repeats})")
    show("relay generator alone", _per_event(relay_only, repeats, streams))
    for ours in (False, True):
        sink = _Sink(ours)
        name = "lean worker socket" if ours else "stock gevent socket"
        show(f"gunicorn write, {name}", _per_event(write_only(sink), repeats, streams))
        show(f"whole path, {name}", _per_event(full(sink), repeats, streams))
    if args.e2e_streams:
        n = args.e2e_streams
        try:
            for ours in (False, True):
                name = "lean worker socket" if ours else "stock gevent socket"
                show(f"with the upstream read, {name}",
                     _per_event(upstream_to_client(ours, args.gap), repeats, n))
        finally:
            for peer in _PEERS:
                peer.kill()
    if args.report:
        command = report.recorded_command(
            ".venv/bin/python -m gevent.monkey --module tests.bench.relaycost", sys.argv[1:])
        report.write_section(Path(args.report), "relaycost", "\n".join([
            report.stamp(started, info, command),
            f"CPU per relayed event, the slope between {LONG}- and {SHORT}-token streams, the "
            f"minimum of {repeats} repeats ({streams} streams each; through a real upstream "
            f"socket: {args.e2e_streams}, one event every {args.gap * 1000:g} ms):", "",
            "| path | us |", "|---|---:|", *(f"| {what} | {us:.2f} |" for what, us in rows)]))


if __name__ == "__main__":
    main()
