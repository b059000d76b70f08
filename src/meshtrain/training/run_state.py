"""A run's bookkeeping on one rank, beside the steps its `Trainer` takes: metrics (rank 0
writes), progress, timing, evaluation and checkpoint cadence, the pipeline trace, and how the
run ends: at its last step, stopped by a signal (`EXIT_STOPPED`), or after too many non-finite
steps in a row (`EXIT_NONFINITE`)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from meshtrain.checkpointing.resuming import continue_advice, last_good_checkpoint
from meshtrain.config.run_config import RunConfig, local_ranks, profile_window
from meshtrain.data.corpus import write_atomic
from meshtrain.data.tokenization import TOKENIZER_FILE
from meshtrain.memory import PeakMemory, measure_peak
from meshtrain.operations.failures import (
    EXIT_FAILED,
    EXIT_NONFINITE,
    EXIT_STOPPED,
    RunFailure,
    writing,
)
from meshtrain.operations.stopping import SAVE_NOW, StopSignals, stop_signal
from meshtrain.operations.stragglers import StragglerDetector
from meshtrain.parallel.communication import comm
from meshtrain.parallel.communication.flight_recorder import FlightRecorder
from meshtrain.training.metrics import (
    MetricsLog,
    Progress,
    StepTimer,
    Utilization,
    metric_sinks,
    read_metrics,
)
from meshtrain.training.plots import plot_loss_curve
from meshtrain.training.profiling import StepProfiler


class RunState:
    """The loop's bookkeeping on this rank: metrics (rank 0 writes), progress, timing,
    evaluation and checkpoint cadence, the pipeline trace."""

    def __init__(self, cfg: RunConfig, trainer, out: Path, start: int,
                 stop: StopSignals | None = None, recorder: FlightRecorder | None = None):
        """`trainer`: the rank's `training.trainer.Trainer` (that module imports this one);
        `recorder`: the rank's armed flight recorder, which keeps each step's totals."""
        t, mesh = cfg.train, trainer.mesh
        self.cfg, self.trainer, self.out, self.start = cfg, trainer, out, start
        self.signals, self.last_save = stop, time.monotonic()
        if stop is not None or cfg.checkpoint.save_every_minutes:
            trainer.requests = self._request
        self.stop = t.stop_at or t.steps
        self.log = None
        comm.barrier(mesh.world)  # every rank has checked `out` before rank 0 writes to it
        if mesh.rank == 0 and trainer.replicas is None:  # (replica groups: `_take_over`)
            with writing(out, lambda: continue_advice(out / "checkpoints")):
                out.mkdir(parents=True, exist_ok=True)
                (out / "config.toml").write_text(trainer.config_toml)
                if trainer.tokenizer is not None:  # `meshtrain sample RUN` decodes with it
                    write_atomic(out / TOKENIZER_FILE, trainer.tokenizer.read_bytes())
            resuming = cfg.checkpoint.resume or cfg.checkpoint.auto_resume
            resume_step = start if resuming else None
            sinks = metric_sinks(out, cfg.logging, resume_step=resume_step, config=cfg.to_dict())
            self.log = MetricsLog(out / "metrics.jsonl", resume_step=resume_step, sinks=sinks)
        speaks = trainer.replicas is None or trainer.replicas.group_id == 0  # (one progress)
        self.progress = Progress(total=self.stop, initial=start, enabled=mesh.rank == 0 and speaks,
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
        self.recorder, self.stragglers = recorder, None
        if recorder is not None and cfg.parallel.straggler_window:
            self.stragglers = StragglerDetector(mesh, window=cfg.parallel.straggler_window,
                                                threshold=cfg.parallel.straggler_threshold)
        self.nonfinite_run = 0  # consecutive steps with an inf/NaN loss or gradient norm
        self.first_step_s = 0.0  # `compile`: the step that compiled, reported after the next

    def step(self, step: int) -> None:
        trainer, t = self.trainer, self.cfg.train
        self.profiler.before(step + 1)
        peak = None
        if step == self.peak_step:
            with measure_peak(trainer.mesh.device,
                              baseline={"parameters": trainer.model.parameters()}) as peak:
                row, totals = self._run_step(step)
        else:
            row, totals = self._run_step(step)
        if (trace := self.profiler.after(step + 1)) is not None:
            self.progress.write(f"meshtrain: profiled steps {self.profiler.window.start}-"
                                f"{step + 1}: one trace per rank, e.g. {trace} (ui.perfetto.dev)")
        if row.pop("discarded", False):
            self.progress.write(f"meshtrain: step {step + 1} discarded: a replica group failed"
                                " in it; the others go on")
            self.timer.lap()
            return
        self._take_over(step)
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
                **self.utilization.fields(tokens_per_s)} | self._compare(step, totals)
        if self.cfg.plan.compile and step <= self.start + 1:
            self._report_compile(step, elapsed)
        done = step + 1
        if t.eval_every and (done % t.eval_every == 0 or done == self.stop):
            evaluation = {"step": done, "eval_loss": trainer.evaluate()}
            self._write(evaluation)
            self.progress.write(f"step {done}: eval loss {evaluation['eval_loss']:.4f}")
        self._write(row)
        self._drop_if_straggling()
        self.progress.update(step=done, loss=row["loss"], tokens_per_s=tokens_per_s,
                             tflops=row["tflops"], mfu=row.get("mfu"),
                             moe_load=row.get("moe_load_max_over_mean"))
        self._save_or_stop(done, request)
        self.timer.lap()  # exclude evaluation and checkpointing from the next step's time

    def _save_or_stop(self, done: int, request: float) -> None:
        """After step `done`: save on the cadence, at the end or when asked (never inside a
        streak of non-finite steps), with the metrics the checkpoint holds flushed first; end
        the run when the ranks agreed on a stop signal."""
        trainer, t = self.trainer, self.cfg.train
        save_every = self.cfg.checkpoint.save_every
        stopping = stop_signal(request) if done < self.stop else None
        # Never inside a streak of non-finite steps: the last good checkpoint stays the last
        # one saved before it began (a streak reaching the end stopped the run above).
        saving = not self.nonfinite_run and (
            done == self.stop or (save_every and done % save_every == 0) or request >= SAVE_NOW)
        if stopping and self.signals is not None:
            self.signals.agreed()
        if self.trainer.replicas is not None and not self.trainer.replicas.leader:
            saving = False  # the run's files are the lowest-numbered group's
        if saving or done % t.log_every == 0 or self.trainer.replicas is not None:
            self.flush()  # the metrics of every step a checkpoint holds are on disk with it
        if saving:  # the end and a stop save in the foreground, after the write in flight
            path = trainer.save(self.out, done, background=done < self.stop and not stopping)
            self.last_save = time.monotonic()
            if (stopping or done == self.stop) and self.signals is not None:
                self.signals.saved()  # the run's last checkpoint: a later signal changes nothing
            if done < self.stop and not stopping:  # the end and a stop say so themselves
                how = "writing in the background" if trainer.saver else "saved"
                self.progress.write(f"meshtrain: {how} checkpoint {path}")
        if stopping:
            self.progress.close()
            if not saving and self.trainer.replicas is not None and not self.nonfinite_run:
                raise RunFailure("", EXIT_STOPPED, agreed=True)  # the saving group says it
            if not saving:  # inside a non-finite streak
                raise RunFailure(f"stopped by {stopping.name} after step {done}, inside"
                                 f" {self.nonfinite_run} non-finite step(s) in a row, without"
                                 f" saving; {self._last_good()}", EXIT_STOPPED, agreed=True)
            raise RunFailure(f"stopped by {stopping.name} after step {done}; checkpoint"
                             f" {path.name} saved; continue with `resume` (or `auto_resume`)",
                             EXIT_STOPPED, agreed=True)

    def _take_over(self, step: int) -> None:
        """Replica groups: rank 0 of the lowest-numbered group taking part writes
        metrics.jsonl (from the rows up to `step`, the last committed before this one) and
        config.toml; another group's closes it when it stops being that group."""
        replicas, out = self.trainer.replicas, self.out
        if replicas is None or self.trainer.mesh.rank != 0:
            return
        if replicas.leader and self.log is None:
            with writing(out, lambda: continue_advice(out / "checkpoints")):
                out.mkdir(parents=True, exist_ok=True)
                (out / "config.toml").write_text(self.trainer.config_toml)
            self.log = MetricsLog(out / "metrics.jsonl", resume_step=step)
        elif not replicas.leader and self.log is not None:
            self.log.close()
            self.log = None

    def _run_step(self, step: int) -> tuple[dict, tuple[float, float] | None]:
        """The step's row, and its (compute, blocked) seconds when a recorder is armed."""
        if self.recorder is not None:
            self.recorder.begin_step()
        row = self._traced(step) if step == self.traced else self.trainer.train_step(step)
        return row, None if self.recorder is None else self.recorder.end_step()

    def _compare(self, step: int, totals: tuple[float, float] | None) -> dict:
        """With straggler detection, at a window's end: the row's keys, and a line naming the
        stragglers (collective over the world). The run's first step is left out."""
        if self.stragglers is None:
            return {}
        window = self.stragglers.step(step + 1, totals if step > self.start else None)
        if window is None:
            return {}
        if window.named:
            self.progress.write(window.line())
        return window.fields()

    def _drop_if_straggling(self) -> None:
        """`drop_stragglers`: a rank of this replica group named in that many windows in a
        row ends the group (its step committed and written); its agent restarts it, and it
        heals from a live group. Every rank of the group sees the same windows. A group taking
        part alone is kept: ending it would leave none to heal from (the run's live state lost)."""
        windows = self.cfg.parallel.drop_stragglers
        if not windows or self.stragglers is None or len(self.trainer.replicas.members) < 2:
            return
        if ranks := self.stragglers.persistent(windows):
            group = self.trainer.replicas.group_id
            raise RunFailure(f"rank(s) {ranks} of replica group {group} named"
                             f" stragglers in {windows} windows in a row: the group restarts and"
                             " heals from a live group (`drop_stragglers`)", EXIT_FAILED,
                             agreed=True)

    def _stop_if_nonfinite(self, row: dict) -> None:
        """After `max_nonfinite_steps` consecutive inf/NaN steps, or at the last step inside
        fewer, end the run before anything is evaluated or saved (no checkpoint holds a step
        of the streak). Every rank read the same reduced values, so all stop together."""
        self.nonfinite_run = self.nonfinite_run + 1 if row.get("nonfinite") else 0
        if not self.nonfinite_run or (self.nonfinite_run < self.cfg.train.max_nonfinite_steps
                                      and row["step"] < self.stop):
            return
        self._write(row)
        good = self._last_good()
        raise RunFailure(f"step {row['step']}: loss {row['loss']}, gradient norm"
                         f" {row['grad_norm']}: not finite for {self.nonfinite_run} consecutive"
                         f" step(s), so the run stopped without saving; {good}. Lower `lr`, raise"
                         " `warmup_steps` or tighten `clip_grad`, and train again (or allow"
                         " skipped steps with `max_nonfinite_steps`)",
                         EXIT_NONFINITE, agreed=True)

    def _last_good(self) -> str:
        """Rank 0's words for the last good checkpoint: the newest saved before the streak (none
        is saved inside one) that is there and verifies; other ranks print nothing."""
        if self.log is None:
            return ""
        last = last_good_checkpoint(self.out / "checkpoints")
        return f"the last good checkpoint is {last}" if last else "no checkpoint was saved"

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
            if self.stop < self.cfg.train.steps:  # --stop-at: the run is not over
                print(f"meshtrain: stopped at step {self.stop} of {self.cfg.train.steps} as"
                      f" --stop-at asked; continue: the same command with --resume, without"
                      f" --stop-at (or a later one)")
        return self.rows
