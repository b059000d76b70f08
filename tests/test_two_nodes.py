"""Two "nodes" on one machine: two torchrun agents of 2 ranks each meet through a c10d rendezvous
on 127.0.0.1, as the agents of a SLURM job do through `srun torchrun` (the guide's "Run on a
SLURM cluster" template runs this torchrun line). They train tp 2 x dp 2 to the numbers of one
agent with 4 ranks; a rank of the second node killed mid-run makes both agents restart their
ranks (torchrun's --max-restarts), which resume from the last checkpoint (--auto-resume) and end
with the uninterrupted run's weights. Four ranks on two cores and three launches: extended.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import rank_pids, run_cli
from safetensors.torch import load_file

from meshtrain.checkpointing.checkpoint import latest_checkpoint
from meshtrain.parallel.runtime.process_groups import free_port

pytestmark = pytest.mark.extended

STEPS = 16
TRAIN = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-heads", "2",
         "--seq-len", "16", "--global-batch", "8", "--micro-batch", "2", "--eval-every", "0",
         "--log-every", "1", "--tp", "2", "--steps", str(STEPS), "--save-every", "4",
         "--auto-resume"]


def _node(corpus: str, out: Path, port: int, restarts: int) -> subprocess.Popen:
    """One torchrun agent: the guide's SLURM template's line with this machine's endpoint."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", "two-nodes", "--max-restarts", str(restarts),
         "-m", "meshtrain", "train", *TRAIN, "--data", corpus, "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))


def _finish(nodes: list[subprocess.Popen]) -> str:
    """Both agents' stderr, once both exited 0."""
    errs = []
    for node in nodes:
        try:
            _, err = node.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.kill()
            raise
        assert node.returncode == 0, err[-3000:]
        errs.append(err)
    return "\n".join(errs)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _final_tensors(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    final = latest_checkpoint(out / "checkpoints")
    assert final.name == f"step_{STEPS:08d}"
    return {p.name: load_file(str(p)) for p in sorted(final.glob("*.safetensors"))}


def _assert_same_run(out: Path, reference: Path) -> None:
    assert _losses(out) == _losses(reference)  # JSON floats round-trip exactly
    mine, theirs = _final_tensors(out), _final_tensors(reference)
    assert mine.keys() == theirs.keys() and len(mine) == 4
    for name in mine:
        assert mine[name].keys() == theirs[name].keys()
        for key in mine[name]:
            assert torch.equal(mine[name][key], theirs[name][key]), (name, key)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """One agent, 4 ranks, uninterrupted."""
    out = tmp_path_factory.mktemp("one_node") / "run"
    run_cli("train", "--nproc", "4", *TRAIN, "--data", corpus, "--out", str(out))
    return out


def test_two_agents_train_as_one(corpus, reference, tmp_path):
    port = free_port()
    out = tmp_path / "run"
    _finish([_node(corpus, out, port, restarts=0), _node(corpus, out, port, restarts=0)])
    _assert_same_run(out, reference)


def test_a_rank_killed_on_the_second_node_restarts_both_and_ends_as_uninterrupted(
        corpus, reference, tmp_path):
    port = free_port()
    out = tmp_path / "run"
    nodes = [_node(corpus, out, port, restarts=1), _node(corpus, out, port, restarts=1)]
    kill_at = 6  # past the first save (step 4), before the second
    deadline = time.monotonic() + 180
    while not (out / "metrics.jsonl").exists() or max(_losses(out), default=0) < kill_at:
        assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline
        time.sleep(0.02)
    ranks = {}
    for node in nodes:
        ranks |= rank_pids(node.pid)
    assert sorted(ranks) == [0, 1, 2, 3], ranks
    victim = max(ranks)  # a rank of whichever agent holds rank 3: "the second node"
    os.kill(ranks[victim], signal.SIGKILL)
    said = _finish(nodes)
    assert (f"meshtrain: restart 1: rank {victim} ended without a word (killed by a signal);"
            " resumed from checkpoint step_00000004") in said, said  # as the other node saw it
    _assert_same_run(out, reference)
