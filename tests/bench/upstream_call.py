"""CPU time of one upstream call through the transport, on a kept-alive loopback connection.

    python tests/bench/upstream_call.py [--calls 2000] [--repeats 7] [--report docs/benchmarks.md]

The answering server runs in a child process (a plain Python without gevent, a canned answer shaped
like vLLM's non-stream completion), so ``time.thread_time`` in this process counts only the
client's side: building and writing the request, reading and parsing the answer, handing the
connection back. Reported: the minimum over the repeats of the mean per call (the busy
machine's noise only ever adds), for ``Transport.send`` + ``read_body`` and, as the floor, the
same bytes written and read on a raw socket; and per event of a streamed answer read through
``iter_raw`` (the slope between a short and a long stream, so the call's set-up drops out).

``--compare-wait`` instead measures the streamed event's read both ways in one process, the
two alternating in each repeat (this machine's load moves a lone figure by a third): with
``http1``'s own wait on the socket, and through gevent's ``socket.recv`` as before.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report

ANSWER_BODY = json.dumps({
    "id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1764600000,
    "model": "tiny", "choices": [{"index": 0, "text": " the quick brown fox jumps over",
                                  "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 12, "total_tokens": 28, "completion_tokens": 16},
}).encode()
ANSWER = (b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 18:00:00 GMT\r\nserver: uvicorn\r\n"
          b"content-length: %d\r\ncontent-type: application/json\r\n\r\n%s"
          % (len(ANSWER_BODY), ANSWER_BODY))
EVENT = (b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1764600000,'
         b'"model":"tiny","choices":[{"index":0,"text":" fox","logprobs":null,'
         b'"finish_reason":null}]}\n\n')
EVENT_GAP = 0.0003
SHORT, LONG = 10, 110
REQUEST_BODY = json.dumps({"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 16,
                           "stream": False}).encode()
HEADERS = {"X-Request-Id": "0123456789abcdef0123456789abcdef",
           "Content-Type": "application/json"}


def serve(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=answer, args=(conn,), daemon=True).start()


def answer(conn: socket.socket) -> None:
    buf = b""
    while True:
        head_end = buf.find(b"\r\n\r\n")
        if head_end < 0:
            data = conn.recv(65536)
            if not data:
                break
            buf += data
            continue
        head = buf[:head_end].lower()
        length = 0
        if b"content-length:" in head:
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        while len(buf) < head_end + 4 + length:
            buf += conn.recv(65536)
        buf = buf[head_end + 4 + length:]
        if head.startswith(b"post /stream/"):
            stream(conn, int(head.split(b" ", 2)[1].rsplit(b"/", 1)[1]))
        else:
            conn.sendall(ANSWER)
    conn.close()


def stream(conn: socket.socket, events: int) -> None:
    """A chunked SSE stream, one event per chunk and per send, a little apart (as decode's
    tokens): each is one read for the client."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
    for _ in range(events):
        time.sleep(EVENT_GAP)
        conn.sendall(b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
    conn.sendall(b"0\r\n\r\n")


def per_call(call, calls: int, repeats: int) -> float:
    for _ in range(min(calls, 200)):
        call()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            call()
        best = min(best, (time.thread_time() - start) / calls)
    return best * 1e6


def compare_wait(streamed: Callable[[int], Callable[[], None]], repeats: int) -> None:
    from epd_flask.upstream import http1

    def gevent_recv(self: http1.Response) -> bytes:
        return self.sock.recv(http1.READ_SIZE)

    ways = {"http1's wait": http1.Response._recv, "gevent's recv": gevent_recv}
    short, long = streamed(SHORT), streamed(LONG + 100)
    best = {name: [float("inf"), float("inf")] for name in ways}
    for _ in range(max(repeats, 9)):
        for name, read in ways.items():
            http1.Response._recv = read  # type: ignore[method-assign]
            for slot, run in enumerate((short, long)):
                start = time.thread_time()
                run()
                best[name][slot] = min(best[name][slot], time.thread_time() - start)
    http1.Response._recv = ways["http1's wait"]  # type: ignore[method-assign]
    for name, (low, high) in best.items():
        print(f"one streamed event read, {name}: {(high - low) / (LONG + 100 - SHORT) * 1e6:.1f}"
              " us CPU per event")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--compare-wait", action="store_true",
                        help="a streamed event's read: http1's wait against gevent's recv")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report", default="",
                        help="markdown file whose `upstream-call` block the figures replace")
    args = parser.parse_args()
    started = report.now()

    if args.serve:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        print(listener.getsockname()[1], flush=True)
        serve(listener)
        return
    info = report.machine()
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE)
    assert child.stdout is not None
    port = int(child.stdout.readline())
    from gevent import monkey
    monkey.patch_all()

    from epd_flask.upstream.transport import Transport
    transport = Transport()
    url = f"http://127.0.0.1:{port}/v1/completions"

    def through_transport() -> None:
        resp = transport.send("POST", url, stage="decode", headers=HEADERS, body=REQUEST_BODY,
                              read_timeout=10.0, chunk_timeout=10.0, stream=False)
        assert resp.status_code == 200 and resp.content == ANSWER_BODY

    reads = [0, 0]  # pieces read, events in them

    def streamed(events: int) -> Callable[[], None]:
        def run() -> None:
            resp = transport.send("POST", f"http://127.0.0.1:{port}/stream/{events}",
                                  stage="decode", headers=HEADERS, body=REQUEST_BODY,
                                  read_timeout=10.0, chunk_timeout=10.0)
            got = 0
            for piece in transport.iter_raw(resp, "decode"):
                got += piece.count(b"data: ")
                reads[0] += 1
            reads[1] += got
            resp.close()
            assert got == events
        return run

    if args.compare_wait:
        compare_wait(streamed, args.repeats)
        transport.close()
        child.kill()
        return

    raw = socket.create_connection(("127.0.0.1", port))
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (port, len(REQUEST_BODY), REQUEST_BODY))

    def raw_socket() -> None:
        raw.sendall(request)
        got = 0
        while got < len(ANSWER):
            got += len(raw.recv(65536))

    call = per_call(through_transport, args.calls, args.repeats)
    floor = per_call(raw_socket, args.calls, args.repeats)
    print(f"Transport.send + read_body: {call:.1f} us CPU per call")
    print(f"raw socket, same bytes:     {floor:.1f} us CPU per call")
    short = per_call(streamed(SHORT), max(args.calls // 100, 3), args.repeats)
    long = per_call(streamed(LONG), max(args.calls // 100, 3), args.repeats)
    event = (long - short) / (LONG - SHORT)
    per_read = reads[0] / max(reads[1], 1)
    print(f"one streamed event read:    {event:.1f} us CPU per event "
          f"(slope between {SHORT}- and {LONG}-event streams; {per_read:.2f} reads per event)")
    if args.report:
        command = report.recorded_command(".venv/bin/python tests/bench/upstream_call.py",
                                          sys.argv[1:])
        report.write_section(Path(args.report), "upstream-call", "\n".join([
            report.stamp(started, info, command),
            f"CPU of this process, the minimum over {args.repeats} repeats of the mean per "
            f"call ({args.calls} calls per repeat):", "",
            "| what | us |", "|---|---:|",
            f"| one call, `Transport.send` + `read_body` (a {len(ANSWER)}-byte answer) "
            f"| {call:.1f} |",
            f"| the same bytes written and read on a raw socket | {floor:.1f} |",
            f"| one streamed event read through `iter_raw` (slope between {SHORT}- and "
            f"{LONG}-event streams; {per_read:.2f} reads per event) | {event:.1f} |"]))
    raw.close()
    transport.close()
    child.kill()


if __name__ == "__main__":
    main()
