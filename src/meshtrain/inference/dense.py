"""The dense reference API: a whole model in one process, with no launcher or process group.

    model = meshtrain.load_model("runs/a")          # a run, a checkpoint or a Hugging Face dir
    logits = model(ids)                             # ids [b, s] -> [b, s, V], the real vocabulary
    out = model.generate(ids, max_new_tokens=20)    # greedy; temperature > 0 samples

It is the family's `CausalLM` on `ParallelMesh.local()` (the same code every layout runs) behind
a thin wrapper; generation is `generate.generate` (with its key/value cache).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.inference.generate import generate
from meshtrain.interop.checkpoint_formats import checkpoint_format
from meshtrain.mesh import ParallelMesh
from meshtrain.models import CausalLM, TransformerConfig
from meshtrain.parallelize import build_model


class DenseModel(nn.Module):
    """A one-process model in eval mode: token ids -> logits over the real vocabulary."""

    def __init__(self, lm: CausalLM):
        super().__init__()
        self.lm = lm
        self.eval()

    @property
    def cfg(self) -> TransformerConfig:
        return self.lm.cfg

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm.full_logits(self.lm(ids))  # [b, s, V]

    def generate(self, ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, seed: int = 0) -> torch.Tensor:
        """`ids` [b, s] extended by `max_new_tokens` tokens: greedy at temperature 0, else drawn
        from softmax(logits / temperature) over the `top_k` most likely tokens (None: all)."""
        if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
            raise SettingError(Code.RANGE,
                               "max_new_tokens and temperature must be >= 0, top_k positive",
                               settings=("max_new_tokens", "temperature", "top_k"))
        if temperature == 0:
            return generate(self.lm, ids, max_new_tokens=max_new_tokens)
        return generate(self.lm, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k or self.cfg.vocab_size, seed=seed)


def load_model(path: str | Path, device: str | torch.device = "cpu") -> DenseModel:
    """The model of a meshtrain run or checkpoint directory (any layout), of a Hugging Face
    model directory (config.json + safetensors) or of a DCP export, whole on `device`, in eval
    mode."""
    mesh = ParallelMesh.local(device)
    source = checkpoint_format(path)
    lm = build_model(source.model(Path(path), None), mesh, seed=0)
    source.load(Path(path), lm, mesh, None)
    return DenseModel(lm)
