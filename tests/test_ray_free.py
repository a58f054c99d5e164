"""The offline `LLM` and the engine core import and run where Ray is not
installed (the GPU benchmark machine has none)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = r'''
import sys


class _NoRay:
    """Make `import ray` fail as it would without the package."""

    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r} (blocked for this test)")
        return None


sys.meta_path.insert(0, _NoRay())

from rayvllm import LLM, SamplingParams
from rayvllm.engine.inproc_client import InprocClient

llm = LLM(model=sys.argv[1], max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=8 << 20)
assert isinstance(llm.llm_engine.engine_core, InprocClient)
out = llm.generate("hello ray", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 5
assert not any(m == "ray" or m.startswith("ray.") for m in sys.modules), "ray was imported"
print("ok")
'''


def test_llm_runs_without_ray(tiny_model_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tiny_model_dir)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
