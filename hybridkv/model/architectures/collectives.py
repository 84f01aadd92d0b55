"""A one-shot all-reduce over peer GPU buffers, for the small messages of decode steps.

NCCL's all-reduce is built for bandwidth: for the 10 KB a Scout decode step sums per layer (one token x 5,120 bf16
values) it still pays its protocol's fixed cost, twice per layer, 96 times a step. Here every rank copies its part
into a buffer every peer can read (torch's symmetric memory, which maps each GPU's buffer into the others' address
space over NVLink; no multicast), waits at a barrier, then reads all the parts and sums them itself: one kernel,
one hop. It reads (ranks - 1) x the message per rank, so it only pays for small messages; larger ones go to NCCL
(``ONE_SHOT_MAX_BYTES``, from ``benchmarks/gpu/all_reduce.py``).

E.g. 2 ranks, x = [1, 2] on rank 0 and [10, 20] on rank 1: each copies x into its own buffer, the barrier passes,
each reads both buffers and writes [11, 22]. A second barrier keeps a fast rank from overwriting its buffer with
the next message while a peer still reads this one.

The kernel takes no host sync, so a CUDA graph can hold it; its buffer is set up once, collectively, when the
ranks connect. The same buffer holds the slots of ``add_norm``, which sums a decoder layer's parts together with
the residual add and RMSNorm after them, in one kernel and without a barrier (``kernels/one_shot_norm.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Messages up to this size take the one-shot path: on 2 and 4 H200s it beat NCCL at every size up to 1 MiB inside a
# CUDA graph (10 KB: 7.4 vs 13.0 us at 2 GPUs, 8.9 vs 19.6 at 4; 1 MiB: 15.4 vs 19.9, 20.1 vs 27.7) and lost at
# 8 MiB. 1 MiB holds a decode step of 102 tokens of Scout's 5,120 bf16 values.
ONE_SHOT_MAX_BYTES = 1 << 20


class OneShotAllReduce:
    """Sum over the group's ranks of a CUDA tensor of at most ``max_bytes``, into a new tensor."""

    # Process-wide, as torch's symmetric-memory state is: on torch 2.11 a rendezvous in a process whose earlier
    # group was destroyed (a second tensor-parallel engine after the first shut down, whatever its group's name)
    # waited forever; a second buffer within one live group is fine (benchmarks/gpu/all_reduce.py makes one). So
    # an engine's driver sets the path up once per process, and tells its new workers the answer.
    set_up_in_this_process = False

    @classmethod
    def available_here(cls) -> bool:
        return not cls.set_up_in_this_process

    def __init__(self, device: torch.device, store: dist.Store, name: str, max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        """Collective: every rank of the default group calls it with the same ``name``, unique to this group in
        the process. Symmetric memory keeps each group name's store for the life of the process and torch names
        every default group "0", so the group is registered under its own name, over its own store (that alone
        did not make a second engine in one process work: see ``set_up_in_this_process``)."""
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

        from hybridkv.kernels.one_shot_norm import EMPTY_BYTE, GENERATIONS

        self.group = name
        self.max_bytes = max_bytes
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        _register_process_group(name, dist.group.WORLD)  # symmetric memory looks groups up by name
        _SymmetricMemory.set_group_info(name, self.rank, self.world, dist.PrefixStore(name, store))
        # [staging for one_shot_all_reduce | add_norm's slots: GENERATIONS x world x max_bytes, empty]
        slots = GENERATIONS * self.world * max_bytes
        self.buffer = symm_mem.empty(max_bytes + slots, dtype=torch.uint8, device=device)
        self.buffer[max_bytes:].fill_(EMPTY_BYTE)
        torch.cuda.synchronize(device)  # empty before any peer can write (they need the rendezvous first)
        OneShotAllReduce.set_up_in_this_process = True
        handle = symm_mem.rendezvous(self.buffer, name)  # every rank maps every other rank's buffer
        self.slots = torch.tensor([p + max_bytes for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
        self.generation = torch.zeros(2, dtype=torch.int32, device=device)  # add_norm's (generation, arrivals)

    @staticmethod
    def usable(device: torch.device, size: int) -> bool:
        """Every GPU of the group can read every other's memory directly. The same answer on every rank (it asks
        about the same devices), so all ranks take the same path and none waits in a collective alone."""
        if device.type != "cuda" or torch.cuda.device_count() < size:
            return False
        return all(torch.cuda.can_device_access_peer(a, b) for a in range(size) for b in range(size) if a != b)

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and self.takes(x.numel() * x.element_size(), x.dtype)

    def takes(self, nbytes: int, dtype: torch.dtype) -> bool:
        """A message of ``nbytes`` of ``dtype`` fits the buffer, in a dtype torch's kernel sums."""
        return nbytes <= self.max_bytes and dtype in (torch.bfloat16, torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        out = torch.empty_like(flat)
        staging = self.buffer[: flat.numel() * flat.element_size()].view(flat.dtype)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, flat, "sum", self.group, out)
        return out.view(x.shape)

    def add_norm(self, part: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm(sum over ranks of ``part`` [rows, N] + ``residual``) * ``weight``, leaving the sum plus residual
        in ``residual``: what ``all_reduce`` then ``RMSNorm.add_forward`` compute, in one kernel."""
        from hybridkv.kernels.one_shot_norm import one_shot_add_norm

        return one_shot_add_norm(part, residual, weight, eps, self.slots, self.generation, self.rank, self.world,
                                 self.max_bytes)
