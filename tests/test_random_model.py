"""The seeded random test and benchmark models (rayvllm/utils/random_model.py):
builders of the same model side by side, as the GPU proof's steps are, each
find it complete, and a reader never sees a file half written; a directory
that already holds other files is completed around them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rayvllm.utils.random_model import RandomModelSpec, build_random_model

SPEC = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
BUILD = (
    "import json, sys; from rayvllm.utils.random_model import RandomModelSpec, build_random_model; "
    "p = build_random_model(sys.argv[1], RandomModelSpec(**json.loads(sys.argv[2]))); "
    "print(json.load(open(p / 'config.json'))['hidden_size'])"
)


def test_builders_side_by_side_each_find_it_complete(tmp_path: Path) -> None:
    target = tmp_path / "model"
    procs = [
        subprocess.Popen([sys.executable, "-c", BUILD, str(target), json.dumps(SPEC)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(2)  # two make the race; a third only costs one more process
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert [out.strip() for out, _ in results] == ["64"] * 2
    assert (target / ".rayvllm-complete").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging directory left


def test_a_directory_with_other_files_is_completed_around_them(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    path = build_random_model(tmp_path, RandomModelSpec(**SPEC))
    assert path == tmp_path and (tmp_path / "notes.txt").read_text() == "mine"
    assert json.loads((tmp_path / "config.json").read_text())["hidden_size"] == 64
    assert (tmp_path / ".rayvllm-complete").exists()
    assert not [p for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}-")]
