"""The documented examples run as written (under torchrun, 2 ranks)."""

from pathlib import Path

import pytest
from harness import run_torchrun

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script):
    result = run_torchrun(str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "matches" in result.stdout
