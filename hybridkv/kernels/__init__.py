"""Triton GPU kernels (imported only on CUDA machines; the CPU path needs no Triton)."""
