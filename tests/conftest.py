import os
import sys

# Single-process tests share two cores with rank pools: keep torch to one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
# This tree's own sources first, also for the CLI subprocesses the tests start, so a git worktree
# tests its code even where the environment's editable install points at another checkout.
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
sys.path.insert(0, _SRC)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_SRC, os.environ.get("PYTHONPATH")]))

import torch  # noqa: E402

torch.set_num_threads(1)
