"""What this worker process holds right now, for leak checks after failures: live greenlets,
established TCP connections by peer, resident memory. Read from the garbage collector and
/proc/self (Linux); elsewhere the /proc figures are empty.
"""

from __future__ import annotations

import gc
import os
import socket
import struct
from collections import Counter
from pathlib import Path

from greenlet import greenlet

PROC = Path("/proc/self")
TCP_ESTABLISHED = "01"


def greenlets() -> int:
    """Greenlets alive in this process (the hub and every handler, probe and relay)."""
    return sum(1 for o in gc.get_objects() if isinstance(o, greenlet) and not o.dead)


def rss_bytes() -> int | None:
    try:
        for line in (PROC / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def tcp_peers() -> Counter[str]:
    """Established TCP connections of this process, counted by remote ``host:port``."""
    inodes = _socket_inodes()
    peers: Counter[str] = Counter()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = (PROC / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != TCP_ESTABLISHED or fields[9] not in inodes:
                continue
            peers[_address(fields[2], family)] += 1
    return peers


def _socket_inodes() -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(PROC / "fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(PROC / "fd" / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(hex_pair: str, family: int) -> str:
    """``0100007F:1F90`` (kernel byte order) as ``127.0.0.1:8080``."""
    host_hex, port_hex = hex_pair.split(":")
    raw = bytes.fromhex(host_hex)
    if family == socket.AF_INET:
        host = socket.inet_ntop(family, struct.pack("<I", struct.unpack(">I", raw)[0]))
        return f"{host}:{int(port_hex, 16)}"
    words = struct.unpack(">4I", raw)
    host = socket.inet_ntop(family, struct.pack("<4I", *words))
    return f"[{host}]:{int(port_hex, 16)}"
