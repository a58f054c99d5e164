"""Build-on-first-use for the C kernels in this folder.

Each source is compiled with the system C compiler, for one instruction-set
variant (kernels/cpu_isa.py), into the rayvllm cache directory, and loaded
with ctypes, whose calls release the GIL. The cache key covers the source
and the headers beside it, the flags, the compiler and the CPU (model and
feature flags), so an edit or a new compiler rebuilds, and a home directory
shared by different CPUs never loads a library built for another. Without a compiler the callers
fall back to torch; `RAYVLLM_CPU_KERNELS=torch` forces that.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from rayvllm.kernels.cpu_isa import ISA_FLAGS, cpu_info, selected_isa
from rayvllm.utils.paths import cache_dir

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# -fopenmp links libgomp.so.1 by soname; torch (imported first) has already
# loaded its own copy under that soname, so the kernels share torch's pool.
BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp"]


def c_kernels_enabled() -> bool:
    return os.environ.get("RAYVLLM_CPU_KERNELS", "c") != "torch"


def load_library(source_name: str, extra_flags: list[str], isa: str | None = None) -> ctypes.CDLL | None:
    """`source_name` compiled for `isa` (default: `cpu_isa.selected_isa()`),
    or None when C kernels are disabled, the CPU cannot run `isa`, or it
    cannot be built."""
    if not c_kernels_enabled():
        return None
    info = cpu_info()
    isa = isa or selected_isa(info)
    if not info.supports(isa):
        return None
    target = build_library(source_name, extra_flags, isa)
    return None if target is None else ctypes.CDLL(str(target))


def build_library(source_name: str, extra_flags: list[str], isa: str) -> Path | None:
    """The shared library's path, compiled on first use; None if it cannot
    be built. Building needs no CPU support for `isa` (only loading does)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found; using the torch kernels")
        return None
    source = _HERE / source_name
    flags = BASE_FLAGS + ISA_FLAGS[isa] + extra_flags
    info = cpu_info()
    headers = [h.read_bytes() for h in sorted(_HERE.glob("*.h"))]
    key = [source.read_bytes(), *headers, " ".join(flags).encode(), _compiler_id(compiler).encode(),
           info.model.encode(), " ".join(sorted(info.flags)).encode()]
    digest = hashlib.sha256(b"\0".join(key)).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}_{isa}_{digest}.so"
    if not target.exists() and not _compile(compiler, source, flags, target):
        return None
    return target


@lru_cache(maxsize=4)
def _compiler_id(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return compiler + " " + (result.stdout.splitlines() or [""])[0]


def _compile(compiler: str, source: Path, flags: list[str], target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build into a temp name and rename, so concurrent first uses never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    result = subprocess.run([compiler, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        logger.warning("building %s failed; using the torch kernels: %s", source.name, result.stderr.strip())
        return False
    os.replace(tmp, target)
    return True
