"""examples/seed_example.py, the seed design's published routing example, runs unchanged
(but for its import lines) against the package and prints its plan."""

import subprocess
import sys
from pathlib import Path


def test_seed_example_runs_unchanged():
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, str(root / "examples" / "seed_example.py")],
        capture_output=True, text=True, cwd=root, env={"PYTHONPATH": str(root)}, check=True,
    )
    assert result.stdout.startswith("queue - ")
    assert "gpu-west" in result.stdout
