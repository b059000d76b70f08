"""The training loop run by every rank: the executor's forward and backward over a step's
micro-batches -> the gradient sync's reduction -> unscaling, the overflow check and clipping ->
the optimizer step -> metrics, evaluation and checkpoints.

It works through interfaces (`parallelize`'s gradient sync and executor, the family's parameter
roles) and never asks which strategy or model family it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshtrain.checkpointing.async_save import AsyncSaver
from meshtrain.checkpointing.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    prepare_checkpoint,
    save_checkpoint,
)
from meshtrain.config.run_config import RunConfig, check_packing, local_ranks, profile_window
from meshtrain.data.blend import Blend, load_data
from meshtrain.data.corpus import BatchSampler, write_atomic
from meshtrain.data.tokenization import TOKENIZER_FILE
from meshtrain.interop.checkpoint_formats import checkpoint_format
from meshtrain.memory import PeakMemory, measure_peak
from meshtrain.mesh import ParallelMesh
from meshtrain.operations.failures import (
    EXIT_FAILED,
    EXIT_NONFINITE,
    EXIT_STOPPED,
    RunFailure,
    writing,
)
from meshtrain.operations.run_lock import RunLock, record_ranks
from meshtrain.operations.stopping import SAVE_NOW, StopSignals, failed_rank, stop_signal
from meshtrain.operations.watchdog import HangWatchdog, process_group_timeout
from meshtrain.parallel.communication import comm
from meshtrain.parallel.runtime.executor import Packing
from meshtrain.parallel.runtime.optim import clip_grad_norm_
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.runtime.process_groups import init_parallel
from meshtrain.parallelize import ParallelModel, parallelize
from meshtrain.precision import LossScaler
from meshtrain.training.metrics import (
    MetricsLog,
    Progress,
    StepTimer,
    Utilization,
    metric_sinks,
    read_metrics,
    read_scalars,
)
from meshtrain.training.pipeline_trace import gather_timeline, write_trace
from meshtrain.training.plots import plot_loss_curve
from meshtrain.training.profiling import StepProfiler

STATE_KEYS = ("parameters", "gradients", "optimizer_states")


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
        packing = Packing(corpus.eod_id, d.document_mask, d.reset_positions, d.eod_mask_loss)
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
        return self.train_data.micro_batches(step, dp_rank=self.mesh.dp.rank,
                                             dp_size=self.mesh.dp.size)

    def train_step(self, step: int, *, timeline: list | None = None) -> dict:
        """One optimizer step (0-based index `step`); returns its metrics. `timeline` collects
        this rank's pipeline events (see `run_schedule`).

        The step reads the device once: its scalars (loss, gradient norm, the overflow flag,
        routing statistics) in one transfer (`read_scalars`). With a loss scale, or when
        `max_nonfinite_steps` lets a non-finite step be skipped, that read comes before the
        optimizer step; otherwise after it, so the device queue never drains mid-step (a
        non-finite step then ends the run before anything is saved)."""
        t, mesh, sync, optimizer = self.cfg.train, self.mesh, self.sync, self.cfg.optimizer
        lr = optimizer.lr_at(step, total_steps=t.steps)
        self.model.train()
        sync.zero_grad()
        result = self.executor.forward_backward(step, self._micro_batches, sync,
                                                loss_scale=self.scaler.scale, timeline=timeline)
        grads = sync.wait()
        scalars = {}
        if self.scaler.enabled:
            for grad in grads.values():
                grad.mul_(1.0 / self.scaler.scale)
            scalars["overflow"] = self._any_overflow(grads)
        roles = self.parallel.roles
        scalars["grad_norm"] = clip_grad_norm_(self.model, mesh, optimizer.clip_grad, grads,
                                               counted_elsewhere=roles.counted_elsewhere,
                                               experts=roles.experts, sharded=sync.sharded)
        comm.all_reduce(result.loss, mesh.dp_cp, op=torch.distributed.ReduceOp.AVG)
        scalars["loss"] = result.loss
        if self.requests is not None:  # every rank reads the same stop/save decision
            scalars["request"] = torch.full((), self.requests(), device=mesh.device)
            comm.all_reduce(scalars["request"], mesh.world, op=torch.distributed.ReduceOp.MAX)
        if self.model.cfg.moe_experts:
            micro_batches = self.plan.micro_batches_per_step(t.global_batch)
            scalars |= result.routing.summary(mesh, micro_batches)
        row = {"step": step + 1}
        if not self.scaler.enabled and t.max_nonfinite_steps == 1:  # a bad step ends the run
            self.executor.optimizer_step(lambda: sync.step(lr))
            values = read_scalars(scalars)
            bad = self._nonfinite(values)
        else:  # decide before the update whether to skip it
            values = read_scalars(scalars)
            bad, overflow = self._nonfinite(values), values.pop("overflow", 0) > 0
            skipped = bad or overflow
            if not skipped:
                self.executor.optimizer_step(lambda: sync.step(lr))
            elif overflow:
                values["grad_norm"] = float("nan")  # the step did not happen
            row["skipped"] = int(skipped)
            if self.scaler.enabled:
                row["loss_scale"] = self.scaler.scale
                self.scaler.update(overflow)
        if bad:
            row["nonfinite"] = 1
        return row | {"loss": values.pop("loss"), "grad_norm": values.pop("grad_norm"),
                      "lr": lr} | values

    def _nonfinite(self, values: dict[str, float]) -> bool:
        """Whether the step's loss (or, without a loss scale, its gradient norm) is inf or NaN.
        Both are reduced over every rank before the read, so every rank decides alike. An fp16
        gradient overflow is the loss scale's business (skip and rescale), not a failure."""
        finite = math.isfinite(values["loss"])
        if not self.scaler.enabled:
            finite = finite and math.isfinite(values["grad_norm"])
        return not finite

    def _any_overflow(self, grads: dict[int, torch.Tensor]) -> torch.Tensor:
        """1.0 if an inf/nan is anywhere on any rank, else 0.0, on the device: every rank
        must skip the same step."""
        finite = torch.stack([grad.isfinite().all() for grad in grads.values()]).all()
        found = (~finite).float()
        comm.all_reduce(found, self.mesh.world, op=torch.distributed.ReduceOp.MAX)
        return found

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
        try:
            return self.saver.settle()
        except CheckpointError as e:
            raise RunFailure(str(e), EXIT_FAILED, agreed=True) from None

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
            mesh = init_parallel(**plan.degrees, tp_scheme=plan.tp_scheme,
                                 tp_depth=plan.tp_depth, device=cfg.parallel.device,
                                 timeout=process_group_timeout(timeout))
        if lock is not None:
            lock.acquire_agreed(mesh)
        try:
            record_ranks(cfg.checkpoint.out, mesh)
            return _train(cfg, mesh, stop)
        finally:
            if lock is not None:
                lock.release()


def _train(cfg: RunConfig, mesh: ParallelMesh, stop: StopSignals | None) -> list[dict]:
    trainer = Trainer.build(cfg, mesh)
    try:
        return _train_built(cfg, mesh, trainer, stop)
    finally:
        trainer.sync.close()


def _train_built(cfg: RunConfig, mesh: ParallelMesh, trainer: Trainer,
                 stop: StopSignals | None) -> list[dict]:
    out = Path(cfg.checkpoint.out)
    resuming = cfg.checkpoint.resume or cfg.checkpoint.auto_resume
    start = trainer.resume(out) if resuming else 0
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts:  # the agent restarted every rank after one failed: say which, once
        _say_restart(mesh, restarts, start)
    if start == 0 and cfg.checkpoint.init_from:  # nothing of this run's own to resume
        trainer.start_from(cfg.checkpoint.init_from)
    run = _Run(cfg, trainer, out, start, stop)
    if cfg.checkpoint.async_save:
        trainer.saver = AsyncSaver(mesh)
    try:
        for step in range(start, run.stop):
            run.step(step)
    finally:
        run.flush()  # the rows of the steps done, even when one fails
        if trainer.saver is not None:
            trainer.saver.wait()  # the process ends only after its writer
    return run.finish()


def _say_restart(mesh: ParallelMesh, restarts: int, start: int) -> None:
    """Rank 0's line on an elastic restart: the failed rank as the first node that saw it
    names it (each node's local rank 0 reads its own ranks' files), and what was resumed."""
    mine = failed_rank(mesh.world_size) if os.environ.get("LOCAL_RANK", "0") == "0" else None
    named = [cause for cause in comm.all_gather_objects(mine, mesh.world) if cause]
    if mesh.rank == 0:
        where = f"resumed from checkpoint step_{start:08d}" if start else \
            "no checkpoint yet: started over"
        print(f"meshtrain: restart {restarts}: {named[0] if named else 'a rank failed'};"
              f" {where}", file=sys.stderr, flush=True)


class _Run:
    """The loop's bookkeeping on this rank: metrics (rank 0 writes), progress, timing,
    evaluation and checkpoint cadence, the pipeline trace."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, out: Path, start: int,
                 stop: StopSignals | None = None):
        t, mesh = cfg.train, trainer.mesh
        self.cfg, self.trainer, self.out, self.start = cfg, trainer, out, start
        self.signals, self.last_save = stop, time.monotonic()
        if stop is not None or cfg.checkpoint.save_every_minutes:
            trainer.requests = self._request
        self.stop = t.stop_at or t.steps
        self.log = None
        comm.barrier(mesh.world)  # every rank has checked `out` before rank 0 writes to it
        if mesh.rank == 0:
            with writing(out):
                out.mkdir(parents=True, exist_ok=True)
                (out / "config.toml").write_text(trainer.config_toml)
                if trainer.tokenizer is not None:  # `meshtrain sample RUN` decodes with it
                    write_atomic(out / TOKENIZER_FILE, trainer.tokenizer.read_bytes())
            resuming = cfg.checkpoint.resume or cfg.checkpoint.auto_resume
            resume_step = start if resuming else None
            sinks = metric_sinks(out, cfg.logging, resume_step=resume_step, config=cfg.to_dict())
            self.log = MetricsLog(out / "metrics.jsonl", resume_step=resume_step, sinks=sinks)
        self.progress = Progress(total=self.stop, initial=start, enabled=mesh.rank == 0,
                                 interval=t.log_every)
        self.utilization = Utilization.of_run(
            trainer.model.cfg.flops_per_token(t.seq_len), ranks=mesh.world_size,
            precision=trainer.plan.precision, device=mesh.device,
            hardware=cfg.parallel.hardware, local_ranks=local_ranks(cfg, mesh.world_size))
        if self.log is not None and self.log.kept_aside is not None:
            self.progress.write(f"meshtrain: the rows after step {start} of the interrupted run"
                                f" are kept in {self.log.kept_aside}")
        if self.log is not None and self.log.damaged:
            self.progress.write(f"meshtrain: dropped {self.log.damaged} damaged line(s) of"
                                f" {self.log.path} (a write cut short)")
        trace = cfg.parallel.trace  # a pipeline's warm step (the CLI says when there is none)
        self.traced = min(start + 1, self.stop - 1) if trace and mesh.pp.size > 1 else None
        self.peak_step = min(start + 1, self.stop - 1) if cfg.logging.peak_memory else None
        window = profile_window(cfg.logging.profile_steps, self.stop) \
            if cfg.logging.profile_steps else range(0)
        self.profiler = StepProfiler(window, out, mesh.rank, mesh.device)
        self.timer, self.rows = StepTimer(), []
        self.nonfinite_run = 0  # consecutive steps with an inf/NaN loss or gradient norm
        self.first_step_s = 0.0  # `compile`: the step that compiled, reported after the next

    def step(self, step: int) -> None:
        trainer, t = self.trainer, self.cfg.train
        self.profiler.before(step + 1)
        peak = None
        if step == self.peak_step:
            with measure_peak(trainer.mesh.device,
                              baseline={"parameters": trainer.model.parameters()}) as peak:
                row = self._run_step(step)
        else:
            row = self._run_step(step)
        if (trace := self.profiler.after(step + 1)) is not None:
            self.progress.write(f"meshtrain: profiled steps {self.profiler.window.start}-"
                                f"{step + 1}: one trace per rank, e.g. {trace} (ui.perfetto.dev)")
        request = row.pop("request", 0.0)
        self._stop_if_nonfinite(row)
        if step == self.start:
            self._report_memory()
        if peak is not None:
            self._report_peak(step, peak)
        elapsed = self.timer.lap()
        if self.signals is not None:
            self.signals.longest_step = max(self.signals.longest_step, elapsed)
        tokens_per_s = t.global_batch * t.seq_len / elapsed
        row |= {"tokens_per_s": tokens_per_s, "step_time_s": elapsed,
                **self.utilization.fields(tokens_per_s)}
        if self.cfg.plan.compile and step <= self.start + 1:
            self._report_compile(step, elapsed)
        done = step + 1
        if t.eval_every and (done % t.eval_every == 0 or done == self.stop):
            evaluation = {"step": done, "eval_loss": trainer.evaluate()}
            self._write(evaluation)
            self.progress.write(f"step {done}: eval loss {evaluation['eval_loss']:.4f}")
        self._write(row)
        self.progress.update(step=done, loss=row["loss"], tokens_per_s=tokens_per_s,
                             tflops=row["tflops"], mfu=row.get("mfu"))
        save_every = self.cfg.checkpoint.save_every
        stopping = stop_signal(request) if done < self.stop else None
        saving = (done == self.stop or (save_every and done % save_every == 0)
                  or request >= SAVE_NOW)
        if stopping and self.signals is not None:
            self.signals.agreed()
        if saving or done % t.log_every == 0:
            self.flush()  # the metrics of every step a checkpoint holds are on disk with it
        if saving:  # the end and a stop save in the foreground, after the write in flight
            path = trainer.save(self.out, done, background=done < self.stop and not stopping)
            self.last_save = time.monotonic()
            if done < self.stop and not stopping:  # the end and a stop say so themselves
                how = "writing in the background" if trainer.saver else "saved"
                self.progress.write(f"meshtrain: {how} checkpoint {path}")
        if stopping:
            self.progress.close()
            raise RunFailure(f"stopped by {stopping.name} after step {done}; checkpoint"
                             f" {path.name} saved; continue with `resume` (or `auto_resume`)",
                             EXIT_STOPPED, agreed=True)
        self.timer.lap()  # exclude evaluation and checkpointing from the next step's time

    def _run_step(self, step: int) -> dict:
        return self._traced(step) if step == self.traced else self.trainer.train_step(step)

    def _stop_if_nonfinite(self, row: dict) -> None:
        """After `max_nonfinite_steps` consecutive inf/NaN steps, end the run before anything
        is evaluated or saved. Every rank read the same reduced values, so all stop together."""
        self.nonfinite_run = self.nonfinite_run + 1 if row.get("nonfinite") else 0
        if self.nonfinite_run < self.cfg.train.max_nonfinite_steps:
            return
        self._write(row)
        last = latest_checkpoint(self.out / "checkpoints") if self.log is not None else None
        good = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
        raise RunFailure(f"step {row['step']}: loss {row['loss']}, gradient norm"
                         f" {row['grad_norm']}: not finite for {self.nonfinite_run} consecutive"
                         f" step(s), so the run stopped without saving; {good}. Lower `lr`, raise"
                         " `warmup_steps` or tighten `clip_grad`, and train again (or allow"
                         " skipped steps with `max_nonfinite_steps`)",
                         EXIT_NONFINITE, agreed=True)
    def _request(self) -> float:
        """This rank's part of the step's request: a stop signal's, or (rank 0's clock) a
        timed save when `save_every_minutes` have passed since the last save."""
        value = self.signals.request() if self.signals is not None else 0.0
        minutes = self.cfg.checkpoint.save_every_minutes
        rank0 = self.trainer.mesh.rank == 0
        if minutes and rank0 and time.monotonic() - self.last_save >= 60 * minutes:
            value = max(value, SAVE_NOW)
        return value

    def _traced(self, step: int) -> dict:
        trace = Path(self.cfg.parallel.trace)
        row, idle = self.trainer.traced_train_step(step, trace)
        if idle:
            per_stage = ", ".join(f"{r['idle_measured']:.1%} vs {r['idle_simulated']:.1%}"
                                  for r in idle["stages"])
            files = ["pipeline.json", "pipeline_idle.json"] + ["pipeline.png"] * idle["png"]
            self.progress.write(f"meshtrain: pipeline timeline of step {step + 1} in {trace}:"
                                f" {', '.join(files)}; idle per stage, measured vs"
                                f" simulated: {per_stage}")
        return row

    def _report_compile(self, step: int, elapsed: float) -> None:
        """Once: the first step's time, which compiled the blocks (`compile`), beside the next
        step's, which ran the compiled code (the difference is about the compilation)."""
        if step == self.start:
            self.first_step_s = elapsed
            if step + 1 < self.stop:
                return  # said after the next step
        first = self.first_step_s
        after = f"; the next took {elapsed:.2f} s (compiling: about {first - elapsed:.1f} s)" \
            if step > self.start else ""
        self.progress.write(f"meshtrain: compiled the transformer blocks in the first step:"
                            f" it took {first:.1f} s{after}")

    def _report_memory(self) -> None:
        report = comm.all_gather_objects(self.trainer.memory_report(), self.trainer.mesh.world)
        if self.log is not None:
            (self.out / "memory.json").write_text(json.dumps({"ranks": report}, indent=1))
            self.progress.write(f"model states on rank 0: {report[0]['total'] / 2**20:.1f} MiB"
                                " (parameters, gradients, optimizer states; all ranks in"
                                f" {self.out / 'memory.json'})")

    def _report_peak(self, step: int, peak: PeakMemory) -> None:
        """Each rank's peak of `step` joins its model states in memory.json."""
        peaks = comm.all_gather_objects(dataclasses.asdict(peak), self.trainer.mesh.world)
        if self.log is None:
            return
        path = self.out / "memory.json"
        report = json.loads(path.read_text())
        for rank, measured in zip(report["ranks"], peaks, strict=True):
            rank["peak"] = measured | {"step": step + 1}
        path.write_text(json.dumps(report, indent=1))
        most = max(range(len(peaks)), key=lambda r: peaks[r]["peak"])
        self.progress.write(f"peak memory of step {step + 1}: {peaks[most]['peak'] / 2**20:.1f}"
                            f" MiB on rank {most}, the most (every rank's in {path})")

    def _write(self, row: dict) -> None:
        if self.log is not None:
            self.log.write(row)
            self.rows.append(row)

    def flush(self) -> None:
        if self.log is not None:
            self.log.flush()

    def finish(self) -> list[dict]:
        self.progress.close()
        if self.log is not None:
            self.log.close()
            if plot_loss_curve(read_metrics(self.out / "metrics.jsonl"), self.out / "loss.png"):
                print(f"meshtrain: loss curve in {self.out / 'loss.png'}")
            print(f"meshtrain: metrics in {self.out / 'metrics.jsonl'}, checkpoint step"
                  f" {self.stop} in {self.out / 'checkpoints'}")
        return self.rows
