"""Wait until URLs answer 200, for scripts that start a fleet and then the proxy.

``python -m epd_flask.sim.waitfor URL... [--timeout S]``; exit 1 if any is not up in time.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request

DEFAULT_TIMEOUT = 20.0
POLL_INTERVAL = 0.1


def wait_for(urls: list[str], timeout: float = DEFAULT_TIMEOUT) -> list[str]:
    """The URLs still not answering 200 when the time ran out (empty when all are up)."""
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        pending = [u for u in pending if not _up(u)]
        if pending:
            time.sleep(POLL_INTERVAL)
    return pending


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    timeout = DEFAULT_TIMEOUT
    if "--timeout" in args:
        i = args.index("--timeout")
        timeout = float(args[i + 1])
        del args[i:i + 2]
    missing = wait_for(args, timeout)
    for url in missing:
        print(f"not up after {timeout:g} s: {url}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
