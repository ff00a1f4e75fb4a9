"""A second "host" for tests and benchmarks: a network namespace joined to this one by a veth pair
on a /30 of its own, and nothing else."""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Network:
    namespace: str
    head: str  # this namespace's address on the pair
    worker: str  # the other end's, inside `namespace`


@contextmanager
def veth_namespace() -> Iterator[Network]:
    tag = f"{random.randrange(1 << 16):04x}"
    subnet = f"10.231.{random.randrange(256)}"
    net = Network(namespace=f"ap-worker-{tag}", head=f"{subnet}.1", worker=f"{subnet}.2")
    here, there = f"apc{tag}a", f"apc{tag}b"
    inside = ["ip", "netns", "exec", net.namespace]
    commands = [["ip", "netns", "add", net.namespace],
                ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
                ["ip", "link", "set", there, "netns", net.namespace],
                ["ip", "addr", "add", f"{net.head}/30", "dev", here], ["ip", "link", "set", here, "up"],
                [*inside, "ip", "addr", "add", f"{net.worker}/30", "dev", there],
                [*inside, "ip", "link", "set", there, "up"], [*inside, "ip", "link", "set", "lo", "up"]]
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, text=True)
        yield net
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)  # takes its peer with it
        subprocess.run(["ip", "netns", "del", net.namespace], capture_output=True)
