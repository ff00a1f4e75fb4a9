"""A training job's network over two hosts (this namespace as the head, a veth namespace as the
worker): each host's ranks, in a namespace of the job's own, reach the other host's ranks on the
rendezvous and collective ports and nothing else: not the ports outside them, not their own host's
or the head's services, not an address beyond the worker; their sockets get ports from the
collective range; taking the network down leaves nothing behind."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from ipaddress import IPv4Network
from pathlib import Path

import pytest

from appliance.settings import FinetuneSettings
from finetune.sandbox import prepare, sandboxed
from finetune.training_network import (
    COLLECTIVE_PORTS,
    RENDEZVOUS_PORT,
    Host,
    JobNetwork,
    TrainingNetworkError,
    job_network,
)
from tests.support.netns import Network, veth_namespace
from tests.support.shared import locked

SUBNET = IPv4Network("10.77.0.0/16")
PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print("open")
except socket.timeout:
    print("dropped")
except ConnectionRefusedError:
    print("refused")
except OSError as exc:
    print(f"unreachable {exc.errno}")
"""
BOUND_PROBE = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 0))
s.settimeout(2)
try:
    s.connect((sys.argv[2], int(sys.argv[3])))
    print("open")
except socket.timeout:
    print("dropped")
except OSError as exc:
    print(f"refused {exc.errno}")
"""
LISTEN = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print(s.getsockname()[1], flush=True)
s.settimeout(0.5)
end = time.monotonic() + 120
while time.monotonic() < end:
    try:
        s.accept()[0].close()
    except socket.timeout:
        pass
"""


def probe(where: list[str], address: str, port: int) -> str:
    return subprocess.run([*where, sys.executable, "-c", PROBE, address, str(port)], capture_output=True,
                          text=True, timeout=30).stdout.strip()


@dataclass
class Listener:
    process: subprocess.Popen[str]
    port: int

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def listen(where: list[str], address: str, port: int) -> Listener:
    """A TCP listener at `address`:`port` (0: the kernel's choice) in the namespace `where` enters."""
    process = subprocess.Popen([*where, sys.executable, "-c", LISTEN, address, str(port)], stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout is not None
    return Listener(process, int(process.stdout.readline()))


@pytest.fixture(scope="module", autouse=True)
def one_training_network_at_a_time() -> Iterator[None]:
    """This machine's root namespace is every test's head host: one job network on it at a time."""
    with locked("training-network", exclusive=True):
        yield


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[tuple[Network, JobNetwork, JobNetwork]]:
    job = random.randrange(1 << 20)
    with veth_namespace() as net:
        worker_host = Host(["ip", "netns", "exec", net.namespace])
        head = JobNetwork(job=job, node=0, hosts=(net.head, net.worker), subnet=SUBNET)
        worker = JobNetwork(job=job, node=1, hosts=(net.head, net.worker), subnet=SUBNET)
        with job_network(head), job_network(worker, worker_host):
            yield net, head, worker


def test_the_ranks_reach_each_other_on_the_job_s_ports_only(two_hosts: tuple[Network, JobNetwork, JobNetwork]
                                                            ) -> None:
    _, head, worker = two_hosts
    head_ranks = str(head.ranks_address(0))
    listeners = [listen(head.inside(), head_ranks, port) for port in (RENDEZVOUS_PORT, COLLECTIVE_PORTS[0], 8443)]
    try:
        assert probe(worker.inside(), head_ranks, RENDEZVOUS_PORT) == "open"
        assert probe(worker.inside(), head_ranks, COLLECTIVE_PORTS[0]) == "open"
        assert probe(worker.inside(), head_ranks, 8443) == "dropped"  # listening, but not a port of the job's
    finally:
        for listener in listeners:
            listener.kill()


def test_the_ranks_reach_no_host_s_services(two_hosts: tuple[Network, JobNetwork, JobNetwork]) -> None:
    """The head's services (its cluster address, its loopback) and the worker host's own."""
    net, head, worker = two_hosts
    gateway = listen([], "0.0.0.0", 0)
    try:
        with socket.create_connection(("127.0.0.1", port := gateway.port), timeout=2):
            pass  # it serves this host
        assert probe(worker.inside(), net.head, port) == "dropped"
        assert probe(head.inside(), net.head, port) == "dropped"
        assert probe(head.inside(), str(head.link_address(0)), port) == "dropped"
        assert probe(head.inside(), "127.0.0.1", port) == "refused"  # the namespace's own loopback: nothing there
        assert probe(worker.inside(), net.head, RENDEZVOUS_PORT) == "dropped"  # a job port, but the host's
    finally:
        gateway.kill()


def test_a_rank_reaches_no_other_host_itself_nor_a_host_s_user_a_rank(
        two_hosts: tuple[Network, JobNetwork, JobNetwork]) -> None:
    """The other host's own end of its ranks' link (.1 of its /24, where its services answer) is
    not a rank; nor is a local user on a host who binds that host's end of the link."""
    _, head, worker = two_hosts
    service = listen([], "0.0.0.0", COLLECTIVE_PORTS[0] + 1)  # a service of the head host on a job port
    ranks = listen(worker.inside(), str(worker.ranks_address(1)), RENDEZVOUS_PORT)
    try:
        assert probe(worker.inside(), str(head.link_address(0)), service.port) == "dropped"
        bound = subprocess.run([sys.executable, "-c", BOUND_PROBE, str(head.link_address(0)),
                                str(worker.ranks_address(1)), str(RENDEZVOUS_PORT)],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        assert bound == "dropped"
    finally:
        service.kill()
        ranks.kill()


def test_a_second_job_s_network_on_a_host_is_refused_while_the_first_runs(
        two_hosts: tuple[Network, JobNetwork, JobNetwork]) -> None:
    _, head, _ = two_hosts
    other = JobNetwork(job=head.job + 1, node=0, hosts=head.hosts, subnet=SUBNET)
    with pytest.raises(TrainingNetworkError, match="another training job over several hosts runs on this host"):
        with job_network(other):
            pass
    assert head.table in Host().run("nft", "list", "tables")  # the first job's rules untouched


def test_nothing_beyond_the_job_s_hosts_is_reached(two_hosts: tuple[Network, JobNetwork, JobNetwork]) -> None:
    """An address the worker host routes to (a third namespace standing for the internet): the
    worker host reaches it, its ranks do not, not even on a job port."""
    net, _, worker = two_hosts
    outside, link = f"ap-out-{random.randrange(1 << 16):04x}", f"apo{random.randrange(1 << 16):04x}"
    host = ["ip", "netns", "exec", net.namespace]
    try:
        for command in (["ip", "netns", "add", outside],
                        [*host, "ip", "link", "add", f"{link}a", "type", "veth", "peer", "name", f"{link}b"],
                        [*host, "ip", "link", "set", f"{link}b", "netns", outside],
                        [*host, "ip", "addr", "add", "198.51.100.1/24", "dev", f"{link}a"],
                        [*host, "ip", "link", "set", f"{link}a", "up"],
                        ["ip", "-n", outside, "addr", "add", "198.51.100.2/24", "dev", f"{link}b"],
                        ["ip", "-n", outside, "link", "set", f"{link}b", "up"]):
            subprocess.run(command, check=True, capture_output=True)
        there = listen(["ip", "netns", "exec", outside], "198.51.100.2", RENDEZVOUS_PORT)
        try:
            assert probe(host, "198.51.100.2", RENDEZVOUS_PORT) == "open"
            assert probe(worker.inside(), "198.51.100.2", RENDEZVOUS_PORT) == "dropped"
        finally:
            there.kill()
    finally:
        subprocess.run(["ip", "netns", "del", outside], capture_output=True)


def test_from_inside_a_rank_s_sandbox_only_the_peer_s_job_ports_are_reached(
        two_hosts: tuple[Network, JobNetwork, JobNetwork], tmp_path: Path) -> None:
    """The training sandbox (bubblewrap, the sandbox's user) in the worker's namespace of the job."""
    net, head, worker = two_hosts
    head_ranks = str(head.ranks_address(0))
    listeners = [listen(head.inside(), head_ranks, port) for port in (RENDEZVOUS_PORT, 8443)]
    gateway = listen([], "0.0.0.0", 0)
    workdir = tmp_path / "job"
    workdir.mkdir()
    prepare(workdir, [], [])

    def from_sandbox(address: str, port: int) -> str:
        command = sandboxed([sys.executable, "-c", PROBE, address, str(port)], FinetuneSettings(), workdir=workdir,
                            inputs=[], readable=[], network=worker.namespace)
        return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout.strip()

    try:
        assert from_sandbox(head_ranks, RENDEZVOUS_PORT) == "open"
        assert from_sandbox(head_ranks, 8443) == "dropped"
        assert from_sandbox(net.head, gateway.port) == "dropped"
        assert from_sandbox(net.worker, 22) == "dropped"  # the worker host itself
    finally:
        for listener in [*listeners, gateway]:
            listener.kill()


def test_a_rank_s_sockets_get_ports_from_the_collective_range(two_hosts: tuple[Network, JobNetwork, JobNetwork]
                                                              ) -> None:
    _, head, _ = two_hosts
    listener = listen(head.inside(), str(head.ranks_address(0)), 0)
    try:
        assert COLLECTIVE_PORTS[0] <= listener.port <= COLLECTIVE_PORTS[1]
    finally:
        listener.kill()


def test_taking_the_network_down_leaves_nothing_and_puts_forwarding_back() -> None:
    with veth_namespace() as net:
        worker_host = Host(["ip", "netns", "exec", net.namespace])
        uplink = worker_host.uplink(net.head)
        before = worker_host.read(_forwarding(uplink))
        worker = JobNetwork(job=random.randrange(1 << 20), node=1, hosts=(net.head, net.worker), subnet=SUBNET)
        with job_network(worker, worker_host):
            assert worker_host.read(_forwarding(uplink)) == "1"
            assert worker.table in worker_host.run("nft", "list", "tables")
        assert worker_host.read(_forwarding(uplink)) == before
        assert worker.table not in worker_host.run("nft", "list", "tables")
        assert worker.namespace not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert str(worker.block(0)) not in worker_host.run("ip", "route")
        assert worker.host_link not in worker_host.run("ip", "-o", "link")


def _forwarding(interface: str) -> Path:
    from finetune.training_network import forwarding

    return forwarding(interface)


def test_a_job_that_ended_without_taking_its_network_down_leaves_nothing_in_the_next_s_way() -> None:
    """A host that lost power mid-job: its rules and its link (whose route would take the next
    job's subnet) are removed when the next job's network comes up."""
    with veth_namespace() as net:
        worker_host = Host(["ip", "netns", "exec", net.namespace])
        stale = JobNetwork(job=random.randrange(1 << 20), node=1, hosts=(net.head, net.worker), subnet=SUBNET)
        with job_network(stale, worker_host):
            pass
        worker_host.run("ip", "link", "add", stale.host_link, "type", "veth", "peer", "name", stale.rank_link)
        worker_host.run("ip", "addr", "add", f"{stale.link_address(1)}/24", "dev", stale.host_link)
        worker_host.run("nft", "add", "table", "inet", stale.table)
        fresh = JobNetwork(job=stale.job + 1, node=1, hosts=stale.hosts, subnet=SUBNET)
        with job_network(fresh, worker_host):
            assert stale.table not in worker_host.run("nft", "list", "tables")
            assert stale.host_link not in worker_host.run("ip", "-o", "link")
            assert f"dev {fresh.host_link}" in worker_host.run("ip", "route", "get", str(fresh.ranks_address(1)))

