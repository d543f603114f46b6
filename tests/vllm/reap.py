"""Ends every process group the vLLM tier recorded in RUN_DIR (its pid files), and nothing else:
the Makefile's exit trap, for runs that were interrupted before their fixtures could clean up.

    python tests/vllm/reap.py RUN_DIR
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

if not __package__:  # run as a script (the Makefile's trap): the tests package is the root's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import eventually

GRACE_SECONDS = 30.0
POLL_SECONDS = 0.5


def group_members(pgid: int) -> list[tuple[int, str, str]]:
    """``(pid, state, command)`` of each process in group ``pgid``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, rest = stat.read_text().rsplit(")", 1)
            fields = rest.split()
            if int(fields[2]) == pgid:
                found.append((int(stat.parent.name), fields[0], head.split("(", 1)[1]))
        except (OSError, IndexError, ValueError):  # it ended while being read
            continue
    return sorted(found)


def group_alive(pgid: int) -> bool:
    """Whether anything in the group still runs. Zombies do not count: a member whose parent
    died first is reaped by this machine's init, which was seen to take over a second, so a
    group of zombies looked alive (and SIGKILL cannot end a zombie)."""
    return any(state not in "ZX" for _, state, _ in group_members(pgid))


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
            with contextlib.suppress(ProcessLookupError):  # ended since
                os.killpg(pgid, signal.SIGTERM)
            stopped.append(f"{groups[pgid].stem} (group {pgid})")
    eventually(lambda: not any(group_alive(g) for g in groups), GRACE_SECONDS,
               interval=POLL_SECONDS)
    for pgid, pid_file in groups.items():
        if group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        pid_file.unlink(missing_ok=True)
    return stopped


if __name__ == "__main__":
    for line in reap(Path(sys.argv[1])):
        print(f"reaped {line}")
