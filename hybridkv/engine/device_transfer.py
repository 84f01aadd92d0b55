"""Host data onto the device, the one way every step does it (the runner's ids and positions, the sampler's
per-row values, the grammar bitmask), and sampled tokens back (async scheduling).

    host_to_device(torch.arange(4), torch.device("cpu"))          -> the same values, on the CPU
    to_device([0.7, 1.0], torch.float32, torch.device("cuda"))   -> a float32 [2] tensor, copied without a sync
"""

from __future__ import annotations

from typing import Callable

import torch


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. To a GPU through pinned memory and a non-blocking copy: an ordinary copy from
    pageable memory waits for everything queued on the stream, so sampling a step would wait for the step in
    flight, where async scheduling wants to launch the next one first."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short host list as a tensor on ``device`` (``host_to_device``)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def start_copy_to_host(t: torch.Tensor) -> Callable[[], list[int]]:
    """Start copying ``t`` to the host now, so that it queues before later launches on the stream rather than
    behind them; the call returned waits for the copy and gives the values."""
    if not t.is_cuda:
        return t.tolist
    host = t.to("cpu", non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def values() -> list[int]:
        copied.synchronize()
        return host.tolist()

    return values
