"""Ends every process group the vLLM tier recorded in RUN_DIR (its pid files), and nothing else:
the Makefile's exit trap, for runs that were interrupted before their fixtures could clean up.

    python tests/vllm/reap.py RUN_DIR
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

if not __package__:  # run as a script (the Makefile's trap): the tests package is the root's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import eventually

GRACE_SECONDS = 30.0
POLL_SECONDS = 0.5


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(run_dir: Path) -> list[str]:
    groups: dict[int, Path] = {}
    for pid_file in sorted(run_dir.glob("*.pid")):
        try:
            groups[int(pid_file.read_text().strip())] = pid_file
        except ValueError:
            pid_file.unlink()
    stopped = []
    for pgid in groups:
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGTERM)
            stopped.append(f"{groups[pgid].stem} (group {pgid})")
    eventually(lambda: not any(group_alive(g) for g in groups), GRACE_SECONDS,
               interval=POLL_SECONDS)
    for pgid, pid_file in groups.items():
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        pid_file.unlink(missing_ok=True)
    return stopped


if __name__ == "__main__":
    for line in reap(Path(sys.argv[1])):
        print(f"reaped {line}")
