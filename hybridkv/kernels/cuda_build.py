"""Building and loading the CUDA C++ kernels (``hopper_attention.cu``, ``int4_mma.cu``): NVRTC to sm_90a machine code,
kept on disk by a hash of source and options, loaded into the device's primary context and launched through the
CUDA driver API (``cuda-bindings``) on torch's current stream. Also the disassembler the offline build tests read."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

CUBIN_CACHE = Path.home() / ".cache" / "hybridkv" / "cubins"  # compiled kernels, by a hash of source and options


def check(result, what: str):
    """cuda-bindings calls return (error, values...): raise on an error, return the values."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return values[0] if len(values) == 1 else values


def cached_cubin(cache_dir: Path | None, key_parts: list[bytes], build: Callable[[], bytes],
                 stem: str = "kernel") -> bytes:
    """``build()``'s machine code, kept in ``cache_dir`` as ``<stem>-<hash>.cubin``, the hash of ``key_parts``
    (source, compiler options and version), so that the next backend or process loads it instead of compiling:
    NVRTC takes seconds a build, paid at every engine start and by every backend a GPU test makes. None: no cache.
    A directory that cannot be read or written only costs the compile."""
    if cache_dir is None:
        return build()
    digest = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:32]
    path = cache_dir / f"{stem}-{digest}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    cubin = build()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # written whole, then renamed: a process reading it (TP workers compile at once) never sees half a file
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass
    return cubin


def compile_cubin(source: Path, opts: list[str], text: str | None = None,
                  cache_dir: Path | None = CUBIN_CACHE) -> bytes:
    """NVRTC: ``source`` (or ``text``, a variant of it) to machine code with ``opts``, or the same build from
    ``cache_dir``."""
    from cuda.bindings import nvrtc

    body = source.read_bytes() if text is None else text.encode()
    encoded = [o.encode() for o in opts]
    version = f"nvrtc {check(nvrtc.nvrtcVersion(), 'nvrtcVersion')}".encode()
    return cached_cubin(cache_dir, [body, *encoded, version], lambda: _nvrtc_compile(nvrtc, source.name, body, encoded),
                        source.stem)


def _nvrtc_compile(nvrtc, name: str, text: bytes, opts: list[bytes]) -> bytes:
    prog = check(nvrtc.nvrtcCreateProgram(text, name.encode(), 0, [], []), "nvrtcCreateProgram")
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(err) != 0:
        size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC could not compile {name}:\n{log.decode(errors='replace')}")
    size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    cubin = b" " * size
    check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    nvrtc.nvrtcDestroyProgram(prog)
    return cubin


def ensure_context(driver, device: torch.device) -> None:
    """A thread that has not touched CUDA through torch has no current context: give it ``device``'s primary one."""
    ctx = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        dev = check(driver.cuDeviceGet(device.index or 0), "cuDeviceGet")
        ctx = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def hopper_unavailable(device: torch.device) -> str | None:
    """Why an sm_90a kernel cannot run on ``device`` (None: it can)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"{torch.cuda.get_device_name(device)} is not Hopper (sm_90)"
    if importlib.util.find_spec("cuda.bindings") is None:
        return "cuda-bindings is not installed (pip install 'hybridkv[gpu]')"
    return None


def cuobjdump() -> str | None:
    """The disassembler: the CUDA toolkit's, or the one Triton bundles; None where neither is installed."""
    bundled = None
    if importlib.util.find_spec("triton") is not None:
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return shutil.which("cuobjdump") or (str(bundled) if bundled is not None and bundled.exists() else None)


def disassemble(cubin: Path) -> dict[str, str]:
    """Each kernel's machine code in ``cubin``, by name (``cuobjdump -sass``)."""
    sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return dict(part.split("\n", 1) for part in sass.split("Function : ")[1:])
