"""The fleet benchmark's client: replays a trace at its timestamps (open loop) and times
every stream. A separate process, like loadgen.py, so its CPU is not the target's.

Reads ``{"urls": [...], "trace": [...], "deadline": s, "timeout": s}`` (and optionally
``"start"``: the ``time.monotonic()`` the trace's zero falls on, so that several clients,
one per tenant, replay one timeline) on stdin; request i
goes to ``urls[i % len(urls)]`` (several URLs: a round-robin front of several proxies). The
trace is chat items (``{"t", "session", "turn", "body"}``), or with ``"mooncake": {"model",
"max_tokens"}`` rows of a Mooncake trace (``mooncaketrace.as_json``), whose text is made
just before each is sent, so a long trace is never held in memory as text.
A chat item may carry ``headers`` (sent with it: a tenant) and ``tenant`` (kept in its row).
Prints ``{"requests": [{"ok", "status", "retry_after", "ttft", "gaps", "error", "session",
"turn", "tenant"}...], "wall_s"}``.
"""

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

import gevent  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mooncaketrace  # noqa: E402
from loadgen import Conn, ResponseError, check  # noqa: E402

PATH = "/v1/chat/completions"


def one(url: str, path: str, item: dict[str, Any], body: bytes,
        timeout: float) -> dict[str, Any]:
    parts = urlsplit(url)
    extra = "".join(f"{k}: {v}\r\n" for k, v in item.get("headers", {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: "
            f"application/json\r\n{extra}Content-Length: {len(body)}\r\n\r\n").encode()
    conn = Conn(parts.hostname or "127.0.0.1", parts.port or 80)
    out: dict[str, Any] = {"session": item.get("session", 0), "turn": item.get("turn", 0),
                           "tenant": item.get("tenant"), "ok": False}
    try:
        with gevent.Timeout(timeout, ResponseError(f"no answer in {timeout} s")):
            status, data, first, _gap, elapsed = conn.request(head, body)
        out["status"] = status
        out["retry_after"] = b"retry-after" in conn.headers
        why = check(status, data, bool(item.get("body", {}).get("stream", True)))
        if why:
            out["error"] = why
        else:
            out.update(ok=True, ttft=first, total=elapsed, gaps=conn.gaps[1:])
    except (OSError, ResponseError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return out


def main() -> int:
    spec = json.load(sys.stdin)
    urls, trace, timeout = spec["urls"], spec["trace"], float(spec.get("timeout", 60))
    deadline = float(spec.get("deadline", 300))
    rows = spec.get("mooncake")
    path = mooncaketrace.PATH if rows else PATH
    start = float(spec.get("start", time.monotonic()))
    jobs = []
    for i, item in enumerate(trace):
        wait = start + item["t"] - time.monotonic()
        if wait > 0:
            gevent.sleep(wait)
        if time.monotonic() - start > deadline:
            break
        doc = mooncaketrace.body(mooncaketrace.from_json(item), rows["model"],
                                 rows["max_tokens"]) if rows else item["body"]
        body = json.dumps(doc, separators=(",", ":")).encode()
        jobs.append(gevent.spawn(one, urls[i % len(urls)], path, item, body, timeout))
    gevent.joinall(jobs)
    json.dump({"requests": [j.get() for j in jobs], "wall_s": time.monotonic() - start},
              sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
