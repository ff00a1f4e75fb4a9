"""The network of a training job over several hosts: on each host, the job's ranks run in a network
namespace of the job's own, and only the job's other hosts' ranks reach them.

Host N of the job gives its ranks the address .2 of the Nth /24 of `finetune.training_subnet`
(the host side of their link is .1), routes the other hosts' /24s to those hosts' cluster
addresses, and forwards between the ranks and the cluster network only
- new TCP connections from its ranks to another host's ranks, and to its ranks from another host's,
  on the rendezvous port or the collective ports (inside the namespace the kernel gives every
  socket a port from COLLECTIVE_PORTS, so gloo's and NCCL's listeners are there),
- and the replies of those connections.
Anything else from the ranks is dropped: the host itself (its gateway, Keycloak, PostgreSQL, SSH),
the head's services, other hosts' services, DNS and the internet. The rules live in an nftables
table of the job's own (`appliance-train-JOB`); forwarding is turned on for the ranks' link and
the cluster interface only, and put back as it was when the job's network is taken down.

All of it needs root: a job over several hosts is refused when the appliance does not run as root.
A site firewall that drops forwarded packets must let the training subnet through between hosts.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

from appliance.errors import ApplianceError

LOCKS = Path("/run/lock/appliance")  # root's: one lock a host for its training network
RENDEZVOUS_PORT = 29400  # torchrun's c10d store, on the head's ranks' address
COLLECTIVE_PORTS = (29500, 29999)  # every port a rank's socket gets inside the namespace
INTERFACE = re.compile(r"[A-Za-z0-9_.-]{1,15}")


class TrainingNetworkError(ApplianceError):
    """A job's network could not be set up on this host."""


@dataclass(frozen=True)
class JobNetwork:
    """One host's view of a job's network."""

    job: int  # the job's id: names the namespace, the links and the rules
    node: int  # this host's place in the job (0: the head)
    hosts: tuple[str, ...]  # each host's cluster address, by place
    subnet: IPv4Network  # finetune.training_subnet

    def __post_init__(self) -> None:
        if not 0 <= self.node < len(self.hosts) <= 256 or self.job < 0:
            raise TrainingNetworkError(f"host {self.node} of {len(self.hosts)} (at most 256) in job {self.job}")

    @property
    def namespace(self) -> str:
        return f"ap-train-{self.job}-{self.node}"  # named with the host's place: tests run two on one machine

    @property
    def host_link(self) -> str:
        return f"atj{self.job}h"[:15]

    @property
    def rank_link(self) -> str:
        return f"atj{self.job}r"[:15]

    @property
    def table(self) -> str:
        return f"appliance-train-{self.job}"

    def block(self, node: int) -> IPv4Network:
        return IPv4Network((int(self.subnet.network_address) + (node << 8), 24))

    def ranks_address(self, node: int) -> IPv4Address:
        return self.block(node).network_address + 2

    def link_address(self, node: int) -> IPv4Address:
        return self.block(node).network_address + 1

    @property
    def rendezvous(self) -> str:
        """torchrun's --rdzv-endpoint: the head's ranks' address and the rendezvous port."""
        return f"{self.ranks_address(0)}:{RENDEZVOUS_PORT}"

    def inside(self) -> list[str]:
        """What runs a command in the ranks' namespace."""
        return ["ip", "netns", "exec", self.namespace]


def ruleset(net: JobNetwork, uplink: str, *, guard_uplink: bool) -> str:
    """The job's nftables table: what may cross between its ranks and the cluster network.
    `guard_uplink`: forwarding was off on the cluster interface and is turned on for the job, so
    nothing else arriving there may be forwarded."""
    # The other hosts' ranks' own addresses, never their /24s: the .1 of each is that host itself.
    peers = ", ".join(str(net.ranks_address(node)) for node in range(len(net.hosts)) if node != net.node)
    ports = f"{RENDEZVOUS_PORT}, {COLLECTIVE_PORTS[0]}-{COLLECTIVE_PORTS[1]}"
    link = net.host_link
    rules = [
        f'iifname "{link}" oifname "{uplink}" ip daddr {{ {peers} }} tcp dport {{ {ports} }} ct state new accept',
        f'iifname "{uplink}" oifname "{link}" ip saddr {{ {peers} }} tcp dport {{ {ports} }} ct state new accept',
        f'iifname "{link}" oifname "{uplink}" ct state established,related accept',
        f'iifname "{uplink}" oifname "{link}" ct state established,related accept',
        f'iifname "{link}" drop',
        f'oifname "{link}" drop',
    ]
    if guard_uplink:
        rules.append(f'iifname "{uplink}" drop')
    forward = "\n".join(f"    {rule}" for rule in rules)
    return (f"table inet {net.table} {{\n"
            f"  chain forward {{\n    type filter hook forward priority filter; policy accept;\n{forward}\n  }}\n"
            f"  chain input {{\n    type filter hook input priority filter; policy accept;\n"
            f'    iifname "{link}" drop\n'
            f'    iifname "{uplink}" ip saddr {net.subnet} drop\n  }}\n'
            "}\n")


class Host:
    """Commands on this host (or, for tests, in the network namespace `prefix` enters); `anywhere`
    ones (named namespaces: made, entered, removed) are the machine's and take no prefix."""

    def __init__(self, prefix: Sequence[str] = ()) -> None:
        self.prefix = list(prefix)

    def run(self, *command: str, stdin: str | None = None, check: bool = True, anywhere: bool = False) -> str:
        done = subprocess.run([*([] if anywhere else self.prefix), *command], input=stdin, capture_output=True,
                              text=True, check=False)
        if check and done.returncode != 0:
            raise TrainingNetworkError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}",
                                       hint="a job over several hosts needs root, iproute2 and nftables")
        return done.stdout

    def read(self, path: Path) -> str:
        return self.run("cat", str(path)).strip()

    def write(self, path: Path, value: str) -> None:
        self.run("tee", str(path), stdin=value)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """This host's training network held for one job: a lock named by the host's network
        namespace (tests run several hosts on one machine, sharing its files)."""
        namespace = self.run("stat", "-L", "-c", "%i", "/proc/self/ns/net").strip()
        if not namespace.isdigit():
            raise TrainingNetworkError(f"this host's network namespace could not be told: {namespace!r}")
        LOCKS.mkdir(parents=True, exist_ok=True)
        handle = os.open(LOCKS / f"training-network-{namespace}.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW,
                         0o600)
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise TrainingNetworkError("another training job over several hosts runs on this host; one at a time",
                                           hint="wait for it to end (appliance finetune status)") from None
            yield
        finally:
            os.close(handle)

    def uplink(self, peer: str) -> str:
        """The interface this host reaches `peer` through."""
        found = re.search(r"\bdev (\S+)", self.run("ip", "-o", "route", "get", peer))
        if found is None or not INTERFACE.fullmatch(found.group(1)):
            raise TrainingNetworkError(f"no route from this host to the job's host {peer}")
        return found.group(1)


def forwarding(interface: str) -> Path:
    return Path("/proc/sys/net/ipv4/conf") / interface / "forwarding"


@contextmanager
def job_network(net: JobNetwork, host: Host | None = None) -> Iterator[JobNetwork]:
    """The job's network on this host for as long as the block runs; taken down after, whatever
    happened (and before, where an earlier run of the job left one). One job at a time on a host
    (its rules and forwarding are the host's): a second is refused while the first runs."""
    host = host or Host()
    others = [address for node, address in enumerate(net.hosts) if node != net.node]
    uplink = host.uplink(others[0]) if others else "lo"
    with host.exclusive():
        clear_stale(host)
        take_down(net, host)
        restore: dict[str, str] = {}
        try:
            _bring_up(net, host, uplink, restore)
            yield net
        finally:
            take_down(net, host, restore)


def _bring_up(net: JobNetwork, host: Host, uplink: str, restore: dict[str, str]) -> None:
    node, ns = net.node, net.namespace
    host.run("ip", "netns", "add", ns, anywhere=True)
    host.run("ip", "link", "add", net.host_link, "type", "veth", "peer", "name", net.rank_link)
    host.run("ip", "link", "set", net.rank_link, "netns", ns)
    host.run("ip", "addr", "add", f"{net.link_address(node)}/24", "dev", net.host_link)
    host.run("ip", "link", "set", net.host_link, "up")
    for command in (["addr", "add", f"{net.ranks_address(node)}/24", "dev", net.rank_link],
                    ["link", "set", net.rank_link, "up"], ["link", "set", "lo", "up"],
                    ["route", "add", "default", "via", str(net.link_address(node))]):
        host.run("ip", "-n", ns, *command, anywhere=True)
    host.run(*net.inside(), "tee", "/proc/sys/net/ipv4/ip_local_port_range",
             stdin=f"{COLLECTIVE_PORTS[0]} {COLLECTIVE_PORTS[1]}", anywhere=True)
    guard_uplink = False
    for interface in (net.host_link, uplink):
        before = host.read(forwarding(interface))
        if before != "1":
            restore[interface] = before
            host.write(forwarding(interface), "1")
            guard_uplink = guard_uplink or interface == uplink
    host.run("nft", "-f", "-", stdin=ruleset(net, uplink, guard_uplink=guard_uplink))
    for peer, address in ((n, a) for n, a in enumerate(net.hosts) if n != node):
        host.run("ip", "route", "replace", str(net.block(peer)), "via", address)


def clear_stale(host: Host) -> None:
    """Remove the rules and links of jobs that ended without taking their network down (a host that
    lost power): their routes would take the next job's subnet. A host runs one training job at
    a time, so any left here is stale."""
    for name in re.findall(r"^table inet (appliance-train-\d+)$", host.run("nft", "list", "tables"), re.MULTILINE):
        host.run("nft", "delete", "table", "inet", name, check=False)
    for name in re.findall(r"^\d+: (atj\d+h)[@:]", host.run("ip", "-o", "link", "show"), re.MULTILINE):
        host.run("ip", "link", "del", name, check=False)


def take_down(net: JobNetwork, host: Host, restore: dict[str, str] | None = None) -> None:
    """Remove what job_network set up, as far as it is there; forwarding put back as it was."""
    host.run("nft", "delete", "table", "inet", net.table, check=False)
    for peer in (n for n in range(len(net.hosts)) if n != net.node):
        host.run("ip", "route", "del", str(net.block(peer)), check=False)
    for interface, value in (restore or {}).items():
        if interface != net.host_link:
            host.write(forwarding(interface), value)
    host.run("ip", "link", "del", net.host_link, check=False)  # takes its peer with it
    host.run("ip", "netns", "del", net.namespace, check=False, anywhere=True)
