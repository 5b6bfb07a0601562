"""vLLM releases' wheels, read without installing them: a release's wheel from PyPI (``pip download``) once, kept in
``$MOETRACE_VLLM_WHEELS`` (default ``~/.cache/moetrace/vllm-wheels``), and its ``.py`` members read with ``zipfile``
and parsed with ``ast`` (``vllm_contract`` checks vllm_api's internals in them)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEELS_ENV = "MOETRACE_VLLM_WHEELS"
# vLLM's x86-64 Linux wheels (abi3: one wheel serves every CPython 3.8+); the tags pip may accept for them
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# a module's top-level classes and functions, for a name searched in every module
TOP_LEVEL_DEFINITION = re.compile(r"^(?:class|def|async def)\s+(\w+)", re.MULTILINE)


class WheelUnavailable(RuntimeError):
    """A release's wheel is neither cached nor downloadable."""


def wheel_cache() -> Path:
    return Path(os.environ.get(WHEELS_ENV) or Path.home() / ".cache" / "moetrace" / "vllm-wheels")


def release_wheel(release: str) -> Path:
    """The wheel of vLLM ``release`` (``0.34``: its ``0.34.0``), from the cache or downloaded into it;
    ``WheelUnavailable`` in one line where pip cannot get it."""
    cache_dir = wheel_cache()
    version = f"{release}.0"
    cached = sorted(cache_dir.glob(f"vllm-{version}-*.whl"))
    if cached:
        return cached[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    download = Path(tempfile.mkdtemp(prefix=".download-", dir=cache_dir))
    try:
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
             *platforms, "--disable-pip-version-check", "-q", "-d", str(download), f"vllm=={version}"],
            capture_output=True, text=True, timeout=900)
        wheels = sorted(download.glob("vllm-*.whl"))
        if done.returncode != 0 or not wheels:
            said = (done.stderr.strip() or done.stdout.strip() or "no wheel").splitlines()[-1]
            raise WheelUnavailable(f"vLLM {version}'s wheel is not cached in {cache_dir} and pip could not "
                                   f"download it: {said}")
        # moved in whole: another process looking for it sees the whole wheel or none
        return Path(shutil.move(str(wheels[0]), cache_dir / wheels[0].name))
    except (OSError, subprocess.SubprocessError) as exc:
        raise WheelUnavailable(f"vLLM {version}'s wheel is not cached in {cache_dir} and pip could not download "
                               f"it: {exc}") from None
    finally:
        shutil.rmtree(download, ignore_errors=True)


class Sources:
    """A wheel's Python modules, parsed on first use."""

    def __init__(self, wheel: Path) -> None:
        self.archive = zipfile.ZipFile(wheel)
        self.files = {name for name in self.archive.namelist() if name.endswith(".py")}
        self.trees: dict[str, ast.Module | None] = {}
        self.definitions: dict[str, list[str]] | None = None

    def file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        return next((f for f in (f"{base}.py", f"{base}/__init__.py") if f in self.files), None)

    def is_package(self, module: str) -> bool:
        return f"{module.replace('.', '/')}/__init__.py" in self.files

    def tree(self, module: str) -> ast.Module | None:
        if module not in self.trees:
            file = self.file(module)
            self.trees[module] = None if file is None else ast.parse(self.archive.read(file), file)
        return self.trees[module]

    def defined_in(self, name: str) -> list[str]:
        """Every ``module.name`` where a module defines a top-level class or function ``name``."""
        if self.definitions is None:
            self.definitions = {}
            for file in sorted(self.files):
                module = file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                text = self.archive.read(file).decode("utf-8", "replace")
                for defined in TOP_LEVEL_DEFINITION.findall(text):
                    self.definitions.setdefault(defined, []).append(f"{module}.{defined}")
        return self.definitions.get(name, [])
