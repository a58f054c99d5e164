"""Where rayvllm keeps files it builds: demo models and compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$RAYVLLM_CACHE_DIR`, else `$XDG_CACHE_HOME/rayvllm`, else `~/.cache/rayvllm`."""
    root = os.environ.get("RAYVLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rayvllm"
    )
    return Path(root)
