import os
import sys

# Single-process tests share two cores with rank pools: keep torch to one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

torch.set_num_threads(1)
