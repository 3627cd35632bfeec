"""RDMA devices read from a sysfs tree laid out as the kernel lays it out (two devices of
a ConnectX card: one port up, one down), and the transport a worker really gets: rdma
where it can work, a refusal where it cannot, tcp only when the user allows it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.configs import Transport, UsageError, choose_transport
from pdserve.workers.transfer.rdma import rdma_devices, rdma_problem, requested_devices


def add_device(
    root: Path,
    name: str,
    state: str,
    link: str = "InfiniBand",
    netdev: str = "",
    uverbs: str = "",
    mounted: bool = True,
) -> None:
    """``/sys/class/infiniband/<name>`` with one port, as ``ibv_devices`` reads it."""
    device = root / "sys" / "class" / "infiniband" / name
    port = device / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "link_layer").write_text(link + "\n")
    if netdev:
        (device / "device" / "net" / netdev).mkdir(parents=True)
    if uverbs:
        (device / "device" / "infiniband_verbs" / uverbs).mkdir(parents=True)
        if mounted:
            (root / "dev" / "infiniband").mkdir(parents=True, exist_ok=True)
            (root / "dev" / "infiniband" / uverbs).write_text("")


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    add_device(tmp_path, "mlx5_0", "4: ACTIVE", netdev="ib0", uverbs="uverbs0")
    add_device(tmp_path, "mlx5_1", "1: DOWN", netdev="ib1", uverbs="uverbs1")
    add_device(tmp_path, "mlx5_2", "4: ACTIVE", link="Ethernet", netdev="ens1f0", uverbs="uverbs2", mounted=False)
    return tmp_path


def test_devices_are_listed_with_ports_net_devices_and_verbs_devices(sysfs: Path) -> None:
    devices = {d.name: d for d in rdma_devices(sysfs)}
    assert list(devices) == ["mlx5_0", "mlx5_1", "mlx5_2"]
    up = devices["mlx5_0"]
    assert up.usable and up.netdevs == ("ib0",) and up.uverbs == "/dev/infiniband/uverbs0"
    assert [(p.number, p.state, p.link_layer) for p in up.ports] == [(1, "ACTIVE", "InfiniBand")]
    assert up.describe() == "mlx5_0 -> ib0: port 1 ACTIVE (InfiniBand); /dev/infiniband/uverbs0"
    assert not devices["mlx5_1"].usable and devices["mlx5_1"].ports[0].state == "DOWN"
    roce = devices["mlx5_2"]  # present on the host, its verbs device not mounted into this container
    assert roce.active_ports and not roce.uverbs_present and not roce.usable


def test_a_machine_without_rdma_has_no_devices(tmp_path: Path) -> None:
    assert rdma_devices(tmp_path) == []
    assert "none" in (rdma_problem("mlx5_0", []) or "")


def test_why_each_device_cannot_work(sysfs: Path) -> None:
    devices = rdma_devices(sysfs)
    assert rdma_problem("mlx5_0", devices) is None
    assert requested_devices(" mlx5_0, mlx5_1 ") == ["mlx5_0", "mlx5_1"]
    assert "mlx5_1 has no ACTIVE port" in (rdma_problem("mlx5_0,mlx5_1", devices) or "")
    assert "/dev/infiniband/uverbs2 is not here" in (rdma_problem("mlx5_2", devices) or "")
    missing = rdma_problem("mlx5_9", devices) or ""
    assert "mlx5_9 not found" in missing and "mlx5_0, mlx5_1, mlx5_2" in missing


def test_rdma_where_it_works_tcp_where_none_is_asked_for(sysfs: Path) -> None:
    assert choose_transport("mlx5_0", False, root=sysfs) == Transport("rdma", "mlx5_0")
    assert choose_transport("", False, root=sysfs) == Transport("tcp", "")
    assert choose_transport("mlx5_1", False, backend="gloo", root=sysfs) == Transport("tcp", "")  # not mooncake's


def test_rdma_that_cannot_work_refuses_to_start_unless_the_fallback_is_allowed(sysfs: Path) -> None:
    with pytest.raises(UsageError, match=r"RDMA cannot work here: mlx5_1 has no ACTIVE port.*--allow-tcp-fallback"):
        choose_transport("mlx5_1", False, root=sysfs)
    fallback = choose_transport("mlx5_1", True, root=sysfs)
    assert fallback.protocol == "tcp" and fallback.ib_device == "" and "mlx5_1 has no ACTIVE port" in fallback.fallback
