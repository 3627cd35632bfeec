"""The listening TCP sockets of a process, read from /proc (what `ss -ltnp` shows)."""

from __future__ import annotations

import os
from pathlib import Path


def listening_ports(pid: int) -> dict[int, str]:
    """Port → bound address of this process's listening TCP sockets (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports: dict[int, str] = {}
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                address, port = local.split(":")
                ports[int(port, 16)] = "any" if set(address) == {"0"} and len(address) == width else address
    return ports
