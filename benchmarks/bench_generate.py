"""Greedy generation speed: meshtrain with its key/value cache, meshtrain recomputing the whole
context every step (`use_cache=False`), and transformers' `generate` (its own cache), on the same
tiny GPT and Llama; and meshtrain at tp 2, which is what `meshtrain sample --tp 2` runs.

Each model is built by transformers from a config (seed 0) and saved; `meshtrain.load_model`
reads that directory, so every contender holds the same weights, and every contender must give
the same tokens (checked against transformers; reported). The single-process contenders run in
this process with one thread (`--threads`); the tp 2 ones in two long-lived gloo ranks with one
thread each, which load the model as `meshtrain sample` does (imported with `import_hf`, then
`checkpoint_model`), so process start-up is never timed. Rounds alternate contenders
(A B C D E A B C D E ...) so host noise hits them alike. Tokens/s counts new tokens of the
whole batch. The ranks are a RankPool of tests/harness.py, the harness the tests run ranks with.

    python benchmarks/bench_generate.py             # 4 layers, hidden 256, prompt 32 + 224 new
    python benchmarks/bench_generate.py --quick     # tiny sizes: a smoke run
    python benchmarks/bench_generate.py --batch 8 --only cached,transformers
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import meshtrain
from meshtrain.checkpointing.checkpoint import resolve_checkpoint
from meshtrain.inference.generate import checkpoint_model, generate
from meshtrain.interop.hf_io import import_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import RankPool  # noqa: E402  (the one rank-spawning harness, tests' and ours)

WORLD = 2
CALL_TIMEOUT = 3600.0  # far above any call at full sizes; a hung collective fails sooner,
# at the process-group timeout of the ranks (tests/harness.py)
FAMILIES = ("gpt", "llama")
CONTENDERS = {  # key: (name, ranks, use_cache)
    "cached": ("meshtrain, KV cache", 1, True),
    "no-cache": ("meshtrain, no cache", 1, False),
    "transformers": ("transformers generate", 1, True),
    "tp2-cached": ("meshtrain tp=2, KV cache", WORLD, True),
    "tp2-no-cache": ("meshtrain tp=2, no cache", WORLD, False),
}


@dataclass(frozen=True)
class Setup:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    prompt: int
    new: int
    batch: int

    def hf_config(self, family: str) -> transformers.PretrainedConfig:
        """No end-of-sequence token, so every contender generates `new` tokens."""
        positions = self.prompt + self.new
        if family == "gpt":
            return transformers.GPT2Config(
                vocab_size=self.vocab, n_positions=positions, n_embd=self.hidden,
                n_layer=self.layers, n_head=self.heads, bos_token_id=None, eos_token_id=None)
        return transformers.LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=3 * self.hidden,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, max_position_embeddings=positions,
            bos_token_id=None, eos_token_id=None)

    def prompt_ids(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, self.vocab, (self.batch, self.prompt), generator=gen)

    def __str__(self) -> str:
        return (f"L={self.layers} h={self.hidden} heads={self.heads} (Llama: {self.kv_heads}"
                f" key/value heads, SwiGLU {3 * self.hidden}) V={self.vocab} b={self.batch},"
                f" prompt {self.prompt} + {self.new} new tokens (max_seq_len"
                f" {self.prompt + self.new})")


FULL = Setup(layers=4, hidden=256, heads=4, kv_heads=2, vocab=8192, prompt=32, new=224, batch=1)
QUICK = Setup(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, prompt=8, new=24, batch=1)


def save_models(setup: Setup, root: Path) -> dict[str, tuple[Path, Path]]:
    """Per family: a transformers model directory and the meshtrain run imported from it."""
    paths = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(setup.hf_config(family))
        hf_dir, run_dir = root / f"hf-{family}", root / f"run-{family}"
        model.save_pretrained(hf_dir)
        import_hf(hf_dir, run_dir)
        paths[family] = (hf_dir, run_dir)
    return paths


def timed(fn: Callable[..., torch.Tensor], *args, **kwargs) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def local_runs(setup: Setup, paths: dict) -> dict[tuple[str, str], Callable]:
    """(family, contender key) -> a function generating greedily from the prompt."""
    ids, new = setup.prompt_ids(), setup.new
    runs = {}
    for family, (hf_dir, _) in paths.items():
        ours = meshtrain.load_model(hf_dir)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        runs[family, "cached"] = lambda m=ours: m.generate(ids, new)
        runs[family, "no-cache"] = lambda m=ours: generate(m.lm, ids, max_new_tokens=new,
                                                           use_cache=False)
        runs[family, "transformers"] = lambda m=theirs: m.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return runs


_tp_models: dict[str, object] = {}  # in the rank processes only: family -> loaded tp model


def _load_tp(paths: dict) -> None:
    """On every tp rank: load each family's imported run as `meshtrain sample` does."""
    mesh = meshtrain.init_parallel(tp=WORLD, device="cpu")
    _tp_models.clear()
    _tp_models.update((family, checkpoint_model(resolve_checkpoint(run), mesh))
                      for family, (_, run) in paths.items())


def _generate_tp(setup: Setup, family: str, use_cache: bool) -> tuple[float, torch.Tensor]:
    """On every tp rank: this rank's time to generate after a barrier, and the tokens."""
    dist.barrier()
    return timed(generate, _tp_models[family], setup.prompt_ids(), max_new_tokens=setup.new,
                 use_cache=use_cache)


class Ranks:
    """The two long-lived tp ranks: a RankPool with each family's model loaded."""

    def __init__(self, setup: Setup, paths: dict):
        self.setup, self.pool = setup, RankPool(WORLD)
        self.pool.run(_load_tp, paths, timeout=CALL_TIMEOUT)  # a failure closes the pool

    def run(self, family: str, use_cache: bool) -> tuple[float, torch.Tensor]:
        """The slowest rank's time, and rank 0's tokens."""
        done = self.pool.run(_generate_tp, self.setup, family, use_cache, timeout=CALL_TIMEOUT)
        return max(seconds for seconds, _ in done), done[0][1]

    def close(self) -> None:
        self.pool.close()


def measure(setup: Setup, keys: list[str], rounds: int) -> dict[tuple[str, str], dict]:
    """Per (family, contender): its round times and whether its tokens equal transformers'."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = save_models(setup, Path(tmp))
        runs = local_runs(setup, paths)
        ranks = Ranks(setup, paths) if any(CONTENDERS[k][1] == WORLD for k in keys) else None
        try:
            for family, key in runs:  # a warmup round
                runs[family, key]()
            reference = {family: runs[family, "transformers"]() for family in FAMILIES}
            results = {(f, k): {"times": [], "same": True} for f in FAMILIES for k in keys}
            for _ in range(rounds):
                for family in FAMILIES:
                    for key in keys:
                        name, world, use_cache = CONTENDERS[key]
                        seconds, out = ranks.run(family, use_cache) if world == WORLD \
                            else timed(runs[family, key])
                        results[family, key]["times"].append(seconds)
                        results[family, key]["same"] &= torch.equal(out, reference[family])
        finally:
            if ranks is not None:
                ranks.close()
    return results


def report(setup: Setup, keys: list[str], results: dict) -> None:
    tokens = setup.batch * setup.new
    for family in FAMILIES:
        per_second = {k: tokens / statistics.median(results[family, k]["times"]) for k in keys}
        base = per_second.get("transformers")
        print(f"\n{'GPT-2' if family == 'gpt' else 'Llama'}: {setup}\n")
        print("| contender | median s | rounds s | tokens/s | ratio to transformers |"
              " same tokens |")
        print("|---|---|---|---|---|---|")
        for k in keys:
            times = results[family, k]["times"]
            ratio = f"{per_second[k] / base:.2f}" if base else "-"
            print(f"| {CONTENDERS[k][0]} | {statistics.median(times):.3f} |"
                  f" {min(times):.3f}-{max(times):.3f} | {per_second[k]:.1f} | {ratio} |"
                  f" {'yes' if results[family, k]['same'] else 'NO'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--batch", type=int, default=None, help="sequences generated at once")
    parser.add_argument("--threads", type=int, default=1, help="of the single process")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--only", metavar="NAMES", default=",".join(CONTENDERS),
                        help=f"comma-separated contenders (default: all): {','.join(CONTENDERS)}")
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.only.split(",")]
    if unknown := sorted(set(keys) - set(CONTENDERS)):
        parser.error(f"--only: unknown contender(s) {', '.join(unknown)}")
    if "transformers" not in keys:
        keys.append("transformers")  # the reference of the ratios and the tokens
    setup = QUICK if args.quick else FULL
    if args.batch is not None:
        setup = Setup(**{**setup.__dict__, "batch": args.batch})
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.rounds}"
          f" rounds after one warmup round, {args.threads} thread(s) in the single process")
    report(setup, keys, measure(setup, keys, args.rounds))
    return 0


if __name__ == "__main__":
    assert not dist.is_initialized()
    sys.exit(main())
