"""Build-on-first-use for the C kernels in this folder.

Each source is compiled with the system C compiler into the rayvllm cache
directory, keyed by a hash of source and flags (so an edit rebuilds), and
loaded with ctypes, whose calls release the GIL. Without a compiler the
callers fall back to torch; `RAYVLLM_CPU_KERNELS=torch` forces that.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from rayvllm.paths import cache_dir

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# -fopenmp links libgomp.so.1 by soname; torch (imported first) has already
# loaded its own copy under that soname, so the kernels share torch's pool.
BASE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-shared", "-fPIC", "-fopenmp"]


def load_library(source_name: str, extra_flags: list[str]) -> ctypes.CDLL | None:
    """The compiled `source_name`, or None when C kernels are disabled or cannot be built."""
    if os.environ.get("RAYVLLM_CPU_KERNELS", "c") == "torch":
        return None
    source = _HERE / source_name
    flags = BASE_FLAGS + extra_flags
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}_{digest}.so"
    if not target.exists() and not _compile(source, flags, target):
        return None
    return ctypes.CDLL(str(target))


def _compile(source: Path, flags: list[str], target: Path) -> bool:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found; using the torch kernels")
        return False
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
