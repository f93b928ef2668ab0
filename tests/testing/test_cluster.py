"""The local cluster harness (t5forge.testing.cluster): network namespaces with addresses of their own,
shaped links between them, nothing left behind however the harness ends, and a real multi-node torchrun
job across it. Skips, saying why, where namespaces cannot be made (no root, no `ip`)."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from t5forge.errors import ConfigError
from t5forge.testing.cluster import NetnsCluster, unavailable_reason

# python -m all_reduce_module FLOATS: all-reduce (sum) FLOATS floats of value RANK + 1 and report it.
ALL_REDUCE = """import json, os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
x = torch.full((int(sys.argv[1]),), float(dist.get_rank() + 1))
dist.barrier()
start = time.perf_counter()
dist.all_reduce(x)
seconds = time.perf_counter() - start
print(json.dumps({**{key: os.environ[key] for key in ("RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")},
                  "values": x.unique().tolist(), "seconds": seconds}))
dist.destroy_process_group()
"""
# A process that builds a cluster, says its namespaces and waits to be killed.
CHILD = """import time
from t5forge.testing.cluster import NetnsCluster
with NetnsCluster(2, rate="100mbit") as cluster:
    print(*cluster.namespaces, cluster.switch, flush=True)
    time.sleep(60)
"""
ECHO_SERVER = """import socket
server = socket.create_server(("0.0.0.0", 5000))
print("listening", flush=True)
connection, _ = server.accept()
connection.sendall(connection.recv(4).upper())
"""
ECHO_CLIENT = """import socket, sys
connection = socket.create_connection((sys.argv[1], 5000), timeout=10)
connection.sendall(b"ping")
print(connection.recv(4).decode())
"""


@pytest.fixture(autouse=True)
def namespaces_can_be_made():
    if (reason := unavailable_reason()) is not None:
        pytest.skip(reason)


@pytest.fixture
def all_reduce_module(tmp_path, monkeypatch):
    (tmp_path / "all_reduce_module.py").write_text(ALL_REDUCE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "all_reduce_module"


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


def qdiscs(namespace: str, *device: str) -> list[dict]:
    return json.loads(subprocess.run(["tc", "-n", namespace, "-j", "qdisc", "show", *device], capture_output=True,
                                     text=True, check=True).stdout)


def test_two_nodes_have_addresses_shaped_links_and_talk_over_tcp():
    with NetnsCluster(2, rate="200mbit") as cluster:
        assert cluster.namespaces[0].startswith(f"t5f-{os.getpid()}-") and len(set(cluster.namespaces)) == 2
        addresses = [ipaddress.ip_address(a) for a in cluster.addresses]
        assert all(a in ipaddress.ip_network("198.18.0.0/15") for a in addresses)
        assert cluster.addresses[0].endswith(".1") and int(addresses[1]) == int(addresses[0]) + 1
        for namespace, address in zip(cluster.namespaces, cluster.addresses):
            link, = json.loads(subprocess.run(["ip", "-n", namespace, "-j", "address", "show", cluster.interface],
                                              capture_output=True, text=True, check=True).stdout)
            assert [(a["local"], a["prefixlen"]) for a in link["addr_info"]] == [(address, 24)]  # and no IPv6
        # 200mbit = 25 MB/s, each way: out of each node's eth0, and out of the switch's port to each node.
        node_ends = [q for namespace in cluster.namespaces for q in qdiscs(namespace, "dev", cluster.interface)]
        switch_ends = [q for q in qdiscs(cluster.switch) if q["kind"] == "tbf"]
        assert [(q["kind"], q["options"]["rate"]) for q in node_ends + switch_ends] == [("tbf", 25_000_000)] * 4
        assert {q["dev"] for q in switch_ends} == {"n0", "n1"}
        # Idle links are silent: the counters count a job's bytes only.
        assert cluster.link_counters() == [{"tx_bytes": 0, "rx_bytes": 0}] * 2

        server = subprocess.Popen([*cluster.prefix(1), sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert server.stdout.readline() == "listening\n"
            client = subprocess.run([*cluster.prefix(0), sys.executable, "-c", ECHO_CLIENT, cluster.addresses[1]],
                                    capture_output=True, text=True, timeout=30)
            assert (client.returncode, client.stdout) == (0, "PING\n"), client.stderr
        finally:
            server.kill()
            server.wait()
        sent, received = cluster.link_counters()
        assert sent["tx_bytes"] == received["rx_bytes"] > 0
    assert not {n for n in namespaces() if n.startswith(f"t5f-{os.getpid()}-")}


def test_two_clusters_coexist_on_subnets_of_their_own():
    with NetnsCluster(1) as first, NetnsCluster(1) as second:
        assert first.addresses[0].rpartition(".")[0] != second.addresses[0].rpartition(".")[0]
        assert not {*first.namespaces, first.switch} & {*second.namespaces, second.switch}


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_exception_removes_the_cluster_and_restores_the_sigterm_handler(error):
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(error):
        with NetnsCluster(2, rate="100mbit") as cluster:
            created = {*cluster.namespaces, cluster.switch}
            assert created <= namespaces() and signal.getsignal(signal.SIGTERM) != handler
            raise error
    assert not created & namespaces() and signal.getsignal(signal.SIGTERM) == handler


def test_a_failing_command_is_one_config_error_and_leaves_nothing():
    mine = f"t5f-{os.getpid()}-"  # other test processes make and remove clusters meanwhile
    before = {n for n in namespaces() if n.startswith(mine)}
    with pytest.raises(ConfigError, match=r"^`tc -n t5f-\d+-\d+-n0 qdisc add dev eth0 root tbf rate 0bit .*` failed: "
                                          r"[^\n]+$"):
        with NetnsCluster(2, rate="0bit"):  # tc refuses a zero rate, after the first node is made
            pass
    assert {n for n in namespaces() if n.startswith(mine)} == before


def test_sigterm_removes_the_cluster_and_still_ends_the_process():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    created = set(child.stdout.readline().split())
    assert len(created) == 3 and created <= namespaces()
    child.terminate()
    assert child.wait(timeout=30) == -signal.SIGTERM
    assert not created & namespaces()


def test_a_cluster_sweeps_the_namespaces_of_a_killed_process():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    created = set(child.stdout.readline().split())
    child.kill()
    child.wait()
    assert created <= namespaces()  # SIGKILL: no chance to clean up
    with NetnsCluster(1):
        assert not created & namespaces()


@pytest.mark.e2e  # make test runs training on two namespace nodes (tests/distributed/test_equivalence.py)
def test_a_two_node_job_all_reduces_across_the_shaped_links(netns_cluster, all_reduce_module):
    cluster = netns_cluster(2, "200mbit")
    floats = 1_000_000
    before = cluster.link_counters()
    agents = cluster.launch([all_reduce_module, str(floats)], processes=2, capture=True)
    after = cluster.link_counters()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(a.stderr[-3000:] for a in agents)
    nodes = [[json.loads(line) for line in a.stdout.splitlines() if line.startswith("{")] for a in agents]
    # The agents' group ranks follow their addresses: node i is group i, and node 0 has rank 0.
    assert [sorted(int(r["RANK"]) for r in node) for node in nodes] == [[0, 1], [2, 3]]
    assert [{r["GROUP_RANK"] for r in node} for node in nodes] == [{"0"}, {"1"}]
    ranks = [r for node in nodes for r in node]
    assert {(r["WORLD_SIZE"], r["MASTER_ADDR"]) for r in ranks} == {("4", cluster.addresses[0])}
    assert [r["values"] for r in ranks] == [[1.0 + 2 + 3 + 4]] * 4
    # However gloo all-reduces, each node sends the other at least its half to reduce and its reduced
    # half: the tensor's bytes, each way, over eth0 and its 25 MB/s queue.
    size = 4 * floats
    assert all(a["tx_bytes"] - b["tx_bytes"] >= size and a["rx_bytes"] - b["rx_bytes"] >= size
               for a, b in zip(after, before)), (before, after)
    assert max(r["seconds"] for r in ranks) >= 0.5 * size / 25e6


@pytest.mark.e2e
def test_an_unreachable_rendezvous_is_one_config_error_within_the_timeout(netns_cluster, all_reduce_module):
    cluster = netns_cluster(2)
    subprocess.run(["ip", "-n", cluster.namespaces[0], "link", "set", cluster.interface, "down"], check=True)
    start = time.monotonic()
    with pytest.raises(ConfigError) as error:  # node 0's cable pulled: nobody reaches its rendezvous
        cluster.launch([all_reduce_module, "1"], processes=1, capture=True, join_timeout=10)
    elapsed = time.monotonic() - start
    message = str(error.value)
    assert "\n" not in message and f"rendezvous at {cluster.addresses[0]}:29500 within 10 s" in message, message
    # The timeout, plus the agents' start and their store's read timeout (tens of seconds on two busy, slow
    # cores): far short of torchrun's own 600-s join timeout, which a timeout not passed on would wait out.
    assert 10 <= elapsed < 10 + 60
