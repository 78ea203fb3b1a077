"""A shared-memory all-gather for the tensor-parallel ranks of one host, on CPU: the
row-parallel reductions, the embedding's sum and the logits' gather of every step
(`common/models/tensor_parallel.py`) go through it instead of gloo's loopback TCP, whose
fixed cost per collective (a few hundred microseconds here) dominated a small-batch step.

Rank 0 creates one segment in /dev/shm, the others map it, and rank 0 unlinks it (the
mappings stay: nothing is left behind, even after a crash). The segment holds one flag per
rank (a cache line each) and two slots per rank of `SLOT_BYTES`. Call k of every rank
copies its part into its slot k mod 2, publishes k, and waits until every rank published
k (`csrc/shm_collective.cpp`: release/acquire atomics; spinning, then yielding; a rank that
does not arrive within the group's timeout raises). The parts are then read in place, and
must be used before the rank's next call: two slots suffice, since no rank can start call
k+2 before every rank has finished call k+1, so after every rank has read call k. A part
larger than a slot goes through `torch.distributed` instead (the decision depends only on
shapes, equal on every rank). `PDSERVE_TP_SHM=0` turns it off; a rank that cannot build
the extension turns it off for the whole group."""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from torch import Tensor

from pdserve.kernels.cpp_build import build_main, load_extension

EXTENSION_NAME = "pdserve_shm_collective"
SOURCES = [Path(__file__).parent / "csrc" / "shm_collective.cpp"]
SLOT_BYTES = 4 << 20  # per rank and slot: a [2048, 512] float32 partial, [64, 16384] logits
FLAG_STRIDE = 8  # int64s between two ranks' flags: one cache line each


def load(verbose: bool = False) -> ModuleType | None:
    return load_extension(EXTENSION_NAME, SOURCES, verbose)


class ShmAllGather:
    def __init__(self, rank: int, world: int, path: str, timeout_s: float, ext: ModuleType) -> None:
        import mmap

        self.rank, self.world, self.timeout_s, self.ext = rank, world, timeout_s, ext
        flags_bytes = world * FLAG_STRIDE * 8
        size = flags_bytes + 2 * world * SLOT_BYTES
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if rank == 0 else 0), 0o600)
        try:
            if rank == 0:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self.flags = raw[:flags_bytes].view(torch.int64)
        self.slots = raw[flags_bytes:].view(2, world, SLOT_BYTES)
        self.seq = 0

    def fits(self, part: Tensor) -> bool:
        return part.device.type == "cpu" and part.numel() * part.element_size() <= SLOT_BYTES

    def all_gather(self, part: Tensor) -> list[Tensor]:
        """Every rank's `part` (same shape and dtype on all), in rank order: views of the
        segment, valid until this rank's next call."""
        self.seq += 1
        slot = self.slots[self.seq % 2]
        nbytes = part.numel() * part.element_size()
        slot[self.rank, :nbytes].copy_(part.contiguous().view(-1).view(torch.uint8))
        self.ext.publish(self.flags, self.rank * FLAG_STRIDE, self.seq)
        if not self.ext.wait_all(self.flags, self.world, FLAG_STRIDE, self.seq, self.timeout_s):
            raise RuntimeError(
                f"tensor-parallel rank {self.rank}: a rank did not reach collective "
                f"{self.seq} within {self.timeout_s:g} s"
            )
        return [slot[r, :nbytes].view(part.dtype).view(part.shape) for r in range(self.world)]


def create(rank: int, world: int, timeout_s: float) -> ShmAllGather | None:
    """The group's shared-memory all-gather (a collective of the whole group), or None when
    it is turned off or any rank cannot have it."""
    wanted = os.environ.get("PDSERVE_TP_SHM", "1") != "0"
    ext = load() if wanted else None
    ok = torch.tensor([1 if ext is not None else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        return None
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    name = [os.path.join(folder, f"pdserve-tp-{uuid.uuid4().hex}") if rank == 0 else None]
    dist.broadcast_object_list(name, 0)
    assert ext is not None and name[0] is not None
    try:
        comm = ShmAllGather(rank, world, name[0], timeout_s, ext) if rank == 0 else None
        dist.barrier()  # the segment exists
        if rank != 0:
            comm = ShmAllGather(rank, world, name[0], timeout_s, ext)
        dist.barrier()  # every rank has it mapped
    finally:
        if rank == 0 and os.path.exists(name[0]):
            os.unlink(name[0])
    return comm


if __name__ == "__main__":
    sys.exit(build_main(EXTENSION_NAME, SOURCES))
