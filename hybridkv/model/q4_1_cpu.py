"""A generated token's rows of a Q4_1 linear on CPU: our own kernel (``q4_1_cpu.c``, the extension module
``_q4_1_cpu`` that ``setup.py`` builds) on the GGUF's blocks.

A decode step of SmolLM2-135M reads ~66 MB of Q4_1 weights; torch's int4 kernel (bf16 activations) runs them at
about 10 GB/s on one core, compute-bound. This kernel does the integer arithmetic llama.cpp does for Q4_1, with one
more int8 digit: each row of activations is quantised per block of 32 to ``dx = max|x| / 127`` and two int8
digits, ``a = round(x / dx)`` and ``b = round(256 (x - dx a) / dx)``, so ``x ~ (dx / 256)(256 a + b)`` (a grid of
``max|x| / 32512``), beside the block's float sum ``sx``. A block's dot product with 4-bit weights ``w = d q + m``
is then ``d (dx / 256)(256 q.a + q.b) + m sx``, the integer part exact in int32 (AVX-512 VNNI ``vpdpbusd``;
AVX2 ``vpmaddubsw`` + ``vpmaddwd``; scalar C elsewhere, picked at run time from the CPU's features). The weights
are the GGUF's own: ``d`` and ``m`` are fp16 in the file and here, ``q`` its nibbles, only reordered (``pack``).
llama.cpp's ``q8_1`` keeps ``a`` alone (and rounds ``sx`` to fp16); with ``a`` alone the default model's greedy
replies left float32's on 3 of 5 test chats (``benchmarks/cpu.py --error``: 100 of 224 tokens before the first
divergence), with ``b`` too they do not, and the logits move less than with torch's bf16 activations. ``b``
doubles the integer instructions, not the bytes read.

Layout (``Q4_1x16``): output rows in tiles of 16, each tile's blocks of 32 inputs in order, 320 bytes a
tile-block: 4 x 64 bytes of nibbles, byte ``64 c + 4 j + i`` holding ``q[j][4c + i]`` (low nibble) and
``q[j][16 + 4c + i]`` (high), then the 16 rows' ``d`` and their ``m`` (fp16). One 64-byte load gives each 32-bit
lane (an output row) 4 consecutive inputs, so a tile's 16 outputs need no horizontal sums and the weight bytes
are read once for up to 4 rows of activations. 0.625 bytes a weight, as the GGUF's Q4_1 and torch's int4 layout.

Every kernel does the same float operations in the same order (``q4_1_cpu.c``), so they agree bit for bit, and
a row's output does not depend on the other rows of the call or the thread count (``RowPaths`` relies on it).

Example, one block of 4 (not 32) inputs for brevity: x = [0.5, -1.0, 0.25, 0.0] -> dx = 1/127, a = [64, -127, 32,
0], b = [-128, 0, -64, 0] (x / dx = [63.5, -127, 31.75, 0] = a + b / 256), sx = -0.25. With q = [1, 2, 3, 4], d =
0.5, m = -1 (w = [-0.5, 0, 0.5, 1]): 256 q.a + q.b = 256 (-94) - 320 = -24384, and d (dx / 256) (-24384) + m sx =
-0.375 + 0.25 = -0.125, the float dot product.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

GROUP = 32  # Q4_1's block: inputs sharing a scale and a minimum
TILE = 16  # output rows a tile interleaves
ISAS = {2: "AVX-512 VNNI", 1: "AVX2", 0: "scalar C"}


@dataclass(slots=True)
class Q41Kernel:
    """The compiled kernel, the instruction set it runs (``ISAS``) and the threads a call splits its output rows
    over (OpenMP; 1 where the build has none)."""

    ext: ModuleType  # hybridkv.model._q4_1_cpu
    isa: int
    threads: int

    @classmethod
    def load(cls, threads: int) -> Q41Kernel | None:
        """The kernel at this CPU's best instruction set, or None where it was not built (no C compiler at install),
        where this CPU has neither AVX2 nor AVX-512 VNNI, or where it does not match its scalar reference on a
        check (then torch's int4 kernel runs the layers)."""
        try:
            from hybridkv.model import _q4_1_cpu as ext
        except ImportError:
            return None
        kernel = cls(ext, ext.best_isa(), threads if ext.threaded() else 1)
        # scalar C (no AVX2: e.g. an ARM CPU) is slower than torch's int4 kernel, which has NEON code
        return kernel if kernel.isa > 0 and kernel.matches_scalar() else None

    def __deepcopy__(self, memo: dict) -> Q41Kernel:
        return self  # no state of its own: a copied model's layers share it (a module object does not copy)

    @property
    def name(self) -> str:
        threads = f"{self.threads} thread{'s' if self.threads > 1 else ''}"
        return f"hybridkv's Q4_1 kernel ({ISAS[self.isa]}, activations as two int8 digits, {threads})"

    def matches_scalar(self) -> bool:
        """The chosen instruction set's outputs equal the scalar C kernel's, bit for bit, on random weights with
        extreme codes and rows at both ends of the int8 range (a start-up check: a few hundred microseconds)."""
        g = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (40, 3 * GROUP), generator=g, dtype=torch.int32)
        q[0], q[1] = 15, 0
        d, m = torch.rand(40, 3, generator=g) * 0.01, torch.randn(40, 3, generator=g) * 0.05
        x = torch.randn(5, 3 * GROUP, generator=g)
        x[0] = x[0].sign() * 3.0
        packed = pack(q, d, m)
        return torch.equal(self(packed, 40, x), self(packed, 40, x, isa=0))

    def __call__(self, packed: torch.Tensor, n: int, x: torch.Tensor, isa: int | None = None,
                 threads: int | None = None) -> torch.Tensor:
        """float32 [R, n] = x [R, K] (float32 or bf16) times the weight ``pack`` made of [n, K] (``isa``,
        ``threads``: other than the chosen ones, for tests)."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        if x.dim() != 2 or x.stride(-1) != 1:
            x = x.reshape(-1, x.shape[-1]).contiguous()
        rows, k = x.shape
        if packed.shape[1] * GROUP != k:
            raise ValueError(f"x has {k} inputs a row; this weight takes {packed.shape[1] * GROUP}")
        y = torch.empty(rows, n)
        code = self.ext.linear(packed.data_ptr(), n, k, x.data_ptr(), int(x.dtype == torch.bfloat16), rows,
                               x.stride(0), y.data_ptr(), n, self.threads if threads is None else threads,
                               self.isa if isa is None else isa)
        if code:
            raise RuntimeError(f"q41_linear failed ({'out of memory' if code == -2 else 'bad arguments'})")
        return y

    def expand_bf16(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        """bf16 [n, K]: the weight ``pack`` laid out as torch's int4 kernel computes with it, ``(q - 8) * scale +
        zero`` with ``scale = bf16(d)`` and ``zero = bf16(m + 8 d)``, each value rounded once (``int4_cpu._expand``'s
        values bit for bit): a prompt row's weight for the bf16 GEMM, made for the call (one pass over the bytes,
        split over the threads). E.g. q = 3, d = 0.5, m = -1.0: (3 - 8) * 0.5 + 3.0 = 0.5."""
        k = packed.shape[1] * GROUP
        out = torch.empty(n, k, dtype=torch.bfloat16)
        if self.ext.expand_bf16(packed.data_ptr(), n, k, out.data_ptr(), self.threads):
            raise RuntimeError(f"q41_expand_bf16: bad arguments (n {n}, k {k})")
        return out


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(N / 16), K / 32, 320]: the ``Q4_1x16`` layout of codes ``q`` [N, K] (0..15) with per-block
    scales ``d`` and minimums ``m`` [N, K / 32] (rounded to fp16: a GGUF's are fp16, so exact), rows past N zero.

    E.g. N = 16, K = 32: tile-block 0's byte 4 (c = 0, j = 1, i = 0) is ``q[1][0] | q[1][16] << 4``."""
    n, k = q.shape
    if k % GROUP or d.shape != (n, k // GROUP) or m.shape != d.shape:
        raise ValueError(f"q [N, K] with K a multiple of {GROUP}, d and m [N, K / {GROUP}]; got {tuple(q.shape)}, "
                         f"{tuple(d.shape)}, {tuple(m.shape)}")
    tiles, blocks, pad = -(-n // TILE), k // GROUP, -n % TILE
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad)).view(tiles * TILE, blocks, 2, 16)
    # inputs 4c..4c+3 of a row's block as one int32 (4 bytes), moved as a whole: [tile, block, c, row of the tile]
    words = (q[:, :, 0] | q[:, :, 1] << 4).view(torch.int32).view(tiles, TILE, blocks, 4)
    nibbles = words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(tiles, blocks, 256)
    halves = [torch.nn.functional.pad(t.half(), (0, 0, 0, pad)).view(tiles, TILE, blocks).transpose(1, 2)
              .contiguous().view(torch.uint8) for t in (d, m)]
    return torch.cat([nibbles, *halves], dim=-1).contiguous()


