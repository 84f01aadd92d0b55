"""The one compiled part: the Q4_1 CPU kernel, the CPU decode step and the CPU prompt attention
(``hybridkv/model/q4_1_cpu.c``, ``cpu_decode.c``, ``prompt_attention_cpu.c``; plain C, no torch headers), built at
``pip install`` as an optional extension module. Without a C compiler the install still succeeds: the 4-bit CPU
layers run torch's int4 kernel (``hybridkv/model/q4_1_cpu.py`` says which one runs) and a prompt's attention torch's
flash kernel. The rest is in pyproject.toml."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -ffp-contract=off: the scalar kernel does the SIMD kernels' float operations, in their order, without the compiler
# fusing others (they agree bit for bit). -Wno-psabi: the decode step's 16-float vectors pass between static
# functions of one file only, so the ABI note on passing them without AVX-512 concerns no caller
FLAGS = ["-O3", "-ffp-contract=off", "-Wno-psabi"]
OPENMP = ["-fopenmp"]
SOURCES = ("q4_1_cpu", "cpu_decode", "prompt_attention_cpu")
HEADERS = ("q4_1_cpu", "cpu_decode_ops")


class BuildExt(build_ext):
    """With OpenMP (the call's output rows split over threads) where the compiler has it, else without (one thread:
    e.g. Apple's clang)."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception:  # noqa: BLE001 - any compile or link failure: try once more without OpenMP
            if OPENMP[0] not in ext.extra_compile_args:
                raise
            ext.extra_compile_args = [f for f in ext.extra_compile_args if f not in OPENMP]
            ext.extra_link_args = [f for f in ext.extra_link_args if f not in OPENMP]
            super().build_extension(ext)


setup(
    ext_modules=[Extension("hybridkv.model._q4_1_cpu", [f"hybridkv/model/{name}.c" for name in SOURCES],
                           depends=[f"hybridkv/model/{name}.h" for name in HEADERS], optional=True,
                           extra_compile_args=FLAGS + OPENMP, extra_link_args=OPENMP)],
    cmdclass={"build_ext": BuildExt},
)
