"""All-reduces over peer GPU buffers: a one-shot all-reduce for the small messages of decode steps
(``OneShotAllReduce``), and the large ones of prefill steps run in halves on the copy engines (``CopyEngineSums``).

NCCL's all-reduce is built for bandwidth: for the 10 KB a Scout decode step sums per layer (one token x 5,120 bf16
values) it still pays its protocol's fixed cost, twice per layer, 96 times a step. Here every rank copies its part
into a buffer every peer can read (torch's symmetric memory, which maps each GPU's buffer into the others' address
space over NVLink; no multicast), waits at a barrier, then reads all the parts and sums them itself: one kernel,
one hop. It reads (ranks - 1) x the message per rank, so it only pays for small messages; larger ones go to NCCL
(``ONE_SHOT_MAX_BYTES``, from ``benchmarks/gpu/all_reduce.py``), or in a prefill step's halves to the copy engines.

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
# ``CopyEngineSums``: a rank's slots for its peers' parts of a prefill half's all-reduce, for each of a step's two
# halves and two generations (a peer runs at most one message ahead)
SUM_HALVES, SUM_GENERATIONS = 2, 2
# Each rank copies its whole part to every peer, (size - 1) x the message where NCCL's ring sends 2 (size - 1) / size
# x: measured to pay at 2 and 4 ranks; larger groups keep NCCL
COPY_ENGINE_SUMS_MAX_RANKS = 4


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
        """``x`` (on this rank's GPU, as every tensor a CUDA model sums is) takes the one-shot path."""
        return self.takes(x.numel() * x.element_size(), x.dtype)

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


class CopyEngineSums:
    """The all-reduces of a tensor-parallel prefill step run in two halves (``LlamaForCausalLM``), on the GPUs'
    copy engines, each summed inside the RMSNorm that follows it.

    NCCL's all-reduce runs in CTAs of its own: beside the other half's GEMMs and attention it is slowed by them and
    slows them (``docs/design/decode.md#tensor-parallel-decode``). Here a half's block ends by copying this rank's
    part into a slot of every peer's buffer (``cudaMemcpyAsync`` into symmetric memory, on a stream of its own: a
    copy engine, no SM), then writing the message's number into the peer's flag for this rank (a stream memory
    operation, no SM either). The half's next norm (``kernels/one_shot_norm.pushed_add_norm``) waits for every
    peer's flag, sums the parts in rank order, adds the residual and normalises: the same bits on every rank.

    E.g. 2 ranks, half 0's third message: rank 0 copies its part into rank 1's slot [half 0, generation 1, peer 0]
    and sets rank 1's flag [half 0, rank 0] to 3; rank 1's norm waits for that flag to reach 3, then reads the
    slot. Two generations suffice: a rank copies message n + 2 only after its norm of n + 1, which waited for the
    peer's part n + 1, which the peer sent after its norm of n had read slot n. Flags only grow, so a peer that is
    a message ahead does not stop this rank's wait.
    """

    @staticmethod
    def scratch_bytes(world: int, max_num_batched_tokens: int, hidden: int, itemsize: int = 2) -> int:
        """What this collective keeps on each rank beside the KV cache (as an attention backend declares its
        ``segment_bytes``; the step reserve keeps both out of the cache): two halves x two generations x
        (world - 1) peers x half a step of hidden-size rows. 0 where the sums stay on NCCL (one rank, or more than
        ``COPY_ENGINE_SUMS_MAX_RANKS``).

        E.g. TP 2, 16,384-token steps of Scout's 5,120 bf16 values: 4 x 1 x 8,192 x 5,120 x 2 B = 320 MiB."""
        if not 2 <= world <= COPY_ENGINE_SUMS_MAX_RANKS:
            return 0
        rows = -(-max_num_batched_tokens // 2)
        return SUM_HALVES * SUM_GENERATIONS * (world - 1) * rows * hidden * itemsize

    def __init__(self, device: torch.device, group: str, rows: int, hidden: int, dtype: torch.dtype) -> None:
        """Collective, within a group ``OneShotAllReduce`` registered (``group``, its name): slots of ``rows`` x
        ``hidden`` ``dtype`` values (half a step) for every peer, half and generation; flags zero."""
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.rows, self.hidden, self.dtype = rows, hidden, dtype
        shape = (SUM_HALVES, SUM_GENERATIONS, self.world - 1, rows * hidden)
        data = -(-self.scratch_bytes(self.world, 2 * rows, hidden, dtype.itemsize) // 16) * 16  # flags after
        self.buffer = symm_mem.empty(data + SUM_HALVES * self.world * 4, dtype=torch.uint8, device=device)
        self.buffer[data:].zero_()
        torch.cuda.synchronize(device)  # flags zero before any peer can write (they need the rendezvous first)
        handle = symm_mem.rendezvous(self.buffer, group)

        def views(whole: torch.Tensor, flag_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            slots = whole[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
            return slots, whole[data:].view(flag_dtype)

        self.slots, self.flags = views(self.buffer, torch.int32)
        self.peers = [p for p in range(self.world) if p != self.rank]
        # the stream memory operation takes uint32 flags
        self.peer_views = {p: views(handle.get_buffer(p, (self.buffer.numel(),), torch.uint8), torch.uint32)
                           for p in self.peers}
        self.stream = torch.cuda.Stream(device)
        self.pushed = [0] * SUM_HALVES  # messages sent per half
        self.summed = [0] * SUM_HALVES  # messages summed per half

    def push(self, part: torch.Tensor, half: int) -> None:
        """Start sending this rank's ``part`` [rows, hidden] of ``half``'s next message to every peer; the next
        ``add_norm`` of the same half sums it."""
        if part.dim() != 2 or part.shape[0] > self.rows or part.shape[1] != self.hidden or part.dtype != self.dtype:
            raise ValueError(f"a {tuple(part.shape)} {part.dtype} part does not fit slots of {self.rows} x "
                             f"{self.hidden} {self.dtype}")
        seq = self.pushed[half] = self.pushed[half] + 1
        flat = part.contiguous().view(-1)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for peer in self.peers:
                slots, flags = self.peer_views[peer]
                me = self.rank - (self.rank > peer)  # the peer's slots skip the peer itself
                slots[half, seq % SUM_GENERATIONS, me, : flat.numel()].copy_(flat)
                torch.ops.symm_mem.stream_write_value32_(flags, half * self.world + self.rank, seq)
        flat.record_stream(self.stream)  # the copies still read it after the caller lets it go

    def add_norm(self, part: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 half: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(sum over ranks of ``half``'s message, ``part`` being this rank's + ``residual``) * ``weight``
        (into ``out`` if given), the sum plus residual left in ``residual``."""
        from hybridkv.kernels.one_shot_norm import pushed_add_norm  # triton is only needed on GPU

        seq = self.summed[half] + 1
        if seq > self.pushed[half]:
            raise RuntimeError(f"half {half}: message {seq} is summed before it was sent")
        self.summed[half] = seq
        return pushed_add_norm(part.contiguous(), residual, weight, eps, self.slots[half, seq % SUM_GENERATIONS],
                               self.flags[half * self.world : (half + 1) * self.world], seq, self.rank, self.world,
                               out)
