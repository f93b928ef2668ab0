"""A cluster on one machine: each node a network namespace with an address of its own and a rate-limited
full-duplex link to a shared switch, so that a multi-node torchrun job crosses a slow network between its
nodes while the ranks of one node still talk over that node's fast loopback (Linux, as root).

    with NetnsCluster(nodes=2, rate="200mbit") as cluster:
        before = cluster.link_counters()
        agents = cluster.launch(["t5forge", "train", ...], processes=2)
        sent = [after["tx_bytes"] - b["tx_bytes"] for after, b in zip(cluster.link_counters(), before)]

A "switch" namespace holds a bridge; node i's namespace holds `lo` and a veth `eth0` with the address
198.18.K.(i+1)/24, whose other end is a port of the bridge. 198.18.0.0/15 is reserved for benchmarking
(RFC 2544), so it is nobody's real network. Nothing is created in this machine's own namespace: deleting
the namespaces deletes every link and queue with them. Their names carry this process's id, so that the
namespaces of a run killed by SIGKILL, which cannot clean up, are swept by the next cluster."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import signal
import subprocess
import threading

from t5forge.errors import ConfigError
from t5forge.lifecycle import launch

INTERFACE = "eth0"
_PREFIX = "t5f"
_SUBNETS = 512  # the /24s of 198.18.0.0/15
_OWNER = re.compile(rf"{_PREFIX}-(\d+)-")  # t5f-PID-...: the process that made the namespace
_SUBNET = re.compile(rf"{_PREFIX}-\d+-(\d+)-")  # t5f-PID-K-sw, t5f-PID-K-nI: the cluster on 198.18.0.0/15's K-th /24
_RATE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]i?)?(bit|bps)", re.IGNORECASE)


@functools.cache
def unavailable_reason() -> str | None:
    """Why no NetnsCluster can be built here (one line), or None. Found by making (and deleting) a namespace
    with a tbf queue: capabilities, a seccomp filter or a missing sch_tbf module all show only by trying."""
    for tool in ("ip", "tc"):
        try:
            subprocess.run([tool, "-V"], capture_output=True, check=True)
        except (OSError, subprocess.CalledProcessError):
            return f"`{tool}` not found"
    probe = f"{_PREFIX}-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return ("creating a network namespace needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN): "
                + _first_line(made.stderr))
    try:
        shaped = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", *_tbf("1mbit")],
                                capture_output=True, text=True)
    finally:
        _delete([probe])
    if shaped.returncode != 0:
        return f"tc cannot add a tbf queue (kernel module sch_tbf?): {_first_line(shaped.stderr)}"
    return None


class NetnsCluster:
    """`nodes` network namespaces ("nodes") joined by a switch through links of `rate` (tc's syntax:
    "200mbit", "1gbit"; None: as fast as the CPU copies) each way, removed on leaving the context however
    it is left: normally, by an exception (KeyboardInterrupt included) or by SIGTERM. `subnet_index`: the
    /24 of 198.18.0.0/15 (0-511) that the nodes' addresses are taken from (default: one that no cluster on
    this machine uses).

    Inside the context: `namespaces` (node i's), `addresses` (node i's IPv4 address), `switch` (the
    namespace of the bridge, whose port to node i is `n{i}`) and `interface` (each node's NIC, "eth0")."""

    interface = INTERFACE

    def __init__(self, nodes: int, rate: str | None = None, subnet_index: int | None = None):
        if not 1 <= nodes <= 254:
            raise ConfigError(f"a cluster has 1 to 254 nodes (one /24), not {nodes}")
        if subnet_index is not None and not 0 <= subnet_index < _SUBNETS:
            raise ConfigError(f"subnet_index {subnet_index} is not one of the {_SUBNETS} /24s of 198.18.0.0/15 "
                              f"(0-{_SUBNETS - 1})")
        self.nodes = nodes
        self.rate = rate
        self.subnet_index = subnet_index
        self._shaping = [] if rate is None else _tbf(rate)  # a rate not in tc's syntax fails before anything is made
        self.namespaces: list[str] = []
        self.addresses: list[str] = []
        self.switch = ""
        self._created: list[str] = []
        self._previous_handler = None

    def __enter__(self) -> NetnsCluster:
        reason = unavailable_reason()
        if reason is not None:
            raise ConfigError(f"cannot build a network namespace cluster here: {reason}")
        _sweep_stale()
        subnet = self._free_subnet()
        name = f"{_PREFIX}-{os.getpid()}-{subnet}"
        self.switch = f"{name}-sw"
        self.namespaces = [f"{name}-n{i}" for i in range(self.nodes)]
        self.addresses = [f"198.{18 + subnet // 256}.{subnet % 256}.{i + 1}" for i in range(self.nodes)]
        # Signal handlers can only be set from the main thread; None: a handler set outside Python, which
        # could not be put back.
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is not None:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._build()
        except BaseException:  # __exit__ is not called when __enter__ fails
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Delete the namespaces (and with them every link and queue) and put back the SIGTERM handler."""
        created, self._created = self._created, []
        if self._previous_handler is not None:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:  # not a handler set after ours
                signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
        _delete(created)

    def prefix(self, node: int) -> list[str]:
        """The command prefix that runs a command on `node`."""
        return ["ip", "netns", "exec", self.namespaces[node]]

    def link_counters(self) -> list[dict[str, int]]:
        """Per node, the bytes its NIC has sent (tx_bytes) and received (rx_bytes) so far: the difference
        around a run is what crossed the network (ranks of one node talk over its loopback)."""
        counters = []
        for namespace in self.namespaces:
            link, = json.loads(_run("ip", "-n", namespace, "-s", "-j", "link", "show", INTERFACE))
            counters.append({"tx_bytes": link["stats64"]["tx"]["bytes"], "rx_bytes": link["stats64"]["rx"]["bytes"]})
        return counters

    def launch(self, command: list[str], processes: int, capture: bool = False,
               scratch: str | os.PathLike | None = None, share_cores: bool = False,
               join_timeout: int = 60, env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
        """`lifecycle.launch` with one torchrun agent on each node, as on a real cluster: the rendezvous on
        node 0, each agent naming its own address (the namespaces share this machine's hostname, which
        resolves to none of them) and gloo bound to eth0 (it would look up the hostname too). An agent
        that cannot meet the others within `join_timeout` seconds raises ConfigError. `env`: more variables
        for the agents and their ranks."""
        return launch(command, processes, nodes=self.nodes, capture=capture, scratch=scratch, share_cores=share_cores,
                      node_prefixes=[self.prefix(i) for i in range(self.nodes)], node_addresses=self.addresses,
                      rendezvous_timeout=join_timeout, env={**(env or {}), "GLOO_SOCKET_IFNAME": INTERFACE})

    def _free_subnet(self) -> int:
        # Clusters of other processes could take the same /24 (their namespaces never meet); choosing a free
        # one keeps every node's address unique on this machine, and the namespace names of this process apart.
        used = {int(m[1]) for namespace in _namespaces() if (m := _SUBNET.match(namespace))}
        if self.subnet_index is not None:
            if self.subnet_index in used:
                raise ConfigError(f"subnet_index {self.subnet_index} is in use by another cluster on this machine; "
                                  "leave it unset to take a free one")
            return self.subnet_index
        free = next((k for k in range(_SUBNETS) if k not in used), None)
        if free is None:
            raise ConfigError(f"all {_SUBNETS} /24s of 198.18.0.0/15 are in use by clusters on this machine")
        return free

    def _build(self) -> None:
        switch = self.switch
        self._add_namespace(switch)
        # Idle links stay silent, so that the link counters count the job's bytes only: no IPv6 address
        # anywhere (addrgenmode none, set before `up`), whose neighbour discovery would talk, and no
        # multicast snooping on the bridge, which joins groups (and reports them) of its own.
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        _run("ip", "-n", switch, "link", "set", "br0", "addrgenmode", "none")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for i, (namespace, address) in enumerate(zip(self.namespaces, self.addresses)):
            port = f"n{i}"
            self._add_namespace(namespace)
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            _run("ip", "-n", namespace, "link", "add", INTERFACE, "type", "veth", "peer", "name", port, "netns", switch)
            _run("ip", "-n", namespace, "address", "add", f"{address}/24", "dev", INTERFACE)
            _run("ip", "-n", namespace, "link", "set", INTERFACE, "addrgenmode", "none")
            _run("ip", "-n", namespace, "link", "set", INTERFACE, "up")
            _run("ip", "-n", switch, "link", "set", port, "master", "br0", "addrgenmode", "none")
            _run("ip", "-n", switch, "link", "set", port, "up")
            if self._shaping:  # a queue on each end's egress: node -> switch and switch -> node
                _run("tc", "-n", namespace, "qdisc", "add", "dev", INTERFACE, "root", *self._shaping)
                _run("tc", "-n", switch, "qdisc", "add", "dev", port, "root", *self._shaping)

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def _on_sigterm(self, signum, frame) -> None:
        """Remove the cluster, then do what SIGTERM did before: by default, end the process (of SIGTERM)."""
        previous = self._previous_handler
        try:
            self.close()
        finally:
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)


def _tbf(rate: str) -> list[str]:
    """tc arguments of a token bucket of `rate`. burst: tokens come in between timer ticks (1/HZ; HZ is 100
    to 1000, 250 on common kernels), so a bucket smaller than rate/250 falls short of `rate`; and one
    smaller than 64 KiB would make tbf split in software the GSO packets of up to 64 KiB that veth hands
    it. latency: how long a packet may queue, the buffer of a switch port: 50 ms keeps a link full when two
    nodes send to one (measured from 50mbit to 10gbit), and a small message's wait behind bulk short."""
    burst = max(64 * 1024, int(_bytes_per_second(rate) / 250))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def _bytes_per_second(rate: str) -> float:
    """A rate in tc's syntax: bit or bps (bytes) per second, after k, m, g, t (x1000) or ki, mi, gi, ti (x1024)."""
    match = _RATE.fullmatch(rate.strip())
    if match is None:
        raise ConfigError(f"rate {rate!r} is not in tc's syntax with a unit, such as '200mbit', '1gbit' or '20mbps' "
                          "(bytes per second)")
    number, multiple, unit = match[1], (match[2] or "").lower(), match[3].lower()
    scale = (1024 if multiple.endswith("i") else 1000) ** ("kmgt".index(multiple[0]) + 1) if multiple else 1
    return float(number) * scale / (8 if unit == "bit" else 1)


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


def _sweep_stale() -> None:
    """Delete the namespaces left by processes that are gone: one killed by SIGKILL could not."""
    _delete([name for name in _namespaces() if (m := _OWNER.match(name)) and not _alive(int(m[1]))])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, and someone else's
        return True
    return True


def _delete(namespaces: list[str]) -> None:
    """Delete `namespaces` (their links go with them) with one `ip`, which goes on past a failure: one
    already gone (a concurrent sweep) is no error, one left is."""
    if not namespaces:
        return
    deleted = subprocess.run(["ip", "-force", "-batch", "-"], input="".join(f"netns delete {n}\n" for n in namespaces),
                             capture_output=True, text=True)
    left = sorted(set(namespaces) & set(_namespaces()))
    if left:
        raise ConfigError(f"could not delete the network namespaces {', '.join(left)}: {_first_line(deleted.stderr)}")


def _run(*command: str) -> str:
    """The output of an `ip` or `tc` command; its failure is a ConfigError with the first line of its stderr."""
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout
    except subprocess.CalledProcessError as e:
        raise ConfigError(f"`{shlex.join(command)}` failed: {_first_line(e.stderr)}") from None


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "(no message)")
