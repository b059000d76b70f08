"""One training step of a DeepSeek-V3-shaped model in one process: meshtrain's model against
transformers' DeepseekV3ForCausalLM holding the same weights, side by side in one run.

transformers' model is built at random (seed 0), saved, and imported by `meshtrain import-hf`
(the family's Hugging Face mapping), so both hold the same weights; their logits and loss are
checked equal (1e-5, fp32) before timing. A step is forward, next-token cross-entropy, backward
and torch's AdamW (the same optimizer settings for both): the models' work, without meshtrain's
trainer around it (data loading, metrics; the choice-bias update is a few element-wise ops).
Shapes: `tiny` is deepseek-v3-tiny's (4 layers, the first dense, hidden 64, 8 of 8 experts
top-2 from 1 of 2 groups plus a shared one); `small` is a CPU-sized step up (hidden 256,
16 experts top-4 from 2 of 4 groups).

The contenders alternate within each round (A B A B ...), so load from other work on the host
hits them alike; each one's time is its median step, and the output gives meshtrain's median
over transformers' (below 1: meshtrain is faster). Prints one JSON object.

    PYTHONPATH=src python benchmarks/bench_deepseek_step.py --shape small --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

import meshtrain
from meshtrain.cli.main import main as meshtrain_main

SHAPES = {  # name: (DeepseekV3Config fields, micro-batch, sequence length)
    "tiny": (dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                  moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=8,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                  q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=8), 8, 128),
    "small": (dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                   moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=16,
                   n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                   q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
                   v_head_dim=16), 8, 256),
}


def hf_config(shape: str) -> transformers.DeepseekV3Config:
    fields, _, seq = SHAPES[shape]
    return transformers.DeepseekV3Config(
        **fields, num_key_value_heads=fields["num_attention_heads"], n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=seq,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None, eos_token_id=None)


def both_models(shape: str, root: Path):
    """transformers' model at random and meshtrain's import of it."""
    torch.manual_seed(0)
    theirs = transformers.DeepseekV3ForCausalLM(hf_config(shape)).train()
    theirs.save_pretrained(root / "hf")
    with contextlib.redirect_stdout(io.StringIO()):  # its one line would break the JSON
        imported = meshtrain_main(["import-hf", str(root / "hf"), "--out", str(root / "run")])
    if imported != 0:
        raise SystemExit("import-hf failed")
    ours = meshtrain.load_model(root / "run").train()
    return ours, theirs


def stepper(model, ids: torch.Tensor, *, ours: bool):
    """One training step of `model` on `ids` (AdamW, lr 1e-4); returns the step's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1]) if ours else model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        return loss.item()
    return step


def check_equal(ours, theirs, ids: torch.Tensor) -> float:
    """Logits equal within 1e-5 before any step; returns the largest difference."""
    with torch.no_grad():
        diff = (ours(ids).float() - theirs(ids).logits).abs().max().item()
    if diff > 1e-5:
        raise SystemExit(f"logits differ by {diff:.3g}: not the same model")
    return diff


def run(shape: str, rounds: int, steps: int) -> dict:
    _, batch, seq = SHAPES[shape]
    vocab = SHAPES[shape][0]["vocab_size"]
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = both_models(shape, Path(tmp))
    diff = check_equal(ours, theirs, ids[:, :-1])
    steps_of = {"meshtrain": stepper(ours, ids, ours=True),
                "transformers": stepper(theirs, ids, ours=False)}
    first = {name: step() for name, step in steps_of.items()}  # warm-up, and the losses
    times = {name: [] for name in steps_of}
    for _ in range(rounds):
        for name, step in steps_of.items():
            for _ in range(steps):
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"shape": shape, "tokens_per_step": batch * seq, "threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "torch": torch.__version__,
            "experts_implementation": getattr(theirs.config, "_experts_implementation", None),
            "logits_max_diff": diff, "first_step_loss": first,
            "median_step_ms": {k: round(v, 2) for k, v in ms.items()},
            "meshtrain_over_transformers": round(ms["meshtrain"] / ms["transformers"], 3),
            "steps_timed_each": rounds * steps}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per contender per round")
    args = parser.parse_args()
    print(json.dumps(run(args.shape, args.rounds, args.steps), indent=1))
