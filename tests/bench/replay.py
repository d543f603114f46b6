"""The fleet benchmark's client: replays a chat trace at its timestamps (open loop) and times
every stream. A separate process, like loadgen.py, so its CPU is not the target's.

Reads ``{"urls": [...], "trace": [...], "deadline": s, "timeout": s}`` on stdin; request i
goes to ``urls[i % len(urls)]`` (several URLs: a round-robin front of several proxies).
Prints ``{"requests": [{"ok", "ttft", "gaps", "error", "session", "turn"}...], "wall_s"}``.
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
from loadgen import Conn, ResponseError, check  # noqa: E402

PATH = "/v1/chat/completions"


def one(url: str, item: dict[str, Any], timeout: float) -> dict[str, Any]:
    parts = urlsplit(url)
    body = json.dumps(item["body"], separators=(",", ":")).encode()
    head = (f"POST {PATH} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    conn = Conn(parts.hostname or "127.0.0.1", parts.port or 80)
    out: dict[str, Any] = {"session": item["session"], "turn": item["turn"], "ok": False}
    try:
        with gevent.Timeout(timeout, ResponseError(f"no answer in {timeout} s")):
            status, data, first, _gap, elapsed = conn.request(head, body)
        why = check(status, data, True)
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
    start = time.monotonic()
    jobs = []
    for i, item in enumerate(trace):
        wait = start + item["t"] - time.monotonic()
        if wait > 0:
            gevent.sleep(wait)
        if time.monotonic() - start > deadline:
            break
        jobs.append(gevent.spawn(one, urls[i % len(urls)], item, timeout))
    gevent.joinall(jobs)
    json.dump({"requests": [j.get() for j in jobs], "wall_s": time.monotonic() - start},
              sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
