"""One GPT training step on two ranks: tensor parallel (meshtrain vs PyTorch DTensor vs
megatron-core) and data parallel (meshtrain's GradientReducer vs PyTorch DDP), against one process.

Every contender trains the same GPT-2 style model (same weights, same global batch, AdamW) for
the same number of steps; repetitions alternate between contenders, every other round reversed
(A B C D D C B A A B C D ...), so that load from other work on the host hits all of them alike.
Ranked contenders run in one long-lived two-process gloo group (one thread per rank:
tests/harness.py's RankPool), so process start-up is never timed; the single-process reference
(two threads) runs in this process while the ranks wait for their next call.
The data-parallel contenders give each rank half of the batch and average the gradients.

    python benchmarks/bench_tp.py                  # hidden 512, 4 layers, s=256, V=8192, b=8
    python benchmarks/bench_tp.py --quick          # tiny sizes: a smoke run of every contender
    python benchmarks/bench_tp.py --only meshtrain-dp2,ddp-dp2,single   # a subset

megatron-core is optional: `pip install --no-deps megatron-core==0.16.1` (its own dependencies
besides torch are numpy and packaging; transformer-engine and apex are not needed on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import meshtrain
from meshtrain.parallel.runtime.data_parallel import GradientReducer
from meshtrain.parallelize import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import RankPool  # noqa: E402  (the one rank-spawning harness, tests' and ours)

WORLD = 2
LR = 1e-4
CALL_TIMEOUT = 3600.0  # far above any call at full sizes; a hung collective fails sooner,
# at the process-group timeout of the ranks (tests/harness.py)
LOSS_RTOL = 1e-4  # TESTING.md: fp32 loss trajectory across layouts

Step = Callable[[], torch.Tensor]
"""One training step (zero grads, forward, backward, optimizer step); returns the loss."""


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int

    def config(self) -> meshtrain.GPTConfig:
        return meshtrain.GPTConfig(num_layers=self.layers, hidden_size=self.hidden,
                                   num_heads=self.heads, vocab_size=self.vocab,
                                   max_seq_len=self.seq)

    @property
    def flop_formula(self) -> str:
        return FLOP_FORMULA

    def flops(self) -> float:
        """Matmul FLOPs of one forward + backward (backward = 2 x forward), as in FLOP_FORMULA."""
        b, s, h, L, V = self.batch, self.seq, self.hidden, self.layers, self.vocab
        f = 4 * h
        return 6 * b * s * (L * (4 * h * h + 2 * h * f) + h * V) + 12 * L * b * s * s * h

    def __str__(self) -> str:
        return (f"GPT L={self.layers} h={self.hidden} heads={self.heads} s={self.seq}"
                f" V={self.vocab} b={self.batch}")


FLOP_FORMULA = (
    "FLOPs/step = 6*b*s*(L*(4h^2 + 2h*4h) + h*V) + 12*L*b*s^2*h\n"
    "  (matmuls only, backward = 2x forward: QKV+proj+MLP weights 12h^2 per layer at 6 FLOPs per"
    " weight per token;\n   LM head 2bshV forward + 4bshV backward; attention QK^T and AV"
    " 4bs^2h forward per layer, the causal half\n   counted as well; = Megatron-LM's"
    " 72bLsh^2(1 + s/6h + V/12hL) without recomputation)"
)

FULL = Shape(layers=4, hidden=512, heads=8, seq=256, vocab=8192, batch=8)
QUICK = Shape(layers=2, hidden=64, heads=4, seq=32, vocab=256, batch=2)


def make_batch(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The same token ids and next-token targets for every contender and every step."""
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(shape.vocab, (shape.batch, shape.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@functools.cache
def dense_weights(shape: Shape) -> dict[str, torch.Tensor]:
    """meshtrain's dense weights at seed 0: the peers start from them, so losses must agree."""
    model = meshtrain.build_model(shape.config(), meshtrain.ParallelMesh.local(), seed=0)
    return {name: t.detach() for name, t in model.state_dict().items()}


def training_step(params, forward_backward: Callable[[], torch.Tensor],
                  zero_grad: Callable[[], None] | None = None) -> Step:
    """Plain AdamW for every contender, so the optimizer's cost is part of each step alike.

    `zero_grad` replaces the optimizer's where gradients live in buffers that must be kept.
    """
    opt = torch.optim.AdamW(params, lr=LR)
    zero_grad = zero_grad or functools.partial(opt.zero_grad, set_to_none=True)

    def step() -> torch.Tensor:
        zero_grad()
        loss = forward_backward()
        opt.step()
        return loss

    return step


class Unavailable(Exception):
    """A contender that cannot run here; the message says why."""


class Contender:
    """One implementation of the training step.

    `ranks == 1`: built and timed in the parent process with two threads. `ranks > 1` (WORLD,
    or bench_pipeline.py's --pp): built in every worker process (one thread each) in list order,
    so process groups are created in the same order on all ranks. `build` runs once; the step
    it returns is timed many times.
    """

    name: str
    key: str  # its spelling in --only
    ranks: int
    reference = False  # the single process that the others are compared with

    def build(self, shape: Shape) -> Step:
        raise NotImplementedError


# -------------------------------------------------------------------------------------------
# meshtrain
# -------------------------------------------------------------------------------------------

def _meshtrain_step(shape: Shape, mesh: meshtrain.ParallelMesh) -> Step:
    """The shape's model (any family: bench_llama.py shares these contenders) at seed 0."""
    cfg = shape.config()
    model = build_model(cfg, mesh, seed=0)
    ids, targets = make_batch(shape)

    def forward_backward() -> torch.Tensor:
        loss = model.loss(model(ids), targets)
        loss.backward()
        return loss.detach()

    return training_step(model.parameters(), forward_backward)


class MeshtrainTP(Contender):
    name = "meshtrain tp=2"
    key = "meshtrain-tp2"
    ranks = WORLD

    def build(self, shape: Shape) -> Step:
        return _meshtrain_step(shape, meshtrain.init_parallel(tp=WORLD))


class SingleProcess(Contender):
    name = "single process (meshtrain dense)"
    key = "single"
    ranks = 1
    reference = True

    def build(self, shape: Shape) -> Step:
        return _meshtrain_step(shape, meshtrain.ParallelMesh.local())


# -------------------------------------------------------------------------------------------
# PyTorch DTensor tensor parallelism on a plain dense GPT
# -------------------------------------------------------------------------------------------

class DenseBlock(nn.Module):
    """Pre-LN block with separate q, k, v projections, so ColwiseParallel splits whole heads."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.head_dim = h // heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.proj = (nn.Linear(h, h) for _ in range(4))
        self.fc, self.fc_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln1(x)
        # Under TP the projections return this rank's heads only: -1 is the local head count.
        q, k, v = (p(y).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class DenseGPT(nn.Module):
    """GPT-2 (learned positions, pre-LN, GeLU MLP of 4h, tied embedding) in plain torch.nn."""

    def __init__(self, shape: Shape):
        super().__init__()
        h = shape.hidden
        self.wte, self.wpe = nn.Embedding(shape.vocab, h), nn.Embedding(shape.seq, h)
        self.blocks = nn.ModuleList(DenseBlock(h, shape.heads) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, shape.vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def load_meshtrain_(self, weights: dict[str, torch.Tensor]) -> None:
        state = {"wte.weight": weights["embedding.word.weight"],
                 "lm_head.weight": weights["embedding.word.weight"],
                 "wpe.weight": weights["embedding.position.weight"],
                 "ln_f.weight": weights["final_norm.weight"],
                 "ln_f.bias": weights["final_norm.bias"]}
        for i in range(len(self.blocks)):
            src, dst = f"layers.{i}.", f"blocks.{i}."
            for kind in ("weight", "bias"):
                parts = weights[f"{src}attn.qkv.{kind}"].chunk(3)
                for q_k_v, part in zip("qkv", parts, strict=True):
                    state[f"{dst}{q_k_v}.{kind}"] = part
                for theirs, ours in (("ln1", "ln1"), ("ln2", "ln2"), ("attn.proj", "proj"),
                                     ("mlp.fc", "fc"), ("mlp.proj", "fc_proj")):
                    state[f"{dst}{ours}.{kind}"] = weights[f"{src}{theirs}.{kind}"]
        self.load_state_dict(state)


def dtensor_tp_step(model: nn.Module, shape, *, column: tuple[str, ...], row: tuple[str, ...],
                    tied: bool) -> Step:
    """A dense model (`wte`, `blocks.<i>.<name>`, `lm_head`) under PyTorch DTensor tensor
    parallelism: `column` layers of every block Colwise, `row` layers Rowwise, the embedding and
    the head split over the vocabulary, the loss computed by `loss_parallel`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate()),  # vocab-split embedding
        # Vocab-split head; its logits stay a Shard(-1) DTensor for loss_parallel.
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    for i in range(shape.layers):
        plan |= {f"blocks.{i}.{name}": ColwiseParallel() for name in column}
        plan |= {f"blocks.{i}.{name}": RowwiseParallel() for name in row}
    parallelize_module(model, init_device_mesh("cpu", (WORLD,)), plan)
    if tied:  # parallelize_module gives the head a Parameter of its own; the embedding and
        model.lm_head.weight = model.wte.weight  # the head are both Shard(0): tying is exact
    ids, targets = make_batch(shape)

    def forward_backward() -> torch.Tensor:
        with loss_parallel():  # backward must run inside it too
            logits = model(ids)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        return loss.detach().to_local()

    return training_step(model.parameters(), forward_backward)


class DTensorTP(Contender):
    name = "PyTorch DTensor tp=2"
    key = "dtensor-tp2"
    ranks = WORLD

    def build(self, shape: Shape) -> Step:
        model = DenseGPT(shape)
        model.load_meshtrain_(dense_weights(shape))
        return dtensor_tp_step(model, shape, column=("q", "k", "v", "fc"),
                               row=("proj", "fc_proj"), tied=True)


# -------------------------------------------------------------------------------------------
# megatron-core tensor-parallel layers
# -------------------------------------------------------------------------------------------

def _filled_with(full: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A megatron `init_method` that writes `full` into the master weight it is handed."""
    def init(master: torch.Tensor) -> None:
        with torch.no_grad():
            master.copy_(full)
    return init


def _layernorm(h: int, weights: dict[str, torch.Tensor], prefix: str) -> nn.LayerNorm:
    norm = nn.LayerNorm(h)
    norm.load_state_dict({"weight": weights[f"{prefix}.weight"], "bias": weights[f"{prefix}.bias"]})
    return norm


class MegatronBlock(nn.Module):
    """The same block on megatron's Column/RowParallelLinear, with megatron's fused QKV layout
    (rows ordered head by head, q k v within a head), so a contiguous split gives whole heads.
    Activations stay [b, s, h] like the other contenders (megatron's layers do not care
    without sequence parallelism). Biases are megatron's zeros, as meshtrain's are."""

    def __init__(self, shape: Shape, mtp, config, weights: dict[str, torch.Tensor], i: int):
        super().__init__()
        h, heads = shape.hidden, shape.heads
        self.head_dim = h // heads
        src = f"layers.{i}."
        qkv = weights[f"{src}attn.qkv.weight"].view(3, heads, self.head_dim, h)
        qkv = qkv.transpose(0, 1).reshape(3 * h, h)

        def column(full: torch.Tensor):
            return mtp.ColumnParallelLinear(full.shape[1], full.shape[0], config=config,
                                            init_method=_filled_with(full), bias=True,
                                            gather_output=False)

        def row(full: torch.Tensor):
            return mtp.RowParallelLinear(full.shape[1], full.shape[0], config=config,
                                         init_method=_filled_with(full), bias=True,
                                         input_is_parallel=True, skip_bias_add=False)

        self.ln1 = _layernorm(h, weights, f"{src}ln1")
        self.ln2 = _layernorm(h, weights, f"{src}ln2")
        self.qkv, self.proj = column(qkv), row(weights[f"{src}attn.proj.weight"])
        self.fc, self.fc_proj = (column(weights[f"{src}mlp.fc.weight"]),
                                 row(weights[f"{src}mlp.proj.weight"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv, _ = self.qkv(self.ln1(x))
        q, k, v = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out, _ = self.proj(attn.transpose(1, 2).reshape(b, s, -1))
        x = x + out
        y, _ = self.fc(self.ln2(x))
        y, _ = self.fc_proj(F.gelu(y, approximate="tanh"))
        return x + y


class MegatronGPT(nn.Module):
    """Vocab-parallel embedding tied to a weightless ColumnParallelLinear head, as in Megatron."""

    def __init__(self, shape: Shape, mtp, config, weights: dict[str, torch.Tensor]):
        super().__init__()
        h = shape.hidden
        word = weights["embedding.word.weight"]
        self.wte = mtp.VocabParallelEmbedding(shape.vocab, h, init_method=_filled_with(word),
                                              config=config)
        self.wpe = nn.Embedding(shape.seq, h)
        self.wpe.load_state_dict({"weight": weights["embedding.position.weight"]})
        self.blocks = nn.ModuleList(MegatronBlock(shape, mtp, config, weights, i)
                                    for i in range(shape.layers))
        self.ln_f = _layernorm(h, weights, "final_norm")
        self.head = mtp.ColumnParallelLinear(h, shape.vocab, config=config,
                                             init_method=_filled_with(word), bias=False,
                                             skip_weight_param_allocation=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits, _ = self.head(self.ln_f(x), weight=self.wte.weight)
        return logits  # [b, s, V/tp]


class MegatronTP(Contender):
    name = "megatron-core tp=2"
    key = "megatron-tp2"
    ranks = WORLD

    def build(self, shape: Shape) -> Step:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
            warnings.simplefilter("ignore")
            try:
                from megatron.core import ModelParallelConfig, parallel_state
                from megatron.core import tensor_parallel as mtp
            except ImportError as exc:
                raise Unavailable(f"megatron-core is not importable ({exc}); install it with"
                                  " pip install --no-deps megatron-core==0.16.1") from exc
        # Its CUDA-stream scheduling advice; CPU collectives have no such knob.
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
        if shape.vocab % WORLD:
            raise Unavailable(f"megatron's layers need the vocabulary ({shape.vocab}) divisible"
                              f" by tp ({WORLD})")
        parallel_state.initialize_model_parallel(WORLD)
        config = ModelParallelConfig(tensor_model_parallel_size=WORLD,
                                     use_cpu_initialization=True)
        model = MegatronGPT(shape, mtp, config, dense_weights(shape))
        ids, targets = make_batch(shape)

        def forward_backward() -> torch.Tensor:
            loss = mtp.vocab_parallel_cross_entropy(model(ids), targets).mean()
            loss.backward()
            return loss.detach()

        return training_step(model.parameters(), forward_backward)


# -------------------------------------------------------------------------------------------
# Data parallelism: the dense model on half of the batch per rank, gradients averaged
# -------------------------------------------------------------------------------------------

def _rank_share(shape: Shape, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous half of the batch: together the ranks see the single process's."""
    ids, targets = make_batch(shape)
    return ids.chunk(WORLD)[rank], targets.chunk(WORLD)[rank]


def _global_mean(loss: torch.Tensor) -> torch.Tensor:
    """The ranks' losses are means over equally many tokens, so their average is the loss of the
    whole batch, comparable with the other contenders' (Trainer.train_step reports it so too)."""
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss


class MeshtrainDP(Contender):
    name = "meshtrain dp=2"
    key = "meshtrain-dp2"
    ranks = WORLD

    def build(self, shape: Shape) -> Step:
        mesh = meshtrain.init_parallel(dp=WORLD, device="cpu")
        model = meshtrain.build_model(shape.config(), mesh, seed=0)
        # Gradients are views into the reducer's buckets: it zeroes them, never the optimizer.
        reducer = GradientReducer(list(model.parameters()), mesh.dp_cp)
        ids, targets = _rank_share(shape, mesh.dp.rank)

        def forward_backward() -> torch.Tensor:
            reducer.sync = True  # the step's one (and so last) micro-batch
            loss = model.loss(model(ids), targets)
            loss.backward()
            reducer.wait()
            return _global_mean(loss.detach())

        return training_step(model.parameters(), forward_backward, zero_grad=reducer.zero_grad)


class DDP(Contender):
    name = "PyTorch DDP dp=2"
    key = "ddp-dp2"
    ranks = WORLD

    def build(self, shape: Shape) -> Step:
        # meshtrain's dense GPT, so that only the gradient averaging differs from meshtrain dp=2.
        model = meshtrain.build_model(shape.config(), meshtrain.ParallelMesh.local(), seed=0)
        ddp = nn.parallel.DistributedDataParallel(model)
        ids, targets = _rank_share(shape, dist.get_rank())

        def forward_backward() -> torch.Tensor:
            loss = model.loss(ddp(ids), targets)
            loss.backward()
            return _global_mean(loss.detach())

        return training_step(ddp.parameters(), forward_backward)


CONTENDERS: list[Contender] = [MeshtrainTP(), DTensorTP(), MegatronTP(), MeshtrainDP(), DDP(),
                               SingleProcess()]


# -------------------------------------------------------------------------------------------
# Timing
# -------------------------------------------------------------------------------------------

def time_steps(step: Step, n: int,
               sync: Callable[[], None] | None) -> tuple[list[float], list[float]]:
    """Wall time of each of `n` steps (each started after `sync`) and their losses."""
    times, losses = [], []
    for _ in range(n):
        if sync is not None:
            sync()
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return times, losses


def matmul_peak(n: int, threads: int, reps: int = 5) -> float:
    """Best fp32 FLOP/s of an n x n x n matmul: the ceiling a step's matmuls can reach."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


_ranked_steps: dict[int, Step] = {}  # in the rank processes only: built contenders by index


def _build_ranked(shape: Shape, contenders: list[Contender]) -> dict[int, str]:
    """On every rank: build the ranked contenders in list order (so process groups are created
    in the same order on all ranks); {index: why} of those that cannot run here."""
    _ranked_steps.clear()
    unavailable: dict[int, str] = {}
    for i, contender in enumerate(contenders):
        try:
            _ranked_steps[i] = contender.build(shape)
        except Unavailable as exc:
            unavailable[i] = str(exc)
    return unavailable


def _time_ranked(index: int, n: int) -> tuple[list[float], list[float]]:
    """On every rank: `n` steps of contender `index`, each started after a barrier."""
    return time_steps(_ranked_steps[index], n, dist.barrier)


def _ranked_attribute(index: int, name: str):
    """On every rank: contender `index`'s `step.<name>` (`memory`, `trace`), if it has one."""
    return getattr(_ranked_steps[index], name, {})


@dataclass
class Result:
    contender: Contender
    rounds: list[list[float]]  # measured step times, one list per round
    losses: list[float]  # every step's loss, warmup included

    memory: list[dict] = dataclasses.field(default_factory=list)  # per rank, if measured
    trace: list = dataclasses.field(default_factory=list)  # per rank, what `step.trace` kept

    @property
    def median(self) -> float:
        return statistics.median(t for r in self.rounds for t in r)


def parse_args(argv: list[str] | None, candidates: list[Contender], description: str,
               more_flags: Callable[[argparse.ArgumentParser], None] = lambda parser: None
               ) -> tuple[argparse.Namespace, list[Contender]]:
    """The flags every benchmark shares (and a benchmark's own, added by `more_flags`), and the
    contenders `--only` chose."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    more_flags(parser)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    keys = [c.key for c in candidates]
    parser.add_argument("--only", metavar="NAMES", default=",".join(keys),
                        help=f"comma-separated contenders to run (default: all): {','.join(keys)}")
    args = parser.parse_args(argv)
    for flag, least in (("steps", 1), ("warmup", 0), ("rounds", 1)):
        if getattr(args, flag) < least:
            parser.error(f"--{flag} must be at least {least}, got {getattr(args, flag)}")
    only = {k.strip() for k in args.only.split(",")}
    if unknown := sorted(only - set(keys)):
        parser.error(f"--only: unknown contender(s) {', '.join(unknown)}; choose from"
                     f" {', '.join(keys)}")
    return args, [c for c in candidates if c.key in only]


def measure(args, shape: Shape, contenders: list[Contender],
            world: int = WORLD) -> tuple[list[Result], dict]:
    """Build the contenders (ranked ones in long-lived workers, `world` of them), time them
    alternately, collect any memory figures and traces; returns the results and {name: why} of
    those that cannot run here. A single-process contender runs with its `threads` (default
    2)."""
    ranked = [c for c in contenders if c.ranks > 1]
    assert all(c.ranks == world for c in ranked), "every ranked contender runs on `world`"
    local = [c for c in contenders if c.ranks == 1]
    with RankPool(world) as pool:
        torch.set_num_threads(2)
        local_steps = {id(c): c.build(shape) for c in local}
        unavailable = pool.run(_build_ranked, shape, ranked, timeout=CALL_TIMEOUT)[0]

        def run(c: Contender, n: int) -> tuple[list[float], list[float]]:
            if c.ranks == 1:
                torch.set_num_threads(getattr(c, "threads", 2))
                return time_steps(local_steps[id(c)], n, None)
            per_rank = pool.run(_time_ranked, ranked.index(c), n, timeout=CALL_TIMEOUT)
            # per step, the slowest rank's time (the step ends when every rank has finished)
            times = [max(ts) for ts in zip(*(t for t, _ in per_rank), strict=True)]
            return times, per_rank[0][1]

        results = [Result(c, [], []) for c in contenders
                   if c.ranks == 1 or ranked.index(c) not in unavailable]
        # One warmup round (when asked for), then the measured rounds; contenders alternate,
        # every other round in reverse order, so a load that rises or falls through a round
        # weighs on a contender and its neighbours alike over two rounds.
        rounds = [False] * bool(args.warmup) + [True] * args.rounds
        for n, measured in enumerate(rounds):
            for r in results if n % 2 == 0 else results[::-1]:
                times, losses = run(r.contender, args.steps if measured else args.warmup)
                r.losses += losses
                if measured:
                    r.rounds.append(times)
        for r in results:
            if r.contender.ranks > 1:
                index = ranked.index(r.contender)
                r.memory = pool.run(_ranked_attribute, index, "memory", timeout=CALL_TIMEOUT)
                r.trace = pool.run(_ranked_attribute, index, "trace", timeout=CALL_TIMEOUT)
            else:
                r.memory = [getattr(local_steps[id(r.contender)], "memory", {})]
    return results, {ranked[i].name: why for i, why in unavailable.items()}


def main(argv: list[str] | None = None, candidates: list[Contender] | None = None,
         description: str = __doc__, shapes: tuple = (FULL, QUICK)) -> int:
    """Parse the flags, time the chosen contenders alternately, print the table. Other
    benchmarks (bench_zero.py, bench_llama.py) pass their own `candidates` (and `shapes`: full,
    quick); bench_pipeline.py reuses `parse_args` and `measure` with a report of its own."""
    args, contenders = parse_args(argv, CONTENDERS if candidates is None else candidates,
                                  description)
    shape = shapes[1] if args.quick else shapes[0]
    peak_n = 256 if args.quick else 2048
    # Peaks first, before any rank process exists to compete for the cores.
    peak1, peak2 = matmul_peak(peak_n, 1), matmul_peak(peak_n, 2)
    results, unavailable = measure(args, shape, contenders)
    report(args, shape, peak_n, peak1, peak2, results, unavailable)
    return 0


def report(args, shape: Shape, peak_n: int, peak1: float, peak2: float, results: list[Result],
           unavailable: dict[str, str]) -> None:
    flops = shape.flops()
    total_steps = args.warmup + args.rounds * args.steps
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"model: {shape}, fp32, dropout 0; step = zero_grad + forward + backward + AdamW")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; ranked contenders: {WORLD} gloo"
          f" processes x 1 thread (dp: b/{WORLD} per rank); single process: 2 threads")
    print(f"schedule: {args.warmup} warmup steps, then {args.rounds} rounds x {args.steps} steps"
          " per contender, contenders alternating (every other round reversed);"
          " time = median step (ranked: slowest rank)")
    print(shape.flop_formula)
    print(f"  = {flops / 1e9:.2f} GFLOP per step")
    print(f"fp32 matmul peak ({peak_n}^3, best of 5): 1 thread {peak1 / 1e9:.1f} GFLOP/s,"
          f" 2 threads {peak2 / 1e9:.1f} GFLOP/s; ranked contenders are measured against"
          f" 2 x the 1-thread peak ({2 * peak1 / 1e9:.1f})")
    reference = next((r for r in results if r.contender.reference), None)
    head = (f"{'contender':34} {'median ms':>10} {'round medians ms':>18} {'t/t_single':>10}"
            f" {'GFLOP/s':>8} {'% peak':>7}  loss first -> last ({total_steps} steps)")
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        median = r.median
        round_medians = [statistics.median(ts) for ts in r.rounds]
        spread = f"{min(round_medians) * 1e3:.0f}-{max(round_medians) * 1e3:.0f}"
        ratio = median / reference.median if reference else math.nan
        peak = peak2 if r.contender.ranks == 1 else WORLD * peak1
        achieved = flops / median
        print(f"{r.contender.name:34} {median * 1e3:10.1f} {spread:>18} {ratio:10.2f}"
              f" {achieved / 1e9:8.1f} {100 * achieved / peak:6.1f}%"
              f"  {r.losses[0]:.6f} -> {r.losses[-1]:.6f}")
    for name, why in unavailable.items():
        print(f"{name:34} not run: {why}")
    measured = [r for r in results if any(r.memory)]
    if measured:
        print("\nmemory per rank, MiB (max over ranks): held = growth of resident memory from"
              " before build to after the first step; peak = held + the largest rise during a"
              " step")
        for r in measured:
            held = max(m["held"] for m in r.memory) / 2**20
            peak = max(m["held"] + m["transient"] for m in r.memory) / 2**20
            print(f"  {r.contender.name:34} held {held:8.1f}   peak {peak:8.1f}")
    report_loss_agreement(results, reference)


def report_loss_agreement(results: list[Result], reference: Result | None) -> None:
    """Every contender trains the same model on the same data: its last loss must match."""
    if reference:
        last = reference.losses[-1]
        worst = max(abs(r.losses[-1] - last) / abs(last) for r in results)
        verdict = "agree" if worst <= LOSS_RTOL else "DISAGREE"
        print(f"\nlast losses {verdict} with the single process: max relative difference"
              f" {worst:.1e} (tolerance {LOSS_RTOL:.0e})")
    else:
        print("\nlosses not checked: the single process was not run (--only)")


if __name__ == "__main__":
    sys.exit(main())
