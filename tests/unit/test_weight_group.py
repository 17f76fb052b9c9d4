"""The weight-update group forms with a peer that joins the way stock SGLang 0.5.16 joins it, and carries
SGLang's flattened-bucket layout.

The peer process below performs, call for call, what SGLang's `init_weights_update_group` runs:
`init_custom_process_group(backend, init_method="tcp://host:port", world_size, rank, group_name)`
(sglang/srt/utils/common.py:2424, called from model_executor/model_runner_components/weight_updater.py:81),
then for `update_weights_from_distributed` with `load_format="flattened_bucket"` allocates one uint8 buffer of
every tensor's bytes and `torch.distributed.broadcast`s into it (weight_updater.py:243). On the H200, hpcrl's
earlier group (a TCPStore keyed "group/gloo/") waited 120 s for a real server that had joined this way.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from hpcrl.engine.portcheck import listeners
from hpcrl.weightwire.group import WeightGroupError, broadcast, destroy_weight_group, init_weight_group, listen
from hpcrl.weightwire.sglang_payload import flatten_bucket
from tests.conftest import free_port
from tests.support import skip_or_fail

SGLANG_PEER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
    port, names, nbytes = int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
    host = sys.argv[4] if len(sys.argv) > 4 else "127.0.0.1"
    for group_name in names:
        # sglang/srt/utils/common.py: init_custom_process_group
        store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", 1, 2, timeout=dist.default_pg_timeout))
        store.set_timeout(dist.default_pg_timeout)
        store = PrefixStore(group_name, store)
        pg, _ = _new_process_group_helper(2, rank, [], Backend("gloo"), store, group_name=group_name,
                                          backend_options=None, timeout=dist.default_pg_timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        # weight_updater.py: the flattened bucket arrives as one uint8 tensor
        flat = torch.empty(nbytes, dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=pg)
        print(group_name, flat.view(torch.float32)[:3].tolist(), flat.sum().item(), flush=True)
        dist.destroy_process_group(pg)
    # A server process lives on after a weight update; this one ends here. Interpreter teardown can abort in c10d's
    # C++ destructors ("terminate called without an active exception", seen once in CI) after everything above
    # succeeded, so leave without it: the exit code then says whether the protocol steps ran.
    import os
    os._exit(0)
    """
)


def test_a_peer_joining_like_sglang_forms_the_group_and_receives_the_flattened_bucket() -> None:
    named = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b", torch.full((4,), 0.5))]
    flat, _ = flatten_bucket(named)
    names = ["hpcrl_weights_1", "hpcrl_weights_2"]  # a reconnect forms a newly named group in the same process
    ports = [free_port(), free_port()]
    for port in ports[:1]:
        peer = subprocess.Popen(
            [sys.executable, "-c", SGLANG_PEER, str(port), ",".join(names), str(flat.numel())],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        groups = []
        try:
            for name in names:
                pg = init_weight_group(
                    master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name=name,
                    backend="gloo", timeout_s=30,
                )  # fmt: skip
                broadcast(pg, flat)
                groups.append(pg)
            # As in a push: the engine destroys its side first, rank 0 (which hosts the store) after it.
            out, err = peer.communicate(timeout=60)
        finally:
            peer.kill()
            for pg in groups:
                destroy_weight_group(pg)
        assert peer.returncode == 0, err
        lines = out.splitlines()
        assert [ln.split()[0] for ln in lines] == names
        assert all(f"[0.0, 1.0, 2.0] {int(flat.sum())}" in ln for ln in lines), out


def _node_address() -> str:
    """This host's address on its default route (what a Slurm node's name resolves to), or a skip."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            address = str(s.getsockname()[0])
        except OSError:
            address = "127.0.0.1"
    if address.startswith("127."):
        skip_or_fail("this host has no address besides loopback", missing="a network interface")
    return address


@pytest.mark.parametrize("where", ["local", "node"])
def test_the_store_of_a_weight_group_listens_on_its_master_address_only(where: str) -> None:
    # A local run's engines reach the trainer through 127.0.0.1, a Slurm run's through the node's address: the store
    # never listens on every interface, where another host (or, locally, a network) could join in an engine's place.
    address = "127.0.0.1" if where == "local" else _node_address()
    flat, _ = flatten_bucket([("a", torch.arange(3, dtype=torch.float32))])
    listener = listen(address)  # how the distributed transport learns its port before telling the engines
    port = int(listener.getsockname()[1])
    name = f"hpcrl_weights_{where}"
    peer = subprocess.Popen(
        [sys.executable, "-c", SGLANG_PEER, str(port), name, str(flat.numel()), address],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    pg = None
    try:
        pg = init_weight_group(
            master_address=address, master_port=port, rank=0, world_size=2, group_name=name, backend="gloo",
            timeout_s=30, listener=listener,
        )  # fmt: skip
        bound = listeners(port)
        broadcast(pg, flat)
        out, err = peer.communicate(timeout=60)
    finally:
        peer.kill()
        if pg is not None:
            destroy_weight_group(pg)
    assert peer.returncode == 0, err
    assert bound is not None and [b.describe() for b in bound] == [f"{address}:{port}"]


def test_a_store_port_in_use_is_refused_naming_the_key_to_change() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(WeightGroupError, match=rf"cannot listen on 127.0.0.1:{port}: the port is in use; set sync"):
            init_weight_group(
                master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name="hpcrl_weights_busy",
                backend="gloo", timeout_s=5,
            )  # fmt: skip
