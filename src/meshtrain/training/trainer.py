"""The training loop run by every rank: the executor's forward and backward over a step's
micro-batches -> the gradient sync's reduction -> unscaling and the overflow check (the loss
scaler's, `precision`) and clipping (`clip_grad_norm_` over the sync's gradient layout) -> the
optimizer step -> metrics, evaluation and checkpoints (the run's bookkeeping: `run_state`).

It works through interfaces (`parallelize`'s gradient sync and executor, the family's parameter
roles) and never asks which strategy or model family it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshtrain.checkpointing.async_save import AsyncSaver
from meshtrain.checkpointing.checkpoint import (
    CheckpointWriteError,
    latest_checkpoint,
    load_checkpoint,
    prepare_checkpoint,
    save_checkpoint,
)
from meshtrain.checkpointing.resuming import continue_advice
from meshtrain.config.run_config import RunConfig, check_packing
from meshtrain.data.blend import Blend, load_data
from meshtrain.data.corpus import BatchSampler
from meshtrain.interop.checkpoint_formats import checkpoint_format
from meshtrain.mesh import ParallelMesh
from meshtrain.operations.failures import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_STOPPED, RunFailure
from meshtrain.operations.replica_launch import wait_for_groups
from meshtrain.operations.run_lock import OffloadLock, RunLock, record_ranks
from meshtrain.operations.stopping import StopSignals, failed_rank
from meshtrain.operations.watchdog import HangWatchdog, process_group_timeout
from meshtrain.parallel.communication import comm
from meshtrain.parallel.communication.flight_recorder import FlightRecorder
from meshtrain.parallel.runtime.executor import Packing
from meshtrain.parallel.runtime.nvme_offload import OffloadFileChanged
from meshtrain.parallel.runtime.optim import clip_grad_norm_
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.runtime.process_groups import init_parallel
from meshtrain.parallel.runtime.replica_groups import ReplicaGroups, check_fingerprint
from meshtrain.parallelize import ParallelModel, parallelize
from meshtrain.precision import LossScaler, nonfinite
from meshtrain.training.metrics import read_scalars
from meshtrain.training.pipeline_trace import gather_timeline, write_trace
from meshtrain.training.run_state import RunState

STATE_KEYS = ("parameters", "gradients", "optimizer_states")
# A quorum forms within the lighthouse's heartbeat and join timeouts once every live group asks;
# one that does not (a group whose manager lives while a rank is stuck) ends the step's group
# after this many seconds (its agent restarts it) rather than holding every group.
QUORUM_TIMEOUT_S = 60.0
# Settings of one process, one group or its launch: replica groups may differ in them.
_PER_GROUP = frozenset({"nproc", "threads", "max_restarts", "device", "collective_timeout",
                        "layout", "hardware", "trace", "replica_group_id", "lighthouse",
                        "stop_at", "eval_every", "eval_batches", "log_every"})


def corpus_of(cfg: RunConfig) -> Blend:
    """The run's data: the `data_path` blend, the `data` file's tokens (and what was prepared
    with them), or the embedded standard-library corpus."""
    return load_data(cfg.data.data, cfg.data.data_path)


@dataclasses.dataclass
class Trainer:
    """One rank's view of a run: its part of the model, how it syncs and runs, and its data."""

    cfg: RunConfig
    mesh: ParallelMesh
    plan: ParallelPlan
    parallel: ParallelModel
    train_data: BatchSampler
    eval_data: BatchSampler
    scaler: LossScaler
    tokenizer: Path | None = None  # the tokenizer.json the data was prepared with
    # This rank's request for the step (a stop or a timed save, `stopping`); None: no flag.
    requests: Callable[[], float] | None = None
    saver: AsyncSaver | None = None  # the background writer (`async_save`)
    replicas: ReplicaGroups | None = None  # `fault_tolerance`: this rank's group among the others

    @property
    def model(self):
        return self.parallel.model

    @functools.cached_property
    def config_toml(self) -> str:
        """The run's settings as it runs them (config.toml, and in every checkpoint)."""
        return self.cfg.resolved(self.model.cfg, self.plan).to_toml()

    @property
    def sync(self):
        return self.parallel.sync

    @property
    def executor(self):
        return self.parallel.executor

    @classmethod
    def build(cls, cfg: RunConfig, mesh: ParallelMesh) -> Trainer:
        """The run's settings laid out on `mesh` (its degrees override the settings')."""
        corpus = corpus_of(cfg)
        t = cfg.train
        plan = cfg.plan.with_degrees(mesh.degrees)
        check_packing(cfg, corpus.eod_id)
        d = cfg.data
        packing = Packing(corpus.eod_id, d.document_mask, d.reset_positions, d.eod_mask_loss,
                          d.cp_balance)
        parallel = parallelize(cfg.model_config(corpus.vocab_size), plan, mesh, seed=t.seed,
                               seq_len=t.seq_len, steps=t.stop_at or t.steps,
                               optimizer=cfg.optimizer, packing=packing,
                               offload_dir=cfg.offload_folder(mesh.world.rank))
        scaler = LossScaler(enabled=plan.precision == "fp16", growth_interval=t.loss_scale_window)
        train_data, eval_data = corpus.samplers(d.val_fraction, seq_len=t.seq_len,
                                                global_batch=t.global_batch,
                                                micro_batch=plan.micro_batch, seed=t.seed)
        return cls(cfg, mesh, plan, parallel, train_data, eval_data, scaler, corpus.tokenizer)

    def _micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the global batch; replica group g takes the g-th of the
        groups' equal parts (a group absent from a step leaves its part untrained)."""
        dp_rank, dp_size = self.mesh.dp.rank, self.mesh.dp.size
        if self.replicas is not None:
            dp_rank += self.replicas.group_id * dp_size
            dp_size *= self.replicas.num_groups
        return self.train_data.micro_batches(step, dp_rank=dp_rank, dp_size=dp_size)

    def train_step(self, step: int, *, timeline: list | None = None) -> dict:
        """One optimizer step (0-based index `step`); returns its metrics. `timeline` collects
        this rank's pipeline events (see `run_schedule`).

        The step reads the device once: its scalars (loss, gradient norm, the overflow flag,
        routing statistics) in one transfer (`read_scalars`), before the optimizer step or
        after it as the loss scaler decides (`LossScaler.decides_first`)."""
        t, mesh, sync, optimizer = self.cfg.train, self.mesh, self.sync, self.cfg.optimizer
        lr = optimizer.lr_at(step, total_steps=t.steps)
        self.model.train()
        sync.zero_grad()
        result = self.executor.forward_backward(step, self._micro_batches, sync,
                                                loss_scale=self.scaler.scale, timeline=timeline)
        layout = sync.wait()
        if self.replicas is not None:
            self.replicas.reduce(layout.grads.values() if layout.grads is not None else
                                 [p.grad for p in self.model.parameters() if p.grad is not None])
        scalars = {}
        if self.scaler.enabled:
            scalars["overflow"] = self.scaler.unscale_(layout.grads.values(), functools.partial(
                comm.all_reduce, axis=mesh.world, op=torch.distributed.ReduceOp.MAX))
        scalars["grad_norm"] = clip_grad_norm_(self.model, mesh, layout, optimizer.clip_grad)
        comm.all_reduce(result.loss, mesh.dp_cp, op=torch.distributed.ReduceOp.AVG)
        scalars["loss"] = result.loss
        if self.requests is not None:  # every rank reads the same stop/save decision
            scalars["request"] = torch.full((), self.requests(), device=mesh.device)
            comm.all_reduce(scalars["request"], mesh.world, op=torch.distributed.ReduceOp.MAX)
        if self.replicas is not None:
            scalars["loss"] = self.replicas.reduce_scalars(result.loss, scalars.get("request"))
            if not self.replicas.commit():  # a group failed in the step: every group drops it
                return {"step": step + 1, "discarded": True}
        if self.model.cfg.moe_experts:
            micro_batches = self.plan.micro_batches_per_step(t.global_batch)
            scalars |= result.routing.summary(mesh, micro_batches,
                                              self.model.cfg.moe_layer_indices())
        row = {"step": step + 1} | (self.replicas.row() if self.replicas is not None else {})
        if self.scaler.decides_first(t.max_nonfinite_steps):
            values = read_scalars(scalars)
            row |= self.scaler.settle(values)
            if not row["skipped"]:
                self.executor.optimizer_step(lambda: sync.step(lr))
                result.routing.update(self.model)
        else:  # a bad step ends the run
            self.executor.optimizer_step(lambda: sync.step(lr))
            result.routing.update(self.model)
            values = read_scalars(scalars)
            row |= {"nonfinite": 1} if nonfinite(values, scaled=False) else {}
        return row | {"loss": values.pop("loss"), "grad_norm": values.pop("grad_norm"),
                      "lr": lr} | values

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
        meta = {"schedule": self.plan.pp_schedule, "pp": self.mesh.pp.size, "step": step + 1}
        return row, write_trace(trace_dir, stages, meta)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        mesh = self.mesh
        batches = self.eval_data.eval_batches(self.cfg.train.eval_batches, dp_rank=mesh.dp.rank,
                                              dp_size=mesh.dp.size)
        total = self.executor.evaluate(batches)
        comm.all_reduce(total, mesh.dp_cp, op=torch.distributed.ReduceOp.AVG)
        return total.item()

    def memory_report(self) -> dict:
        """Model-state bytes on this rank (after a step, so the optimizer states exist). Under
        ZeRO the full buffers that live only while a unit computes or a bucket is reduced are
        not held; their peak is reported as `peak_transient`."""
        held = self.sync.memory_report()
        return held | {"total": sum(held[key] for key in STATE_KEYS),
                       "num_parameters": sum(p.numel() for p in self.model.parameters())}

    def save(self, out: Path, step: int, *, background: bool = False) -> Path:
        """Save `step` (collective). `background` (with `async_save`): publish the write in
        flight, snapshot, and return the directory the background write will publish."""
        self.settle_save()
        values, states, optimizer_step = self.sync.export()
        kwargs = dict(model=self.model, mesh=self.mesh, config_toml=self.config_toml,
                      train_state={"step": step, "loss_scaler": self.scaler.state_dict()},
                      values=values, states=states, optimizer_step=optimizer_step,
                      previous=self.executor.saved_state(),
                      keep_last=self.cfg.checkpoint.keep_last)
        with self._failed_write(out):
            if not (background and self.saver):
                return save_checkpoint(out / "checkpoints", step, **kwargs)
            pending = prepare_checkpoint(out / "checkpoints", step, **kwargs)
        self.saver.start(pending)
        return pending.final

    def settle_save(self) -> Path | None:
        """Collective: publish the background write in flight, if any (`AsyncSaver.settle`);
        too many failures in a row end the run with exit 1."""
        if self.saver is None:
            return None
        with self._failed_write(Path(self.cfg.checkpoint.out)):
            return self.saver.settle()

    @contextlib.contextmanager
    def _failed_write(self, out: Path):
        """A save every rank agreed failed writing (sync or background, a full disk): exit 1,
        as every failed write, one line printed by rank 0, naming the checkpoint to continue
        from only when one is there and verifies."""
        try:
            yield
        except CheckpointWriteError as e:
            advice = continue_advice(out / "checkpoints") if self.mesh.rank == 0 else ""
            raise RunFailure(f"{e}: free space or fix the checkpoint directory, then {advice}",
                             EXIT_FAILED, agreed=True) from None

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

    def _load_states(self, values: dict, states: dict | None, step: torch.Tensor | None, *,
                     previous: dict | None = None) -> None:
        self.sync.load(values, states, step)
        self.executor.load_state(previous)

    def fingerprint(self) -> dict[str, str]:
        """What replica groups must share to average their gradients and heal one another:
        the resolved settings but those of one process or one group's files and launch."""
        tables = self.cfg.resolved(self.model.cfg, self.plan).to_dict()
        return {f"{section}.{name}": repr(value) for section, values in tables.items()
                if section not in ("checkpoint", "logging") for name, value in values.items()
                if name not in _PER_GROUP}

    def live_state(self) -> dict:
        """What a healing replica group takes from this rank's peer: weights, optimizer state,
        the 2BW weights, the loss scale and the RNG state (the data position is the step,
        which torchft carries), with the fingerprint they belong to."""
        values, states, optimizer_step = self.sync.export()
        return {"values": values, "states": states, "optimizer_step": optimizer_step,
                "previous": self.executor.saved_state(), "scaler": self.scaler.state_dict(),
                "rng": torch.get_rng_state(), "fingerprint": self.fingerprint()}

    def take_live_state(self, state: dict) -> None:
        check_fingerprint(self.replicas.group_id, self.fingerprint(), state["fingerprint"])
        self._load_states(state["values"], state["states"], state["optimizer_step"],
                          previous=state["previous"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])

    def start_from(self, path: str | Path) -> None:
        """Take the model weights of a checkpoint (any layout; a run's latest) as this new
        run's: the optimizer starts fresh, and the step, loss scale and RNG streams stay this
        run's own."""
        def weights_only(values: dict) -> None:
            self._load_states(values, None, None)  # no optimizer state, step or 2BW version

        checkpoint_format(path).load(Path(path), self.model, self.mesh, weights_only)


def run_training(cfg: RunConfig, plan: ParallelPlan | None = None, *,
                 stop: StopSignals | None = None, lock: RunLock | None = None) -> list[dict]:
    """Train as configured on this rank (`plan`: the validated layout; default the settings'
    resolved against the launcher's world); returns the metrics rows (rank 0; empty elsewhere).
    `stop`: armed signals that end the run early with a checkpoint (RunFailure EXIT_STOPPED);
    `lock`: the `out` lock global rank 0 takes for the world (under torchrun)."""
    if plan is None:
        plan = cfg.plan.resolved(int(torch.distributed.get_world_size()
                                       if torch.distributed.is_initialized() else 1))
    timeout = cfg.parallel.collective_timeout
    with HangWatchdog(rank=int(os.environ.get("RANK", "0")), world_size=plan.world_size,
                      timeout=timeout, out=cfg.checkpoint.out) as watchdog:
        with watchdog.rendezvous():
            mesh = init_parallel(**plan.degrees, dp_shard=plan.dp_shard, cp_a2a=plan.cp_a2a,
                                 etp=plan.etp,
                                 tp_scheme=plan.tp_scheme, tp_depth=plan.tp_depth,
                                 device=cfg.parallel.device,
                                 timeout=process_group_timeout(timeout))
        if lock is not None:
            lock.acquire_agreed(mesh)
        offload = OffloadLock(cfg.offload_folder(mesh.world.rank))
        try:
            offload.acquire_agreed(mesh)
            record_ranks(cfg.checkpoint.out, mesh)
            return _train(cfg, mesh, stop, watchdog.recorder)
        finally:
            offload.release()
            if lock is not None:
                lock.release()


def _train(cfg: RunConfig, mesh: ParallelMesh, stop: StopSignals | None,
           recorder: FlightRecorder) -> list[dict]:
    trainer = Trainer.build(cfg, mesh)
    try:
        if cfg.parallel.fault_tolerance:  # last, so the lighthouse waits for no build
            trainer.replicas = _join_replica_groups(cfg, mesh, trainer)
        return _train_built(cfg, mesh, trainer, stop, recorder)
    except OffloadFileChanged as e:  # this rank's line; its peers stop as on a dead rank
        raise RunFailure(str(e), EXIT_BAD_INPUT) from None
    finally:
        trainer.sync.close()
        if trainer.replicas is not None:
            trainer.replicas.close()


def _join_replica_groups(cfg: RunConfig, mesh: ParallelMesh, trainer: Trainer) -> ReplicaGroups:
    """This rank's torchft manager. At a group's first start (not an agent's restart) every
    group waits for all to be there, heartbeating, so the first quorum holds them all."""
    p = cfg.parallel
    replicas = ReplicaGroups(mesh, group_id=p.replica_group_id, num_groups=p.replica_groups,
                             lighthouse=p.lighthouse, min_groups=p.min_replica_groups,
                             quorum_timeout=min(p.collective_timeout, QUORUM_TIMEOUT_S),
                             fingerprint=trainer.fingerprint(), state=trainer.live_state,
                             load=trainer.take_live_state)
    if not int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        wait_for_groups(Path(cfg.checkpoint.out) / "replica_groups" / f"start.{run_id}",
                        group_id=p.replica_group_id, num_groups=p.replica_groups,
                        timeout=p.collective_timeout, mesh=mesh)
    return replicas


def _steps(trainer: Trainer, start: int, stop: int):
    """The steps to take: `start` .. `stop` - 1; with replica groups, each the groups' count
    of committed steps at the step's quorum (a discarded step comes again, a healed group
    jumps to its peers' step)."""
    if trainer.replicas is None:
        yield from range(start, stop)
        return
    replicas = trainer.replicas
    replicas.resume_at(start)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    while (step := replicas.start_step()) < stop:
        if restarted and step == 0 and replicas.manager.num_participants() == 1:
            raise RunFailure(f"replica group {replicas.group_id} restarted, but no group is left"
                             " to heal from: continue the run from its latest checkpoint with"
                             " `auto_resume`", EXIT_FAILED, agreed=True)
        restarted = False
        yield step


def _train_built(cfg: RunConfig, mesh: ParallelMesh, trainer: Trainer,
                 stop: StopSignals | None, recorder: FlightRecorder) -> list[dict]:
    out = Path(cfg.checkpoint.out)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    healing = restarts and trainer.replicas is not None  # from a live group, not a checkpoint
    resuming = (cfg.checkpoint.resume or cfg.checkpoint.auto_resume) and not healing
    start = trainer.resume(out) if resuming else 0
    if restarts:  # the agent restarted every rank (of this group) after one failed: say which
        _say_restart(mesh, restarts, start, trainer.replicas)
    if start == 0 and cfg.checkpoint.init_from:  # nothing of this run's own to resume
        trainer.start_from(cfg.checkpoint.init_from)
    run = RunState(cfg, trainer, out, start, stop, recorder)
    if cfg.checkpoint.async_save:
        trainer.saver = AsyncSaver(mesh)
    try:
        for step in _steps(trainer, start, run.stop):
            run.step(step)
        if trainer.replicas is not None:
            _write_weights_digest(trainer, out)
    except RunFailure as e:
        if e.exit_code == EXIT_STOPPED and trainer.replicas is not None:  # all at one step
            _write_weights_digest(trainer, out)
        raise
    finally:
        run.flush()  # the rows of the steps done, even when one fails
        if trainer.saver is not None:
            trainer.saver.wait()  # the process ends only after its writer
    return run.finish()


def _write_weights_digest(trainer: Trainer, out: Path) -> None:
    """Replica groups: group K's rank 0 writes OUT/replica_groups/groupK.json, the step and a
    digest of the group's weights (every rank's, in rank order), which every group that
    finished the run in step with the others shares bitwise. The values are the optimizer's
    (`sync.export`, a collective under ZeRO), not the module's: ZeRO-3 frees those between
    steps, and mixed precision's fp32 masters are what a healed group must match."""
    mine = hashlib.sha256()
    values, _, _ = trainer.sync.export()
    for name in sorted(values):
        mine.update(name.encode())
        mine.update(values[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digests = comm.all_gather_objects(mine.hexdigest(), trainer.mesh.world)
    if trainer.mesh.rank == 0:
        replicas = trainer.replicas
        folder = out / "replica_groups"
        folder.mkdir(parents=True, exist_ok=True)
        whole = hashlib.sha256("".join(digests).encode()).hexdigest()
        (folder / f"group{replicas.group_id}.json").write_text(json.dumps(
            {"step": replicas.manager.current_step(), "weights_sha256": whole,
             "discarded_steps": replicas.discarded}))


def _say_restart(mesh: ParallelMesh, restarts: int, start: int,
                 replicas: ReplicaGroups | None = None) -> None:
    """Rank 0's line on an elastic restart: the failed rank as the first node that saw it
    names it (each node's local rank 0 reads its own ranks' files), and what was resumed."""
    mine = failed_rank(mesh.world_size) if os.environ.get("LOCAL_RANK", "0") == "0" else None
    named = [cause for cause in comm.all_gather_objects(mine, mesh.world) if cause]
    if mesh.rank == 0:
        where = f"resumed from checkpoint step_{start:08d}" if start else \
            "no checkpoint yet: started over"
        if replicas is not None:
            where = "joining the other replica groups, healing from a live one"
        group = f"replica group {replicas.group_id}: " if replicas is not None else ""
        print(f"meshtrain: {group}restart {restarts}: {named[0] if named else 'a rank failed'};"
              f" {where}", file=sys.stderr, flush=True)
