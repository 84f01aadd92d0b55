"""A prompt's attention rows on CPU through hybridkv's AVX-512 kernel (``hybridkv/model/prompt_attention_cpu.c``,
built into the extension module ``setup.py`` makes), read straight from the paged cache, in float32.

An 8,000-token prompt's attention is ~2.2 TFLOP for SmolLM2-135M, most of its first token's time. The kernel keeps
6 query rows x 64 keys of scores in registers (16 keys a vector, no horizontal sums) and reads the pages in place:
no gather of the sequence's keys, no mask tensor, no merge of partial softmaxes (``torch_paged._by_segments``,
which runs torch's flash kernel, does all three). A row's numbers are its own (fixed key blocks of 64 positions:
see the C file), so a prompt token's output does not depend on its chunk, a prefix cache hit or the thread count,
for full, sliding and chunked layers alike.

Elsewhere (no AVX-512, no C compiler at install, a head size not a multiple of 64, a cache not float32) the
backend's torch path runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from hybridkv.model.attention.kv_cache import LayerCache

@dataclass(slots=True)
class PromptAttentionKernel:
    ext: ModuleType  # hybridkv.model._q4_1_cpu

    @classmethod
    def load(cls) -> PromptAttentionKernel | None:
        """The kernel, or None where it was not built or this CPU lacks AVX-512."""
        try:
            from hybridkv.model import _q4_1_cpu as ext
        except ImportError:
            return None
        return cls(ext) if ext.prompt_attention_supported() else None

    def takes(self, layer: LayerCache) -> bool:
        """Whether ``layer``'s cache is one the kernel reads: float32 on the CPU, heads a multiple of 64 up to the
        kernel's widest (256)."""
        keys, values = layer.keys, layer.values
        return (keys.dtype == torch.float32 and keys.device.type == "cpu" and keys.shape[-1] % 64 == 0
                and keys.shape[-1] <= self.ext.PROMPT_ATTENTION_MAX_HEAD_DIM and keys.stride() == values.stride()
                and keys.stride(-1) == 1)

    def __call__(self, layer: LayerCache, q: torch.Tensor, pages: torch.Tensor, base: int, key0: int,
                 context_len: int, scale: float) -> torch.Tensor:
        """[T, Hq, D] outputs of one sequence's prompt rows q [T, Hq, D] (positions ``context_len``...; their K/V
        already stored) over its keys from position ``key0``, which ``pages`` hold (ids in position order, the
        first one's slot 0 at position ``base``).

        E.g. page size 16, a sliding layer whose rows see keys from position 40 on: pages [7, 3] hold positions
        32..63, base 32."""
        dtype = q.dtype
        q = q.float().contiguous()
        t, hq, d = q.shape
        first = layer.spec.first_needed_token(torch.arange(context_len, context_len + t))
        out = torch.empty_like(q)
        keys = layer.keys
        code = self.ext.prompt_attention(
            q.data_ptr(), keys.data_ptr(), layer.values.data_ptr(), pages.data_ptr(), out.data_ptr(),
            first.data_ptr(), t, hq, keys.shape[2], d, context_len, key0, base, keys.shape[1], *keys.stride()[:3],
            scale, torch.get_num_threads())
        if code:
            raise RuntimeError(f"prompt_attention failed ({'out of memory' if code == -2 else 'bad arguments'})")
        return out if dtype == torch.float32 else out.to(dtype)
