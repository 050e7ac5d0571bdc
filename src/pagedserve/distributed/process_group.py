"""Joining the tensor-parallel ranks: one torch.distributed process group per worker process."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.distributed.tp import TPContext
from pagedserve.platforms import platform_for

# A collective waiting longer than this for a peer fails instead of waiting forever. The driver
# notices a dead worker itself within a step; this bounds how long the survivors can linger.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This machine's address as other machines see it (the interface of the default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; it only picks the interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def init_tp_group(rank: int, world_size: int, init_method: str, device: torch.device) -> TPContext:
    """Join the `world_size` ranks rendezvousing at `init_method` (`tcp://host:port`): gloo on
    CPU, NCCL on CUDA. Call once per worker process; returns this rank's `TPContext`.

    NOTE: torch.distributed keeps the group in the process; a worker process is one rank and
    nothing else, and every layer still receives the group through its `TPContext`.
    """
    if world_size == 1:
        return TPContext()
    platform = platform_for(device)
    backend, kwargs = platform.dist_backend, platform.process_group_options()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT, **kwargs)
    return TPContext(rank, world_size, dist.group.WORLD, reduce_in_float32=backend == "gloo")


def destroy_tp_group(tp: TPContext) -> None:
    """Leave the process group (at a clean shutdown)."""
    if tp.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
