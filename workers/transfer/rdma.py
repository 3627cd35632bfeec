"""The RDMA devices this machine really offers, read the way ``ibv_devices`` and
``ibdev2netdev`` read them: from ``/sys/class/infiniband``.

Mooncake's ``rdma`` protocol needs a verbs device with an active port, and inside a
container also its ``/dev/infiniband/uverbsN`` character device (what an RDMA device
plugin mounts into the pod). Asked for a device that cannot work, pdserve refuses to
start rather than let KV quietly travel over tcp; ``--allow-tcp-fallback`` makes the
fallback explicit (logged and counted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class RdmaPort:
    number: int
    state: str  # ACTIVE, DOWN, INIT ... (the word after "4: " in the port's state file)
    link_layer: str  # InfiniBand or Ethernet (RoCE)


@dataclasses.dataclass(frozen=True)
class RdmaDevice:
    """One verbs device: ``ibv_devices`` lists its name, ``ibdev2netdev`` its net devices."""

    name: str
    ports: tuple[RdmaPort, ...]
    netdevs: tuple[str, ...]
    uverbs: str  # the character device a process opens (``/dev/infiniband/uverbs0``), "" if none
    uverbs_present: bool  # that device exists here (in a container: was mounted)

    @property
    def active_ports(self) -> tuple[RdmaPort, ...]:
        return tuple(p for p in self.ports if p.state == "ACTIVE")

    @property
    def usable(self) -> bool:
        return bool(self.active_ports) and self.uverbs_present

    def describe(self) -> str:
        ports = ", ".join(f"port {p.number} {p.state} ({p.link_layer})" for p in self.ports) or "no ports"
        net = f" -> {', '.join(self.netdevs)}" if self.netdevs else ""
        dev = self.uverbs if self.uverbs_present else f"{self.uverbs or 'uverbs'} missing"
        return f"{self.name}{net}: {ports}; {dev}"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def rdma_devices(root: Path = Path("/")) -> list[RdmaDevice]:
    """Every verbs device under ``root``'s ``/sys/class/infiniband``, sorted by name (an
    empty list on a machine without RDMA)."""
    base = root / "sys" / "class" / "infiniband"
    devices = []
    for entry in sorted(base.iterdir()) if base.is_dir() else []:
        ports = []
        for port in sorted((entry / "ports").iterdir(), key=lambda p: p.name) if (entry / "ports").is_dir() else []:
            if not port.name.isdigit():
                continue
            state = _read(port / "state").split(":", 1)[-1].strip() or "UNKNOWN"
            ports.append(RdmaPort(int(port.name), state, _read(port / "link_layer") or "unknown"))
        net = entry / "device" / "net"
        netdevs = tuple(sorted(p.name for p in net.iterdir())) if net.is_dir() else ()
        verbs = entry / "device" / "infiniband_verbs"
        names = sorted(p.name for p in verbs.iterdir()) if verbs.is_dir() else []
        uverbs = f"/dev/infiniband/{names[0]}" if names else ""
        present = bool(uverbs) and (root / uverbs.lstrip("/")).exists()
        devices.append(RdmaDevice(entry.name, tuple(ports), netdevs, uverbs, present))
    return devices


def requested_devices(ib_device: str) -> list[str]:
    """``--disaggregation-ib-device`` as device names (it may list several, comma-separated)."""
    return [name.strip() for name in ib_device.split(",") if name.strip()]


def rdma_problem(ib_device: str, devices: Sequence[RdmaDevice]) -> str | None:
    """Why Mooncake's rdma transport cannot work with ``ib_device`` here, or ``None`` when
    every device asked for exists with an active port and its verbs device."""
    wanted = requested_devices(ib_device)
    if not wanted:
        return "no RDMA device named"
    found = {d.name: d for d in devices}
    problems = []
    for name in wanted:
        device = found.get(name)
        if device is None:
            have = ", ".join(sorted(found)) or "none (no /sys/class/infiniband entries)"
            problems.append(f"{name} not found (RDMA devices here: {have})")
        elif not device.active_ports:
            problems.append(f"{name} has no ACTIVE port ({device.describe()})")
        elif not device.uverbs_present:
            problems.append(
                f"{name}: {device.uverbs or 'its uverbs device'} is not here (not mounted into the container?)"
            )
    return "; ".join(problems) or None
