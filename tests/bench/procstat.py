"""CPU time and peak memory of a process tree, and how busy the machine is, read from /proc
(Linux only).

CPU is utime + stime of every live process in the tree (all threads included) plus what the
root collected from children it reaped; peak memory is the sum of each process's VmHWM, which
``reset_peak`` clears (``clear_refs`` 5) so every workload gets its own peak.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def tree(root: int) -> list[int]:
    """``root`` and all its live descendants."""
    kids = _children_map()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


@dataclass
class Sample:
    cpu_s: float
    peak_rss_mb: float


def sample(roots: list[int]) -> Sample:
    """CPU seconds so far and the summed VmHWM of the trees under ``roots``."""
    ticks = 0
    hwm_kb = 0
    for root in roots:
        for pid in tree(root):
            fields = _stat_fields(pid)
            if fields is None:
                continue
            # After the ")": state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
            ticks += int(fields[11]) + int(fields[12])
            if pid == root:
                ticks += int(fields[13]) + int(fields[14])
            hwm_kb += _hwm_kb(pid)
    return Sample(ticks / CLK_TCK, hwm_kb / 1024.0)


def machine_busy() -> tuple[float, float]:
    """(CPU-seconds the machine's CPUs were busy so far, CPU-seconds elapsed), from
    /proc/stat: their difference over a run says how near the cores were to full."""
    with open("/proc/stat", encoding="ascii") as fh:
        ticks = [int(v) for v in fh.readline().split()[1:]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / CLK_TCK, sum(ticks) / CLK_TCK


def _hwm_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak(roots: list[int]) -> bool:
    """Start a new peak-RSS window; False where the kernel refuses (then peaks are lifetime)."""
    ok = True
    for root in roots:
        for pid in tree(root):
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                ok = False
    return ok
