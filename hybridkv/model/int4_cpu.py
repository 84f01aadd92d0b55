"""4-bit linear layers on CPU: a GGUF's Q4_1 weights kept 4-bit, through our Q4_1 kernel or torch's CPU int4 kernel.

CPU decode reads every weight once a token, so its speed is the bytes of the weights over the memory bandwidth:
SmolLM2-135M is 540 MB a token in float32, 270 MB in bf16 and ~80 MB in Q4_1 as the GGUF stores it.

A generated token's rows run ``q4_1_cpu.py``'s kernel (the GGUF's fp16 ``d`` and ``m`` as stored, activations as
two int8 digits per block of 32) where it was built (``setup.py``: a C compiler at install) and passes its start-up
check; else torch's int4 kernel, as follows. Q4_1 stores each group of 32 weights of a row as ``d * q + m`` with q
in 0..15; torch's int4 kernel
(``_weight_int4pack_mm_for_cpu``, bf16 activations) computes with ``(q - 8) * scale + zero`` per group of 32 along
the input dimension: the same grid with ``scale = d`` and ``zero = m + 8 d``. The grid is recovered from the
dequantised float weight itself (a group's smallest value is ``m``: Q4_1 gives it q = 0, and its largest
``m + 15 d``), and only a weight every group of which lies on its grid is packed, so a float checkpoint is never
quantised here. What changes: activations and each group's scale and zero are rounded to bf16 (8-bit mantissa);
``benchmarks/cpu.py`` prints how far the logits move against the float32 model. The output head (the tied
Q8_0 embedding in SmolLM2) stays float32: a bf16 head rounds the logits themselves to 8 bits of mantissa, which
turned near-ties into ties and changed greedy tokens (greedy rows get an exact int8 screen instead:
``int8_head_cpu.py``).

A prefill is compute-bound, not bandwidth-bound, and the int4 kernel is slow there: a prompt's rows run the
weight in bf16 (each value rounded once more, to bf16) through oneDNN's bf16 GEMM (256 rows of a SmolLM2 layer:
4.9 ms there, 13.1 ms in the int4 kernel, two threads). That bf16 weight is expanded from the packed bytes for the
call (``Int4Linear.bf16_weight``: ~0.8 ms for SmolLM2's gate/up on one core with its bytes in cache, beside 4.5 ms
of GEMM over 256 rows; within a prefill about a quarter of the GEMMs' time), not kept: a kept copy is 2 bytes a weight, ~200 MB for SmolLM2, more than the 4-bit weights and the head together. The two give different numbers, so which one a row takes is
a property of the row alone (``RowPaths``): a prompt token's row takes the bf16 weight and a generated token's the
4-bit kernel, in any step and beside any other rows. Each kernel's row is the same whatever the other rows of
its call (checked for 1 to 300 rows), so a prompt prefilled cold, its tail after a cache hit, and the same prompt
in a batch compute the same K/V and logits. (Outside an engine step, without ``RowPaths`` set, a call of
``DENSE_ROWS`` rows or more takes the bf16 weight.)

Example, one group of 4 (not 32) for brevity: weights [0.5, 0.1, 0.3, 0.1] -> m = 0.1, d = (0.5 - 0.1) / 15,
q = [15, 0, 7.5 -> not on the grid] -> left dense; [0.5, 0.1, 0.1 + 7 d, 0.1] -> q = [15, 0, 7, 0] -> packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.model.architectures.parallel import FusedColumns
from hybridkv.model.q4_1_cpu import GROUP, Q41Kernel
from hybridkv.model.q4_1_cpu import pack as q4_1_pack

# From this many rows on (a prefill chunk), a layer runs its bf16 weight through oneDNN's bf16 GEMM: 256 rows of a
# SmolLM2 layer take 8.8 ms there and 22.7 ms in the int4 kernel, whose speed is in reading fewer bytes (decode).
DENSE_ROWS = 64
# A value is on its group's grid when it is within this fraction of the group's step of a grid point (the step
# and minimum are fp16 in the file and float32 here: rounding leaves ~1e-4 of a step, off-grid values ~0.5).
_GRID_TOLERANCE = 1e-2


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@dataclass(slots=True)
class Int4Packing:
    """How a CPU rank keeps Q4_1 linears 4-bit: a generated token's rows through ``kernel`` (our Q4_1 kernel; None:
    torch's int4 kernel)."""

    kernel: Q41Kernel | None


def int4_packing(quantization: str, device: str, tensor_parallel_size: int, threads: int) -> Int4Packing | None:
    """The 4-bit packing of a load: ``quantization`` auto on one CPU rank, where torch has the int4 kernel (the
    fallback, and the prefill's bytes); None: linears stay in the model's dtype. ``threads``: the kernel's."""
    if quantization != "auto" or device != "cpu" or tensor_parallel_size != 1 or not int4_kernel_available():
        return None
    return Int4Packing(Q41Kernel.load(threads))


def grid_of(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q int32 [N, K], scale [N, K/GROUP], minimum [N, K/GROUP]) if every group of 32 along a row of ``weight``
    lies on a 16-level grid (a dequantised Q4_1 weight: ``scale`` and ``minimum`` are its ``d`` and ``m``, ``m``
    exactly and ``d`` to float32 rounding); None otherwise."""
    n, k = weight.shape
    if k % GROUP:
        return None
    groups = weight.detach().float().view(n, k // GROUP, GROUP)
    low = groups.amin(-1)
    step = (groups.amax(-1) - low) / 15
    safe = torch.where(step > 0, step, torch.ones_like(step))
    levels = (groups - low[..., None]).div_(safe[..., None])  # in place: a load packs as it goes, and its peak
    q = levels.round()  # RSS is the temporaries of the layer packed (``checkpoint.load_checkpoint``)
    if levels.sub_(q).abs_().max() > _GRID_TOLERANCE:
        return None
    return q.to(torch.int32).view(n, k), step, low


@dataclass(slots=True)
class RowPaths:
    """Which rows of the current step take the bf16 weight (a prompt token's) and which the 4-bit kernel (a generated
    token's), for every ``Int4Linear`` of a model (they share one). The runner sets it before each forward: for the
    step's rows, and for its sampled rows alone (a forward's last layer may compute only those: ``OutputRows``).

    E.g. a step of a prompt's last 3 tokens and one decoding sequence's token: rows [True, True, True, False];
    sampled rows 2 and 3: [True, False]. A call with neither count of rows takes the by-count rule
    (``DENSE_ROWS``): a model run outside the engine's steps."""

    step: _Split | None = None
    sampled: _Split | None = None

    def set(self, prompt_rows: np.ndarray, sample_rows: np.ndarray) -> None:
        """``prompt_rows`` [T] bool: row t is a prompt token's; ``sample_rows`` [N]: the rows sampled."""
        self.step = _Split.of(prompt_rows)
        self.sampled = _Split.of(prompt_rows[sample_rows])

    def clear(self) -> None:
        self.step = self.sampled = None

    def of(self, rows: int) -> _Split:
        for split in (self.step, self.sampled):
            if split is not None and split.rows == rows:
                return split
        return _Split(rows, rows >= DENSE_ROWS, None, None)

    def all_packed(self, rows: int) -> bool:
        """Every one of ``rows`` rows takes the 4-bit kernel (``llama_cpu_decode``'s loop may run them)."""
        split = self.of(rows)
        return split.dense is False


@dataclass(slots=True)
class _Split:
    """One call's rows: ``dense`` True (every row the bf16 weight), False (every row the 4-bit kernel) or None (some
    each: ``dense_rows`` and ``packed_rows`` say which)."""

    rows: int
    dense: bool | None
    dense_rows: torch.Tensor | None
    packed_rows: torch.Tensor | None

    @classmethod
    def of(cls, prompt_rows: np.ndarray) -> _Split:
        n, dense = len(prompt_rows), int(prompt_rows.sum())
        if dense in (0, n):
            return cls(n, dense == n, None, None)
        index = lambda mask: torch.from_numpy(np.flatnonzero(mask))  # noqa: E731
        return cls(n, None, index(prompt_rows), index(~prompt_rows))


def row_paths_of(model: nn.Module) -> RowPaths | None:
    """The ``RowPaths`` a model's 4-bit layers share, which the runner sets each step; None: no 4-bit layer."""
    return next((m.paths for m in model.modules() if isinstance(m, Int4Linear)), None)


class Int4Linear(nn.Module):
    """``F.linear(x, weight, bias)`` with ``weight`` packed 4-bit; x and the output keep their dtype, except on a
    layer whose output only ever feeds a residual add (``keep_bf16``) run by torch's int4 kernel: that sum
    promotes the kernel's bf16 output to float32 exactly, so the output stays bf16 and the step saves a conversion
    (our Q4_1 kernel's output is float32 already)."""

    keep_bf16: bool = False

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None,
                 paths: RowPaths | None = None, kernel: Q41Kernel | None = None) -> None:
        """``q``, ``scale``, ``minimum``: ``grid_of``'s. ``paths``: which rows of a step take which kernel
        (``pack_int4_linears`` gives a model's layers one). ``kernel``: our Q4_1 kernel for the 4-bit rows (None:
        torch's int4 kernel)."""
        super().__init__()
        self.paths = paths or RowPaths()
        self.kernel = kernel
        self.out_features, self.in_features = q.shape
        self.register_buffer("dense", None)  # a prefill's bf16 weight where it cannot be expanded from the bytes
        if kernel is not None:
            # our kernel's layout, d and m in fp16 as the GGUF stores them; a prefill's weight is expanded from it
            self.register_buffer("q4_1", q4_1_pack(q, scale, minimum))
        else:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            # [K/GROUP, N, 2] as torch's kernel reads them
            zero = minimum + 8 * scale
            self.register_buffer("scales_zeros", torch.stack((scale.t(), zero.t()), dim=-1).bfloat16().contiguous())
            # a prefill's bf16 weight is expanded from ``packed`` for each call where its byte layout is known
            # (checked here against q), else kept (2 bytes a weight beside the 4 bits' half byte)
            unpacked = _unpacked(self.packed)
            if unpacked is None or not torch.equal(unpacked, q.to(torch.uint8)):
                self.dense = _expand(q, self.scales_zeros)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def _apply(self, fn, recurse: bool = True):
        # torch's kernel takes its scales in bf16 whatever dtype the model is later moved to (a second engine over
        # the same loaded model moves it to its dtype again); our kernel's bytes are not floats to move
        super()._apply(fn, recurse)
        if self.kernel is None:
            self.scales_zeros = self.scales_zeros.to(torch.bfloat16)
        if self.dense is not None:
            self.dense = self.dense.to(torch.bfloat16)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        split = self.paths.of(flat.shape[0])
        if split.dense is None:
            y = flat.new_empty((flat.shape[0], self.out_features), dtype=self._out_dtype(x))
            y[split.dense_rows] = self.dense_rows(flat[split.dense_rows])
            y[split.packed_rows] = self.rows(flat[split.packed_rows])
        else:
            y = self.dense_rows(flat) if split.dense else self.rows(flat)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` of x [R, in_features] through the 4-bit kernel (a generated token's rows)."""
        if self.kernel is not None:
            y = self.kernel(self.q4_1, self.out_features, x)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP,
                                                          self.scales_zeros)
        y = y.to(self._out_dtype(x))
        return y if self.bias is None else y + self.bias

    def dense_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` of x [R, in_features] through the weight in bf16 (a prompt token's rows)."""
        y = F.linear(x.to(torch.bfloat16), self.bf16_weight()).to(self._out_dtype(x))
        return y if self.bias is None else y + self.bias

    def bf16_weight(self) -> torch.Tensor:
        """[out_features, in_features] bf16: ``(q - 8) * scale + zero`` with the kernel's bf16 scales and zeros,
        each value rounded once (``_expand``'s values), from ``packed`` ([in, out] in memory: the GEMM reads either
        layout, with the same sums). Each step is one contiguous pass (a broadcast over a strided operand was 5x
        slower). E.g. q = 3 in a group of scale 0.5, zero 1.0: (3 - 8) * 0.5 + 1.0 = -1.5. Under our Q4_1 kernel, the
        same values from its bytes (``d`` as the scale, ``m + 8 d`` the zero, each rounded to bf16 as torch's are)."""
        if self.dense is not None:
            return self.dense
        if self.kernel is not None:
            return self.kernel.expand_bf16(self.q4_1, self.out_features)
        n, k = self.out_features, self.in_features
        q = torch.empty(k, n, dtype=torch.float32)
        centred = _nibbles(self.packed, n, k).view(torch.int8).sub_(8)  # q - 8 in int8: a quarter of the bytes
        q.view(k, n // _BLOCK_N, 2, _BLOCK_N // 2).permute(1, 2, 0, 3).copy_(centred)
        scale, zero = (self.scales_zeros[..., i].float()[:, None] for i in (0, 1))  # [K/GROUP, 1, N]
        groups = q.view(k // GROUP, GROUP, n)
        return torch.addcmul(zero, groups, scale, out=groups).view(k, n).bfloat16().t()

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.bfloat16 if self.keep_bf16 and self.kernel is None else x.dtype


# The CPU int4 packing's block of output rows: in each, byte [k // 2, (k % 2) * 32 + n % 32] holds row n's weight
# k, rows 0-31 in the low nibble, 32-63 in the high one (a block of fewer rows, at the end, is laid out otherwise)
_BLOCK_N = 64


def _nibbles(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """uint8 [n / 64, 2, k, 32] of a packed weight's q: block, nibble (rows 0-31 or 32-63 of the block), input,
    row in the half-block."""
    if n % _BLOCK_N:
        raise ValueError(f"only whole blocks of {_BLOCK_N} rows unpack; this weight has {n} rows")
    blocks = packed.view(n // _BLOCK_N, 1, k, _BLOCK_N // 2)
    out = torch.empty(n // _BLOCK_N, 2, k, _BLOCK_N // 2, dtype=torch.uint8)
    torch.bitwise_and(blocks, 15, out=out[:, :1])
    torch.bitwise_right_shift(blocks, 4, out=out[:, 1:])
    return out


def _unpacked(packed: torch.Tensor) -> torch.Tensor | None:
    """uint8 [N, K] q of a packed weight made of whole 64-row blocks; None for any other."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if n % _BLOCK_N or packed.dtype != torch.uint8 or packed.dim() != 2:
        return None
    return _nibbles(packed, n, k).permute(0, 1, 3, 2).reshape(n, k)


def _expand(q: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] of ``(q - 8) * scale + zero`` with the kernel's bf16 scales and zeros, each value rounded once."""
    n, k = q.shape
    scale, zero = (scales_zeros[..., i].t().float()[..., None] for i in (0, 1))
    return ((q.view(n, k // GROUP, GROUP).float() - 8) * scale + zero).view(n, k).bfloat16()


class Int4Rows(nn.Module):
    """Output features ``lo:hi`` of a packed layer: one linear of a ``FusedColumns`` group packed as a whole (its
    name stays, for whoever reads it; the group's forward runs the whole layer once)."""

    def __init__(self, whole: Int4Linear, lo: int, hi: int) -> None:
        super().__init__()
        self.whole, self.lo, self.hi = whole, lo, hi
        self.in_features, self.out_features = whole.in_features, hi - lo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole(x)[..., self.lo : self.hi]


class Int4Columns:
    """A ``FusedColumns`` group (q/k/v, gate/up) with ``FusedColumns``' call signature. Every linear packed: one
    4-bit GEMM over their rows together (a decode step's kernel calls cost ~10 us each beyond their bytes);
    some packed: each linear runs its own GEMM."""

    def __init__(self, linears: list[nn.Module], whole: Int4Linear | None = None) -> None:
        self.linears = linears
        self.whole = whole
        self.sizes = [linear.out_features for linear in linears]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.whole is not None:
            return self.whole(x).split_with_sizes(self.sizes, dim=-1)
        return tuple(linear(x) for linear in self.linears)

    def joint(self, x: torch.Tensor) -> torch.Tensor | None:
        """The linears' outputs side by side, or None when they are not packed as one (``FusedColumns.joint``)."""
        return None if self.whole is None else self.whole(x)


def pack_int4_linears(model: nn.Module, bf16_outputs: tuple[str, ...] = (), paths: RowPaths | None = None,
                      kernel: Q41Kernel | None = None) -> int:
    """Replace every plain (single-rank) linear layer whose weight lies on a Q4_1 grid by an ``Int4Linear``, and
    every ``FusedColumns`` group holding one by an ``Int4Columns`` (before or after ``fuse_columns``: the float
    weights are let go either way); a group whose linears are all on a grid is packed as one layer. The linears
    named in ``bf16_outputs`` (a model's ``residual_branch_ends``) output bf16 (``Int4Linear.keep_bf16``). Every
    packed layer of the model shares one ``RowPaths`` (``row_paths_of``; ``paths``: that one, for a model packed
    one part at a time) and runs its 4-bit rows through ``kernel`` (None: torch's int4 kernel). Returns how many
    linears were packed. CPU only."""
    places = {id(child): (parent, name, child) for parent in model.modules()
              for name, child in parent.named_children() if isinstance(child, nn.Linear) and _single_rank(child)}
    groups = [(module, attr, group) for module in model.modules() for attr, group in list(vars(module).items())
              if isinstance(group, FusedColumns)]
    count, paths = 0, paths or row_paths_of(model) or RowPaths()
    for module, attr, group in groups:  # one group at a time: a single layer's grids held at once
        if not all(id(linear) in places for linear in group.linears) or not _same_bias(group.linears):
            continue
        grids = [grid_of(linear.weight) for linear in group.linears]
        if all(grid is not None for grid in grids):
            members = [places.pop(id(linear)) for linear in group.linears]
            setattr(module, attr, _pack_whole(members, grids, paths, kernel))
            count += len(members)
    replaced = {}
    branch_ends = set(bf16_outputs)
    for parent, name, child in places.values():
        grid = grid_of(child.weight)
        if grid is not None:
            replaced[id(child)] = Int4Linear(*grid, child.bias, paths, kernel)
            replaced[id(child)].keep_bf16 = name in branch_ends
            setattr(parent, name, replaced[id(child)])
    for module, attr, group in groups:
        if isinstance(group, FusedColumns) and any(id(linear) in replaced for linear in group.linears):
            setattr(module, attr, Int4Columns([replaced.get(id(l), l) for l in group.linears]))
    return count + len(replaced)


def int4_linear_count(model: nn.Module) -> int:
    """How many of ``model``'s linears are 4-bit: each ``Int4Rows`` of a group packed as one layer, and each
    ``Int4Linear`` standing alone."""
    rows = [m for m in model.modules() if isinstance(m, Int4Rows)]
    wholes = {id(r.whole) for r in rows}
    return len(rows) + sum(isinstance(m, Int4Linear) and id(m) not in wholes for m in model.modules())


def _pack_whole(members: list[tuple[nn.Module, str, nn.Linear]], grids: list[tuple], paths: RowPaths,
                kernel: Q41Kernel | None) -> Int4Columns:
    """One ``Int4Linear`` over the rows of a group's linears (their ``grids``, in order); each linear's name on its
    parent becomes an ``Int4Rows`` of it."""
    q, scale, minimum = (torch.cat([grid[i] for grid in grids]) for i in range(3))
    biases = [linear.bias for *_, linear in members]
    whole = Int4Linear(q, scale, minimum, None if biases[0] is None else torch.cat(biases), paths, kernel)
    parts, lo = [], 0
    for parent, name, linear in members:
        parts.append(Int4Rows(whole, lo, lo + linear.out_features))
        setattr(parent, name, parts[-1])
        lo += linear.out_features
    return Int4Columns(parts, whole)


def _same_bias(linears: tuple[nn.Linear, ...]) -> bool:
    return len({linear.bias is None for linear in linears}) == 1


def _single_rank(linear: nn.Linear) -> bool:
    """A tensor-parallel shard reduces over ranks in its own forward; only whole layers are replaced."""
    tp = getattr(linear, "tp", None)
    count = getattr(linear, "count", 1)
    return (tp is None or tp.size == 1) and count == 1
