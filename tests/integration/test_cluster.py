"""pdserve on a three-node JetStream cluster: three real ``nats-server`` processes on
loopback with routes between them (file storage in temp dirs), pdserve's streams at R3
(``--js-replicas 3``), and a real pipeline (``pdserve up`` on the cluster: the API, a
prefill and a decode worker, Mooncake over tcp, the tiny model). One node is killed
(kill -9: the request stream's leader) while requests stream, and started again over its
store: every request the API accepted completes, token for token as without the kill."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
import nats.errors
import pytest

from pdserve.bench.chaos import Streamed, prompts, stream
from pdserve.broker import subjects
from pdserve.broker.auth import NatsAuth
from pdserve.broker.server import find_binary
from pdserve.broker.streams import BrokerConfig
from pdserve.broker.survey import FAIL, OK, survey

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLUSTER = "pdserve-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    name: str
    port: int
    route_port: int
    monitor_port: int
    home: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def jsz(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/jsz", timeout=2) as reply:
            return dict(json.loads(reply.read()))


@dataclass
class Cluster:
    """Three ``nats-server -js`` nodes routed to each other, as the NATS Helm chart runs
    them: a cluster name, routes to every node, JetStream with file storage per node."""

    root: Path
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        for i in range(3):
            home = self.root / f"n{i}"
            home.mkdir(parents=True)
            self.nodes.append(Node(f"n{i}", free_port(), free_port(), free_port(), home))

    @property
    def urls(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def start(self, node: Node) -> None:
        conf = {
            "server_name": node.name,
            "host": "127.0.0.1",
            "port": node.port,
            "http": f"127.0.0.1:{node.monitor_port}",
            "jetstream": {"store_dir": str(node.home / "jetstream")},
            "cluster": {
                "name": CLUSTER,
                "host": "127.0.0.1",
                "port": node.route_port,
                "routes": [f"nats-route://127.0.0.1:{n.route_port}" for n in self.nodes if n is not node],
            },
        }
        (node.home / "nats.conf").write_text(json.dumps(conf))
        argv = [find_binary(), "-c", str(node.home / "nats.conf"), "-l", str(node.home / "nats.log")]
        node.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def kill(self, node: Node) -> None:
        assert node.process is not None
        node.process.kill()
        node.process.wait()

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.terminate()
                try:
                    node.process.wait(10)
                except subprocess.TimeoutExpired:
                    node.process.kill()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every node sees the same JetStream meta leader among three peers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                metas = [n.jsz().get("meta_cluster", {}) for n in self.nodes]
            except OSError:
                metas = []
            leaders = {m.get("leader") for m in metas}
            if metas and len(leaders) == 1 and None not in leaders and all(m.get("cluster_size") == 3 for m in metas):
                return
            time.sleep(0.2)
        raise RuntimeError(f"no JetStream meta leader within {timeout:.0f}s: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {n.name}\n{(n.home / 'nats.log').read_text(errors='replace')[-2000:]}" for n in self.nodes
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    running = Cluster(tmp_path_factory.mktemp("cluster"))
    for node in running.nodes:
        running.start(node)
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def system(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, cluster: Cluster, system_control: Any
) -> Iterator[Any]:
    start_system, stop_system = system_control
    running = start_system(
        tmp_path_factory.mktemp("pd-cluster"),
        tiny_model_dir,
        cluster.urls,
        "--js-replicas",
        "3",
        "--stall-timeout",
        "4",
    )
    yield running
    stop_system(running)


async def _infos(urls: str, model: str) -> dict[str, Any]:
    nc = await nats.connect(urls.split(","))
    try:
        js = nc.jetstream()
        return {
            "requests": await js.stream_info(subjects.REQUEST_STREAM),
            "kv": await js.stream_info(subjects.KV_STREAM),
            "dead": await js.stream_info(subjects.DEAD_STREAM),
            "registry": await js.stream_info(subjects.bucket_stream(subjects.WORKER_BUCKET)),
            "prefill": await js.consumer_info(subjects.REQUEST_STREAM, subjects.prefill_consumer(model)),
            "decode": await js.consumer_info(subjects.KV_STREAM, subjects.decode_consumer(model)),
        }
    finally:
        await nc.close()


async def _settled(urls: str, model: str, timeout: float = 30.0) -> dict[str, Any]:
    """The infos once every stream and consumer has a leader and two current replicas."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            infos = await _infos(urls, model)
        except nats.errors.Error:  # a JetStream API request met an election: ask again
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)
            continue
        if all(
            i.cluster is not None
            and i.cluster.leader
            and len(i.cluster.replicas or []) == 2
            and all(p.current and not p.offline for p in i.cluster.replicas or [])
            for i in infos.values()
        ):
            return infos
        if time.monotonic() > deadline:
            return infos
        await asyncio.sleep(0.3)


async def test_pdserve_makes_its_streams_consumers_and_registry_r3(system: Any, cluster: Cluster) -> None:
    infos = await _settled(cluster.urls, system.model_name)
    for what, info in infos.items():
        assert info.cluster is not None and info.cluster.name == CLUSTER, what
        assert info.cluster.leader in {n.name for n in cluster.nodes}, what
        peers = sorted([info.cluster.leader, *(p.name for p in info.cluster.replicas or [])])
        assert peers == ["n0", "n1", "n2"], (what, peers)
        if what in ("prefill", "decode"):
            assert (info.config.num_replicas or 0) in (0, 3), "a consumer keeps its stream's replicas"
        else:
            assert info.config.num_replicas == 3, what


async def test_doctor_reports_the_cluster_and_r3_streams(system: Any, cluster: Cluster) -> None:
    await _settled(cluster.urls, system.model_name)
    findings = await survey(cluster.urls, NatsAuth(), BrokerConfig(replicas=3), system.model_name)
    by_check = {f.check: f for f in findings}
    assert by_check["nats"].status == OK and CLUSTER in by_check["nats"].detail
    assert by_check["jetstream"].status == OK
    for name in (subjects.REQUEST_STREAM, subjects.KV_STREAM, subjects.DEAD_STREAM):
        finding = by_check[f"stream {name}"]
        assert finding.status == OK, finding
        assert "R3" in finding.detail and f"cluster {CLUSTER}: leader" in finding.detail
    assert by_check["registry"].status == OK and "R3" in by_check["registry"].detail
    model = system.model_name
    assert by_check[f"consumer {subjects.REQUEST_STREAM}/{subjects.prefill_consumer(model)}"].status == OK
    # The same streams read by a deployment that asks for R1 are reported as differing.
    single = await survey(cluster.urls, NatsAuth(), BrokerConfig(replicas=1), model)
    differs = next(f for f in single if f.check == f"stream {subjects.REQUEST_STREAM}")
    assert differs.status != OK and "num_replicas 3 (this deployment: 1)" in differs.detail
    assert not [f for f in findings if f.status == FAIL]


async def _wave(url: str, ps: list[list[int]], max_new: int, tag: str, **kw: Any) -> list[Streamed]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=30.0), limits=limits) as client:
        return list(
            await asyncio.gather(*(stream(client, url, p, max_new, f"{tag}-{i}", **kw) for i, p in enumerate(ps)))
        )


async def test_killing_and_restarting_a_node_loses_no_accepted_request(system: Any, cluster: Cluster) -> None:
    n, max_new = 12, 64
    ps = prompts(n, 40, seed=15)
    calm = await _wave(system.url, ps, max_new, "calm")
    assert all(r.complete and len(r.tokens) == max_new for r in calm), [r.error for r in calm]

    infos = await _settled(cluster.urls, system.model_name)
    victim = cluster.node(infos["requests"].cluster.leader)  # the request stream's leader
    killed, restarted = asyncio.Event(), asyncio.Event()
    during: list[Streamed] = []

    async def chaos() -> None:
        await killed.wait()
        cluster.kill(victim)
        # A new request every 0.5 s while the node is down: the first ones meet the
        # election of a new leader among the two nodes left (a few seconds), the later
        # ones a stream that serves again. The node comes back (over its store) once a few
        # were accepted, while they stream.
        served = asyncio.Event()

        async def first_token(s: Streamed) -> None:
            served.set()

        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=30.0), limits=limits) as client:
            tasks, since_served, i = [], 0, 0
            down_until = time.monotonic() + 30
            while since_served < 4 and time.monotonic() < down_until:
                prompt = ps[i % n]
                tasks.append(
                    asyncio.create_task(
                        stream(client, system.url, prompt, max_new, f"during-{i}", on_event=first_token)
                    )
                )
                i += 1
                since_served += served.is_set()
                await asyncio.sleep(0.5)
            cluster.start(victim)
            restarted.set()
            during.extend(await asyncio.gather(*tasks))

    async def on_event(s: Streamed) -> None:
        if len(s.tokens) >= 8:
            killed.set()

    task = asyncio.create_task(chaos())
    before = await _wave(system.url, ps, max_new, "before", on_event=on_event)
    await asyncio.wait_for(task, 300)
    assert killed.is_set() and restarted.is_set()
    await _settled(cluster.urls, system.model_name, timeout=60)  # the node is back and caught up
    after = await _wave(system.url, ps, max_new, "after")

    accepted = [r for r in (*before, *during, *after) if r.status == 200]
    assert any(r.status == 200 for r in during), "two nodes of three serve: requests are accepted again"
    unfinished = [
        (r.rid, r.status, r.error, len(r.tokens)) for r in accepted if not (r.complete and len(r.tokens) == max_new)
    ]
    assert not unfinished, f"accepted but not completed: {unfinished}\n{system.log()[-3000:]}"
    assert all(r.status == 200 for r in before), "these were accepted before the kill"
    assert all(r.status == 200 for r in after), [(r.status, r.error) for r in after]
    # Refused while the stream had no leader: 503 with Retry-After, never a 500.
    refused = [r for r in during if r.status != 200]
    assert all(r.status == 503 and "broker_unavailable" in (r.error or "") for r in refused), [
        (r.status, r.error) for r in refused
    ]
    for wave in (before, during, after):
        for i, r in enumerate(wave):
            if r.status == 200:
                assert r.tokens == calm[i % n].tokens, f"{r.rid} differs from an undisturbed run"

    # The node came back over its store and caught up: three current copies again.
    infos = await _settled(cluster.urls, system.model_name, timeout=60)
    for what, info in infos.items():
        peers = info.cluster.replicas or []
        assert len(peers) == 2 and all(p.current and not p.offline for p in peers), (what, info.cluster)
