"""The training loop run by every rank: data -> forward/backward over micro-batches ->
gradient reduction -> clipping -> AdamW step -> metrics, evaluation and checkpoints."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from meshtrain import data
from meshtrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from meshtrain.config import RunConfig
from meshtrain.memory import model_state_bytes
from meshtrain.mesh import ParallelMesh, init_parallel
from meshtrain.metrics import MetricsLog, Progress, StepTimer, read_metrics
from meshtrain.model import GPT, StageSpec
from meshtrain.optim import build_adamw, clip_grad_norm_, lr_at
from meshtrain.parallel import comm
from meshtrain.parallel.context import context_parallel_positions
from meshtrain.parallel.data import GradientReducer
from meshtrain.parallel.pipeline import PipeDream2BW, ScheduleRun, run_schedule, stage_layers
from meshtrain.parallel.pipeline_trace import gather_timeline, write_trace
from meshtrain.parallel.schedules import (
    FORWARD,
    RECV_ACTIVATION,
    SEND_ACTIVATION,
    Action,
    gpipe,
    interleaved,
    model_chunk,
    one_f_one_b,
)
from meshtrain.parallel.zero import ZeroDataParallel, unit_parameters
from meshtrain.plots import plot_loss_curve
from meshtrain.precision import LossScaler, MasterWeights, parse_dtype


def load_corpus(cfg: RunConfig) -> tuple:
    """(tokens, vocabulary size) of --data, or the embedded standard-library corpus."""
    if cfg.data.data is None:
        return data.stdlib_corpus(), data.BYTE_VOCAB_SIZE
    return data.load_tokens(cfg.data.data)


class MoEStats:
    """Routing of one optimizer step summed over micro-batches and MoE layers."""

    def __init__(self) -> None:
        self.tokens_per_expert: dict[int, torch.Tensor] = {}  # id(MoE layer) -> [E]
        self.counts = torch.zeros(3)  # dropped, assigned, aux loss (summed over layers)

    def add(self, model: GPT, chunk: int | None = None) -> None:
        """Add the latest forward's routing (of local model chunk `chunk`, or all layers)."""
        layers = model.moe_layers(chunk)
        if not layers:
            return
        for m in layers:
            tokens = m.last_stats["tokens_per_expert"].cpu()
            self.tokens_per_expert[id(m)] = self.tokens_per_expert.get(id(m), 0) + tokens
        self.counts += torch.tensor([
            sum(float(m.last_stats["dropped"]) for m in layers),
            sum(float(m.last_stats["assigned"]) for m in layers),
            sum(m.last_aux_loss.item() for m in layers)])

    def summary(self, mesh: ParallelMesh, num_micro_batches: int, *, moe: bool) -> dict:
        """Over the whole global batch (summed over DP ranks, and over pipeline stages):
        tokens each expert processed (min/mean/max over layers and experts), drop rate, aux
        loss per micro-batch. Every rank of a pipeline joins, with or without MoE layers."""
        if not moe:
            return {}
        device = mesh.device
        per_layer = list(self.tokens_per_expert.values())  # the same order on every dp rank
        tokens = torch.stack(per_layer).double().to(device) if per_layer \
            else torch.zeros(0, 1, dtype=torch.double, device=device)
        counts = self.counts.double().to(device)
        comm.all_reduce(tokens, mesh.dp_cp)
        comm.all_reduce(counts, mesh.dp_cp)
        spread = torch.tensor([tokens.sum().item(), tokens.numel()], dtype=torch.double,
                              device=device)
        low = torch.tensor(tokens.min().item() if tokens.numel() else math.inf, device=device)
        high = torch.tensor(tokens.max().item() if tokens.numel() else -math.inf, device=device)
        for tensor, op in ((counts, None), (spread, None), (low, torch.distributed.ReduceOp.MIN),
                           (high, torch.distributed.ReduceOp.MAX)):
            comm.all_reduce(tensor, mesh.pp, op=op or torch.distributed.ReduceOp.SUM)
        aux = counts[2].item() / (num_micro_batches * mesh.dp_cp.size)
        return {"moe_tokens_per_expert_min": low.item(),
                "moe_tokens_per_expert_mean": (spread[0] / spread[1]).item(),
                "moe_tokens_per_expert_max": high.item(),
                "moe_drop_rate": (counts[0] / counts[1]).item(), "moe_aux_loss": aux}


@dataclasses.dataclass
class Trainer:
    """One rank's view of a run: the sharded model, its optimizer and its data."""

    cfg: RunConfig
    mesh: ParallelMesh
    model: GPT
    optimizer: torch.optim.Optimizer
    reducers: list[GradientReducer] | list[ZeroDataParallel]  # dense, then experts
    train_data: data.BatchSampler
    eval_data: data.BatchSampler
    masters: MasterWeights | None  # fp32 copies the optimizer steps (16-bit precision)
    scaler: LossScaler
    count_saved_bytes: bool = False  # pipeline: count autograd's saved bytes per chunk
    last_schedule_run: ScheduleRun | None = None  # pipeline: the latest step's peaks
    pipedream: PipeDream2BW | None = None  # --pp-schedule 2bw: state across steps
    resumed_previous: list[torch.Tensor] | None = None  # 2BW: W(t - 1) from a checkpoint

    @classmethod
    def build(cls, cfg: RunConfig, mesh: ParallelMesh) -> Trainer:
        tokens, vocab = load_corpus(cfg)
        train_tokens, val_tokens = data.split_tokens(tokens, cfg.data.val_fraction)
        t = cfg.train
        gpt = cfg.gpt_config(vocab)
        pp = mesh.pp
        v = cfg.parallel.virtual_stages if pp.size > 1 else 1
        split = cfg.pp_split() if pp.size > 1 else None  # a one-rank reference ignores them
        chunks = stage_layers(gpt.num_layers, pp.size * v, split)
        stage = StageSpec(tuple(chunks[model_chunk(pp.rank, c, pp.size)] for c in range(v)),
                          has_embedding=pp.rank == 0, has_head=pp.rank == pp.size - 1)
        model = GPT(gpt, mesh=mesh, seed=t.seed, plan=cfg.plan(), stage=stage)
        precision = parse_dtype(t.precision, "--precision")
        model.to(precision)
        grad_dtype = parse_dtype(t.grad_dtype, "--grad-dtype")
        if cfg.parallel.zero:
            reducers = cls._sharded(cfg, mesh, model, grad_dtype)
            pieces = [pair for reducer in reducers for pair in reducer.step_pieces()]
            masters = None
            optimizer = build_adamw([piece for _, piece in pieces], lr=t.lr,
                                    weight_decay=t.weight_decay,
                                    no_decay={id(piece) for p, piece in pieces if p.dim() < 2})
        else:
            # Dense parameters are replicated over dp x cp, experts only over their edp
            # replicas. An expert's gradient already sums the losses of all ep ranks whose
            # tokens it served; averaging over edp and 1/ep gives the mean over dp x cp.
            experts = model.expert_parameters()
            bucket = int(cfg.parallel.bucket_mb * 2**20)
            reducers = [GradientReducer([p for p in model.parameters() if id(p) not in experts],
                                        mesh.dp_cp, bucket_bytes=bucket, grad_dtype=grad_dtype)]
            if experts:
                reducers.append(GradientReducer(
                    [p for p in model.parameters() if id(p) in experts], mesh.axis("edp"),
                    bucket_bytes=bucket, grad_dtype=grad_dtype, scale=1.0 / mesh.ep.size))
            # 2BW: the optimizer steps separate fp32 copies, the model holds in-flight versions
            two_weights = cfg.parallel.pp_schedule == "2bw" and pp.size > 1
            masters = MasterWeights(list(model.parameters())) \
                if precision != torch.float32 or two_weights else None
            optimizer = build_adamw(masters.params if masters else model.parameters(),
                                    lr=t.lr, weight_decay=t.weight_decay)
        scaler = LossScaler(enabled=precision == torch.float16,
                            growth_interval=t.loss_scale_window)
        sampler = dict(seq_len=t.seq_len, global_batch=t.global_batch,
                       micro_batch=t.micro_batch, seed=t.seed)
        return cls(cfg, mesh, model, optimizer, reducers,
                   data.BatchSampler(train_tokens, **sampler),
                   data.BatchSampler(val_tokens, **sampler), masters, scaler)

    @staticmethod
    def _sharded(cfg: RunConfig, mesh: ParallelMesh, model: GPT,
                 grad_dtype: torch.dtype) -> list[ZeroDataParallel]:
        """ZeRO over dp x cp for dense parameters and over edp for experts (as above)."""
        p = cfg.parallel
        blocks = list(model.layers.values())
        units = unit_parameters(model, blocks)
        experts = model.expert_parameters()
        tied = model.embedding.word.weight \
            if mesh.pp.size > 1 and model.embedding is not None else None
        common = dict(stage=p.zero, bucket_bytes=int(p.bucket_mb * 2**20), grad_dtype=grad_dtype,
                      offload=p.offload_optimizer == "cpu")
        dense = ZeroDataParallel([[q for q in unit if id(q) not in experts] for unit in units],
                                 mesh.dp_cp, **common,
                                 deferred=(tied, mesh.axis("embed")) if tied is not None else None)
        if p.zero == 3:
            dense.attach(model, blocks)
        if not experts:
            return [dense]
        return [dense, ZeroDataParallel([[q for q in unit if id(q) in experts] for unit in units],
                                        mesh.axis("edp"), **common, scale=1.0 / mesh.ep.size)]

    def train_step(self, step: int, *, timeline: list | None = None) -> dict:
        """One optimizer step (0-based index `step`); returns its metrics. `timeline` collects
        this rank's pipeline events (see `run_schedule`)."""
        t, mesh = self.cfg.train, self.mesh
        lr = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps,
                   total_steps=t.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        for reducer in self.reducers:
            reducer.zero_grad()
        micro_batches = self.train_data.micro_batches(step, dp_rank=mesh.dp.rank,
                                                      dp_size=mesh.dp.size)
        loss_sum = torch.zeros((), device=mesh.device)
        moe_stats = MoEStats()

        m = len(micro_batches)

        def mark_last(i: int) -> None:
            for reducer in self.reducers:
                reducer.sync = i % m == m - 1  # communicate once per step

        if mesh.pp.size > 1:
            pipedream = self._pipedream(step, m)
            if pipedream is None:
                actions = self._schedule(m)
                stage, local = self._pipeline_inputs(micro_batches)
            else:  # micro-batches numbered over the run: this step's and the next one's
                actions = pipedream.segment(step)
                read = {t: self.train_data.micro_batches(t, dp_rank=mesh.dp.rank,
                                                         dp_size=mesh.dp.size)
                        for t in pipedream.steps_read(step)}
                stage, cut = self._pipeline_inputs([b for t in read for b in read[t]])
                local = {(t - pipedream.first_step) * m + j: cut[n * m + j]
                         for n, t in enumerate(read) for j in range(m)}

            def routing_loss(chunk: int):
                moe_stats.add(self.model, chunk)
                return self.model.routing_loss(chunk)

            count = list(self.model.parameters()) if self.count_saved_bytes else None
            self.last_schedule_run = run_schedule(
                actions, stage=stage, loss_fn=self.model.cross_entropy, micro_batches=local,
                mesh=mesh, activation_shape=self._activation_shape(), dtype=self._dtype(),
                num_chunks=len(self.model.stage.chunks), num_micro_batches=m,
                before_backward=mark_last, stage_loss=routing_loss,
                use_weights_of=pipedream.use_weights_of if pipedream else lambda micro: None,
                loss_scale=self.scaler.scale, count_saved_of=count,
                carry=pipedream.carry if pipedream else None, timeline=timeline)
            if pipedream is not None:
                pipedream.end_segment(step)
            for loss in self.last_schedule_run.losses:
                loss_sum += loss.float()
            comm.all_reduce(loss_sum, mesh.pp)  # only the last stage has the loss
        for i, (inputs, targets) in enumerate(micro_batches if mesh.pp.size == 1 else ()):
            mark_last(i)
            cross_entropy = self._cross_entropy(inputs, targets)
            loss = (cross_entropy + self.model.routing_loss()) / len(micro_batches)
            (loss * self.scaler.scale).backward()
            loss_sum += cross_entropy.detach().float() / len(micro_batches)
            moe_stats.add(self.model)
        for reducer in self.reducers:
            reducer.wait()
        grads = self._gradients()
        tied = self._tied_embedding()
        if tied is not None and not self.cfg.parallel.zero:
            # first and last stage each hold it: keep the copies equal (ZeRO sums the local
            # gradients before its reduce-scatter)
            comm.all_reduce(grads[id(tied)], mesh.axis("embed"))
        self._sum_sequence_parallel_grads(grads)
        row = {"step": step + 1}
        if self.scaler.enabled:
            for grad in grads.values():
                grad.mul_(1.0 / self.scaler.scale)
            row["loss_scale"] = self.scaler.scale
        overflow = self.scaler.enabled and self._any_overflow(grads)
        grad_norm = torch.full((), float("nan"))
        if not overflow:
            duplicates = {id(tied)} if tied is not None and mesh.pp.rank > 0 else set()
            grad_norm = clip_grad_norm_(self.model, mesh, t.clip_grad, grads, duplicates,
                                        sharded=self.cfg.parallel.zero > 0)
            self._optimizer_step(grads)
        self.scaler.update(overflow)
        if self.scaler.enabled:
            row["skipped"] = int(overflow)
        comm.all_reduce(loss_sum, mesh.dp_cp, op=torch.distributed.ReduceOp.AVG)
        return row | {"loss": loss_sum.item(), "grad_norm": grad_norm.item(), "lr": lr,
                      **moe_stats.summary(mesh, len(micro_batches),
                                          moe=self.model.cfg.moe_experts > 0)}

    def _pipedream(self, step: int, num_micro_batches: int) -> PipeDream2BW | None:
        """The 2BW state, made at the first step this trainer runs (after a resume the
        checkpoint's previous version continues the delay exactly)."""
        if self.cfg.parallel.pp_schedule != "2bw":
            return None
        if self.pipedream is None:
            t = self.cfg.train
            self.pipedream = PipeDream2BW(
                list(self.model.parameters()), self.masters.params, p=self.mesh.pp.size,
                s=self.mesh.pp.rank, m=num_micro_batches, first_step=step,
                num_steps=(t.stop_at or t.steps) - step, previous=self.resumed_previous)
        return self.pipedream

    def traced_train_step(self, step: int, trace_dir: Path) -> tuple[dict, dict | None]:
        """`train_step` with its pipeline timeline recorded; world rank 0 writes its pipeline's
        trace into `trace_dir` and gets the idle report (None elsewhere). The pp barrier
        before the step is every stage's time zero."""
        comm.barrier(self.mesh.pp)
        origin = time.perf_counter()
        events: list = []
        row = self.train_step(step, timeline=events)
        stages = gather_timeline(events, origin, self.mesh.pp)
        if self.mesh.rank != 0:
            return row, None
        meta = {"schedule": self.cfg.parallel.pp_schedule, "pp": self.mesh.pp.size,
                "step": step + 1}
        return row, write_trace(trace_dir, stages, meta)

    def _schedule(self, num_micro_batches: int) -> list[Action]:
        """This rank's actions for one flush step (2BW evaluates with 1F1B's forwards)."""
        p, s, m = self.mesh.pp.size, self.mesh.pp.rank, num_micro_batches
        name = self.cfg.parallel.pp_schedule
        if name == "interleaved":
            return interleaved(p, m, len(self.model.stage.chunks))[s]
        return (gpipe if name == "gpipe" else one_f_one_b)(p, m)[s]

    def _pipeline_inputs(self, micro_batches):
        """The stage function and this rank's (context-parallel) slice of every micro-batch."""
        mesh = self.mesh
        positions = context_parallel_positions(self.cfg.train.seq_len, mesh.cp.size,
                                               mesh.cp.rank)
        local = [(x[:, positions], y[:, positions]) for x, y in micro_batches]
        on_device = positions.to(mesh.device)
        return (lambda x, chunk: self.model(x, on_device, chunk=chunk)), local

    def _activation_shape(self) -> tuple[int, int, int]:
        """What flows between stages: this rank's `[micro, s/cp (/tp with SP), h]`."""
        t, mesh = self.cfg.train, self.mesh
        tokens = t.seq_len // mesh.cp.size // (mesh.tp.size if self.model.sequence_parallel else 1)
        return (t.micro_batch, tokens, self.model.cfg.hidden_size)

    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _tied_embedding(self) -> torch.nn.Parameter | None:
        """The word embedding when two pipeline stages hold it (else None)."""
        if self.mesh.pp.size == 1:
            return None
        return self.model.embedding.word.weight if self.model.embedding is not None else None

    def _gradients(self) -> dict[int, torch.Tensor]:
        """id(model parameter) -> its reduced gradient (in the reducers' buffers); under ZeRO
        this rank's piece of it, and nothing for parameters it owns no piece of."""
        grads = {id(p): reducer.grad(p) for reducer in self.reducers for p in reducer.params}
        return {key: grad for key, grad in grads.items() if grad is not None}

    def _any_overflow(self, grads: dict[int, torch.Tensor]) -> bool:
        """An inf/nan anywhere on any rank: every rank must skip the same step."""
        found = torch.zeros((), device=self.mesh.device)
        for grad in grads.values():
            if not torch.isfinite(grad).all():
                found.fill_(1.0)
                break
        comm.all_reduce(found, self.mesh.world, op=torch.distributed.ReduceOp.MAX)
        return bool(found.item())

    def _optimizer_step(self, grads: dict[int, torch.Tensor]) -> None:
        if self.cfg.parallel.zero:
            for reducer in self.reducers:
                reducer.prepare_step()
            self.optimizer.step()
            for reducer in self.reducers:
                reducer.finish_step()
            return
        if self.masters is None:
            self.optimizer.step()
            return
        for param in self.masters.model_params:
            self.masters.master_of[id(param)].grad = grads[id(param)].float()
        if self.pipedream is not None:  # the model keeps the versions in-flight work needs
            self.pipedream.step(self.optimizer.step)
            return
        self.optimizer.step()
        self.masters.copy_to_model()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        mesh = self.mesh
        batches = self.eval_data.eval_batches(self.cfg.train.eval_batches, dp_rank=mesh.dp.rank,
                                              dp_size=mesh.dp.size)
        total = torch.zeros((), device=mesh.device)
        if self.pipedream is not None:  # evaluate the current weights W(t)
            self.pipedream.load(self.pipedream.version)
        if mesh.pp.size > 1:
            forwards = [a for a in self._schedule(len(batches))
                        if a.kind in (FORWARD, RECV_ACTIVATION, SEND_ACTIVATION)]
            stage, local = self._pipeline_inputs(batches)
            run = run_schedule(forwards, stage=stage, loss_fn=self.model.cross_entropy,
                               micro_batches=local, mesh=mesh,
                               activation_shape=self._activation_shape(), dtype=self._dtype(),
                               num_chunks=len(self.model.stage.chunks))
            for loss in run.losses:
                total += loss.float()
            comm.all_reduce(total, mesh.pp)
        else:
            for inputs, targets in batches:
                total += self._cross_entropy(inputs, targets)
            total /= len(batches)
        comm.all_reduce(total, mesh.dp_cp, op=torch.distributed.ReduceOp.AVG)
        return total.item()

    def _cross_entropy(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of this rank's tokens: under context parallelism its load-balanced
        slice of every sequence (equal token counts, so averaging over dp x cp gives the global
        mean)."""
        mesh = self.mesh
        positions = context_parallel_positions(inputs.shape[1], mesh.cp.size, mesh.cp.rank)
        inputs, targets = inputs[:, positions], targets[:, positions]
        positions = positions.to(mesh.device)
        inputs, targets = inputs.to(mesh.device), targets.to(mesh.device)
        return self.model.cross_entropy(self.model(inputs, positions), targets)

    def _sum_sequence_parallel_grads(self, all_grads: dict[int, torch.Tensor]) -> None:
        """Complete the partial gradients of parameters used on s/tp tokens (one all-reduce)."""
        grads = [all_grads[id(p)] for p in self.model.sequence_parallel_parameters()
                 if id(p) in all_grads]  # ZeRO: the pieces (same on every TP rank)
        if not grads:
            return
        flat = torch.cat([g.flatten() for g in grads])
        comm.all_reduce(flat, self.mesh.tp)
        for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    def memory_report(self) -> dict:
        """Model-state bytes on this rank (after a step, so the optimizer states exist). Under
        ZeRO the full buffers that live only while a unit computes or a bucket is reduced are
        not held; their peak is reported as `peak_transient`."""
        extra = {}
        if self.cfg.parallel.zero:
            held = {"parameters": 0, "gradients": 0, "optimizer_states": 0}
            for reducer in self.reducers:
                for key, nbytes in reducer.memory(self.optimizer).items():
                    held[key] += nbytes
            extra["peak_transient"] = sum(r.peak_transient_bytes for r in self.reducers)
        else:
            grads = [reducer.grad(p) for reducer in self.reducers for p in reducer.params]
            held = model_state_bytes(params=list(self.model.parameters()), grads=grads,
                                     optimizer=self.optimizer,
                                     masters=self.masters.params if self.masters else ())
        return held | extra | {"total": sum(held.values()),
                               "num_parameters": sum(p.numel() for p in self.model.parameters())}

    def _export_states(self) -> tuple[dict, dict | None, torch.Tensor | None]:
        """For a checkpoint: ({name: fp32 master or parameter}, {name: Adam moments} or None,
        the optimizer's step count or None); ZeRO gathers its shards (collective)."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        step = next((s["step"] for s in self.optimizer.state.values() if "step" in s), None)
        if self.cfg.parallel.zero:
            # a rank that owns no piece has no optimizer state: agree on the step count
            count = torch.tensor(float(step) if step is not None else 0.0, device=self.mesh.device)
            comm.all_reduce(count, self.mesh.world, op=torch.distributed.ReduceOp.MAX)
            stepped = count.item() > 0
            values, states = {}, {}
            for reducer in self.reducers:
                reducer_values, reducer_states = reducer.export(self.optimizer, stepped=stepped)
                values |= reducer_values
                states |= reducer_states or {}
            return ({names[i]: v for i, v in values.items()},
                    {names[i]: s for i, s in states.items()} if stepped else None,
                    count.cpu() if stepped else None)
        values, states = {}, {}
        for param in self.model.parameters():
            stepped = self.masters.master_of[id(param)] if self.masters else param
            values[names[id(param)]] = stepped
            if stepped in self.optimizer.state:
                states[names[id(param)]] = self.optimizer.state[stepped]
        return values, states or None, step

    def _load_states(self, values: dict, states: dict | None, step: torch.Tensor | None, *,
                     previous: dict | None = None) -> None:
        """Place a checkpoint's per-parameter values and moments (see `_export_states`), and
        for 2BW the previous weight version."""
        named = dict(self.model.named_parameters())
        if previous is not None and self.cfg.parallel.pp_schedule == "2bw":
            self.resumed_previous = [previous[name].to(p.device, torch.float32)
                                     for name, p in named.items()]
        if self.cfg.parallel.zero:
            by_id = {id(named[n]): v for n, v in values.items()}
            states_by_id = {id(named[n]): s for n, s in states.items()} if states else None
            for reducer in self.reducers:
                reducer.load(self.optimizer, by_id, states_by_id, step)
            return
        with torch.no_grad():
            for name, param in named.items():
                param.copy_(values[name])
                stepped = self.masters.master_of[id(param)] if self.masters else param
                if self.masters:
                    stepped.copy_(values[name])
                if states is not None:
                    self.optimizer.state[stepped] = {
                        "step": step.reshape(()).clone(),
                        **{s: t.to(param.device) for s, t in states[name].items()}}

    def save(self, out: Path, step: int) -> Path:
        values, states, optimizer_step = self._export_states()
        previous = None
        if self.pipedream is not None:  # W(t - 1), which the next micro-batches use
            previous = {name: weights for (name, _), weights in
                        zip(self.model.named_parameters(), self.pipedream.previous, strict=True)}
        return save_checkpoint(out / "checkpoints", step, model=self.model, mesh=self.mesh,
                               train_state={"step": step, "loss_scaler": self.scaler.state_dict()},
                               config_toml=self.cfg.to_toml(), values=values, states=states,
                               optimizer_step=optimizer_step, previous=previous)

    def resume(self, out: Path) -> int:
        """Load the latest checkpoint in `out` (any layout); returns the step to continue at."""
        path = latest_checkpoint(out / "checkpoints")
        if path is None:
            return 0
        state = load_checkpoint(path, model=self.model, mesh=self.mesh,
                                load_states=self._load_states)
        if "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])
        return int(state["step"])


def run_training(cfg: RunConfig, *, degrees: dict[str, int]) -> list[dict]:
    """Train as configured on this rank; returns the metrics rows (rank 0; empty elsewhere)."""
    mesh = init_parallel(tp=degrees["tp"], pp=degrees["pp"], dp=degrees["dp"],
                         cp=degrees.get("cp", 1), ep=degrees.get("ep", 1),
                         device=cfg.parallel.device)
    trainer = Trainer.build(cfg, mesh)
    out = Path(cfg.checkpoint.out)
    start = trainer.resume(out) if cfg.checkpoint.resume else 0
    t = cfg.train
    stop = t.stop_at or t.steps
    is_logger = mesh.rank == 0
    log = None
    comm.barrier(mesh.world)  # every rank has checked --out before rank 0 writes to it
    if is_logger:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(cfg.to_toml())
        log = MetricsLog(out / "metrics.jsonl",
                         resume_step=start if cfg.checkpoint.resume else None)
    progress = Progress(total=stop, initial=start, enabled=is_logger)
    tokens_per_step = t.global_batch * t.seq_len
    trace = cfg.parallel.trace
    traced = min(start + 1, stop - 1) if trace and mesh.pp.size > 1 else None  # a warm step
    if trace and traced is None:
        progress.write("meshtrain: --trace records pipeline timelines; with --pp 1 it writes"
                       " nothing")
    timer = StepTimer()
    rows = []
    for step in range(start, stop):
        if step == traced:
            row, idle = trainer.traced_train_step(step, Path(trace))
            if idle:
                per_stage = ", ".join(f"{r['idle_measured']:.1%} vs {r['idle_simulated']:.1%}"
                                      for r in idle["stages"])
                progress.write(f"meshtrain: pipeline timeline of step {step + 1} in"
                               f" {Path(trace) / 'pipeline.json'}; idle per stage, measured vs"
                               f" simulated: {per_stage}")
        else:
            row = trainer.train_step(step)
        if step == start:
            report = comm.all_gather_objects(trainer.memory_report(), mesh.world)
            if is_logger:
                (out / "memory.json").write_text(json.dumps({"ranks": report}, indent=1))
                mib = report[0]["total"] / 2**20
                progress.write(f"model states on rank 0: {mib:.1f} MiB (parameters, gradients,"
                               f" optimizer states; all ranks in {out / 'memory.json'})")
        elapsed = timer.lap()
        row |= {"tokens_per_s": tokens_per_step / elapsed, "step_time_s": elapsed}
        done = step + 1
        if t.eval_every and (done % t.eval_every == 0 or done == stop):
            rows_eval = {"step": done, "eval_loss": trainer.evaluate()}
            if log:
                log.write(rows_eval)
                rows.append(rows_eval)
            progress.write(f"step {done}: eval loss {rows_eval['eval_loss']:.4f}")
        if log:
            log.write(row)
            rows.append(row)
        progress.update(loss=row["loss"], tokens_per_s=row["tokens_per_s"])
        save_every = cfg.checkpoint.save_every
        if done == stop or (save_every and done % save_every == 0):
            trainer.save(out, done)
        timer.lap()  # exclude evaluation and checkpointing from the next step's time
    progress.close()
    if log:
        log.close()
        if plot_loss_curve(read_metrics(out / "metrics.jsonl"), out / "loss.png"):
            print(f"meshtrain: loss curve in {out / 'loss.png'}")
        print(f"meshtrain: metrics in {out / 'metrics.jsonl'}, checkpoint step {stop} in"
              f" {out / 'checkpoints'}")
    return rows
