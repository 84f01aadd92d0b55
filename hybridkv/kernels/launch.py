"""Programmatic dependent launch (PDL) for the decode path's Triton kernels.

A batch-1 decode step of a Scout rank is ~690 kernels of 2-15 us each; between two of them the GPU drains the first
grid, then schedules the second. With PDL (Hopper and newer) the second kernel is launched while the first is still
running: its programs start, wait at ``gdc_wait`` until the first kernel has finished and its writes are visible,
and only then read or write anything, so what it computes is unchanged. Each kernel lets its own successor launch
as soon as every one of its programs has started (``gdc_launch_dependents``).

A kernel launched this way must call ``pdl_start`` before its first store and before its first load of anything
a kernel of the step writes. What none of them writes (weights, the step's metadata, copied in before its first
kernel) may be read before it, so that those reads overlap the kernel before. A kernel launched without PDL
(cuBLAS, torch's own) waits for its predecessor as usual, and so does a PDL kernel after one of those.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def pdl(t: torch.Tensor) -> bool:
    """Launch with PDL: ``t`` (the kernel's input) lives on a GPU of compute capability 9.0 or newer."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9


@triton.jit
def pdl_start():
    """Wait until the kernel before has finished and its writes are visible, then let the next one launch."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
