"""Pipeline parallelism: which layers a stage holds, and the executor that runs a schedule.

The executor runs one rank's action list (see `schedules.py`) on its model chunks (one, or v
under the interleaved schedule: rank s holds global chunks s, s + p, ...): forwards take token
ids (first global chunk) or the activation received from the previous global chunk; backwards
take the loss (last global chunk) or the gradient received from the next one. The previous
chunk lives on rank s - 1, or on rank p - 1 for rank 0's later chunks (the wrap-around), and the
next on rank s + 1, or rank 0. Sends are asynchronous and waited at the end of the step (under
2BW, one step later); receives block just before the compute that needs them, so any schedule
the simulator accepts runs without deadlock. Shapes are known ahead (`[micro, s, h]`), so no
handshake precedes a transfer.

Matching transfers: every (micro-batch, stage boundary, direction) has its own tag (gloo matches
on it). NCCL ignores tags and matches the transfers between two ranks in issue order, so
activations travel on the `pp` groups and gradients on `pp_grad`: per group and rank pair, the
sender issues in the order the receiver expects, because every rank runs its forwards (and its
backwards) in the same (micro-batch, local chunk) order. One shared group would not do: at
pp 2 with interleaving, rank 0 sends rank 1 both activations and (wrapped-around) gradients, and
the two ranks interleave forwards and backwards differently. Evaluation between 2BW steps
gets its own tags, as a training activation may still be in flight; on NCCL it would need its
own groups as well.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshtrain.errors import Code, SettingError
from meshtrain.memory import saved_activation_bytes
from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.parallel.runtime.schedules import (
    BACKWARD,
    FORWARD,
    OPTIMIZER_STEP,
    RECV_ACTIVATION,
    RECV_GRAD,
    SEND_ACTIVATION,
    SEND_GRAD,
    Action,
    model_chunk,
    pipedream_2bw,
)


def stage_layers(num_layers: int, num_stages: int, split: list[int] | None = None) -> list[range]:
    """Layers of each stage: `split` (counts per stage, the plan's `pp_layers`) or balanced,
    earlier stages taking the remainder."""
    if split is None:
        base, extra = divmod(num_layers, num_stages)
        split = [base + (1 if s < extra else 0) for s in range(num_stages)]
    text = ",".join(map(str, split))
    if len(split) != num_stages:
        raise SettingError(Code.PP_LAYERS_SPLIT, (
            f"`pp_layers` {text} has {len(split)} entries: give one layer count per"
            f" pipeline stage ({num_stages})"))
    if min(split) < 1:
        raise SettingError(Code.PP_LAYERS_SPLIT, (
            f"`pp_layers` {text} leaves a stage without layers: every count must be"
            " at least 1"))
    if sum(split) != num_layers:
        raise SettingError(Code.PP_LAYERS_SPLIT, (
            f"`pp_layers` {text} sums to {sum(split)}: the counts must sum to the"
            f" model's {num_layers} layers"))
    starts = [sum(split[:s]) for s in range(num_stages)]
    return [range(start, start + n) for start, n in zip(starts, split, strict=True)]


@dataclass
class ScheduleRun:
    """What one rank's run of a schedule produced, and the most activation state it held."""

    losses: list[torch.Tensor]  # last global chunk's per-micro-batch losses (/ m), else empty
    peak_in_flight: int  # most (micro, chunk)s forwarded and not yet backwarded at one time
    peak_saved_bytes: int  # most bytes autograd saved for them at one time (0: not counted)


@dataclass
class InFlight:
    """What the executor holds between actions: micro-batches forwarded and not yet backwarded
    (keyed by (micro, local chunk)) and sends not yet waited. A schedule that does not flush
    (PipeDream-2BW) carries it from one optimizer step to the next."""

    inputs: dict = field(default_factory=dict)  # received activations
    outputs: dict = field(default_factory=dict)  # forward outputs (losses on the last chunk)
    grads: dict = field(default_factory=dict)  # received gradients
    extra: dict = field(default_factory=dict)  # the chunk's own extra loss per forward
    saved: dict = field(default_factory=dict)  # bytes autograd holds per in-flight chunk
    sends: list = field(default_factory=list)  # (work, tensor): the tensor lives until waited

    def wait_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def run_schedule(actions: list[Action], *, stage: Callable, loss_fn: Callable,
                 micro_batches, mesh: ParallelMesh, activation_shape: tuple[int, ...],
                 dtype: torch.dtype, num_chunks: int = 1, num_micro_batches: int | None = None,
                 before_backward: Callable[[int], None] = lambda micro: None,
                 use_weights_of: Callable[[int], None] = lambda micro: None,
                 loss_scale: float = 1.0, count_saved_of=None,
                 carry: InFlight | None = None, timeline: list | None = None) -> ScheduleRun:
    """Run this rank's actions. `stage(x, chunk, batch)` runs local chunk `chunk` (of
    `num_chunks`) on micro-batch `batch` and returns its output and its own extra loss for that
    micro-batch (MoE routing losses, joining that backward; 0.0 for none); `micro_batches[i]`
    is micro-batch i (a `contracts.MicroBatch`, or any sequence whose first item is its token
    ids); `loss_fn(logits, batch)` is its loss, divided by `num_micro_batches` (per optimizer
    step; default len(micro_batches)).

    `before_backward(i)` lets the caller mark the last backward of a step (data-parallel
    reduction); `use_weights_of(i)`, called before each forward and backward, lets the caller
    put in the weight version micro-batch i uses (2BW).
    `count_saved_of`: the stage's parameters, to count the bytes autograd saves per in-flight
    chunk (off by default: a hook per saved tensor; a storage shared by chunks counts in each).
    `carry`: state kept across calls; its sends are waited one call later (their receivers may
    post them only after the optimizer step), and `carry.wait_sends()` drains the last ones.
    `timeline`, when given, gets one (kind, micro, chunk, start, end) per action, in
    `time.perf_counter()` seconds (see `pipeline_trace.py`).
    """
    state = carry or InFlight()
    earlier_sends, state.sends = state.sends, []
    runner = _Runner(stage=stage, loss_fn=loss_fn, micro_batches=micro_batches, mesh=mesh,
                     activation_shape=activation_shape, dtype=dtype, num_chunks=num_chunks,
                     m=num_micro_batches or len(micro_batches),
                     before_backward=before_backward, use_weights_of=use_weights_of,
                     loss_scale=loss_scale, count_saved_of=count_saved_of, state=state)
    for a in actions:
        start = time.perf_counter()
        runner.run(a)
        if timeline is not None:
            timeline.append((a.kind, a.micro, a.chunk, start, time.perf_counter()))
    for work, _ in earlier_sends:
        work.wait()
    if carry is None:
        state.wait_sends()
    return runner.result


class _Runner:
    """What each kind of action does on this rank (see `run_schedule`)."""

    def __init__(self, *, stage, loss_fn, micro_batches, mesh: ParallelMesh,
                 activation_shape, dtype, num_chunks: int, m: int, before_backward,
                 use_weights_of, loss_scale: float, count_saved_of, state: InFlight):
        self.stage, self.loss_fn, self.micro_batches = stage, loss_fn, micro_batches
        self.mesh, self.activation_shape, self.dtype = mesh, activation_shape, dtype
        self.axis, self.grad_axis = mesh.pp, mesh.axis("pp_grad")
        p, s = mesh.pp.size, mesh.pp.rank
        self.previous, self.following = (s - 1) % p, (s + 1) % p
        self.last = p * num_chunks - 1
        self.m, self.loss_scale, self.count_saved_of = m, loss_scale, count_saved_of
        self.before_backward, self.use_weights_of = before_backward, use_weights_of
        self.state = state
        self.result = ScheduleRun([], 0, 0)
        # Evaluation's activations get their own tags: 2BW training sends may still be in
        # flight.
        self.forward_tag = 0 if torch.is_grad_enabled() else 2
        self.handlers = {RECV_ACTIVATION: self.recv_activation, FORWARD: self.forward,
                         SEND_ACTIVATION: self.send_activation, RECV_GRAD: self.recv_grad,
                         BACKWARD: self.backward, SEND_GRAD: self.send_grad,
                         OPTIMIZER_STEP: lambda i, g, key: None}

    def run(self, a: Action) -> None:
        g = model_chunk(self.mesh.pp.rank, a.chunk, self.mesh.pp.size)
        self.handlers[a.kind](a.micro, g, (a.micro, a.chunk))

    def tag(self, i: int, boundary: int, kind: int) -> int:
        """Boundary b lies between global chunks b and b + 1: one tag per (micro, boundary,
        kind: 0 activation, 1 gradient, 2 evaluation activation)."""
        return 3 * (i * (self.last + 1) + boundary) + kind

    def recv_activation(self, i: int, g: int, key: tuple[int, int]) -> None:
        buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.mesh.device)
        comm.recv(buffer, self.axis, self.previous, tag=self.tag(i, g - 1, self.forward_tag))
        self.state.inputs[key] = buffer.requires_grad_(torch.is_grad_enabled())

    def _compute(self, x: torch.Tensor, key: tuple[int, int], batch, last: bool):
        """One local chunk's forward, and the loss if it is the `last` chunk."""
        out, self.state.extra[key] = self.stage(x, key[1], batch)
        return self.loss_fn(out, batch) / self.m if last else out

    def forward(self, i: int, g: int, key: tuple[int, int]) -> None:
        state, run = self.state, self.result
        self.use_weights_of(i)
        batch = self.micro_batches[i]
        compute = functools.partial(self._compute,
                                    batch[0].to(self.mesh.device) if g == 0 else state.inputs[key],
                                    key, batch, g == self.last)
        if self.count_saved_of is None:
            state.outputs[key], state.saved[key] = compute(), 0
        else:
            state.saved[key], state.outputs[key] = saved_activation_bytes(compute,
                                                                          self.count_saved_of)
        if g == self.last:
            run.losses.append(state.outputs[key].detach())
        run.peak_in_flight = max(run.peak_in_flight, len(state.saved))
        run.peak_saved_bytes = max(run.peak_saved_bytes, sum(state.saved.values()))

    def send_activation(self, i: int, g: int, key: tuple[int, int]) -> None:
        outputs = self.state.outputs
        tensor = outputs[key].detach() if torch.is_grad_enabled() else outputs.pop(key)
        self.state.sends.append((comm.send(tensor, self.axis, self.following,
                                           tag=self.tag(i, g, self.forward_tag)), tensor))

    def recv_grad(self, i: int, g: int, key: tuple[int, int]) -> None:
        grad = torch.empty(self.activation_shape, dtype=self.dtype, device=self.mesh.device)
        comm.recv(grad, self.grad_axis, self.following, tag=self.tag(i, g, 1))
        self.state.grads[key] = grad

    def backward(self, i: int, g: int, key: tuple[int, int]) -> None:
        state, m, scale = self.state, self.m, self.loss_scale
        self.use_weights_of(i)
        self.before_backward(i)
        own = state.extra.pop(key)
        if g == self.last:
            ((state.outputs.pop(key) + own / m) * scale).backward()
        elif isinstance(own, torch.Tensor):
            torch.autograd.backward([state.outputs.pop(key), own * (scale / m)],
                                    [state.grads.pop(key), None])
        else:
            state.outputs.pop(key).backward(state.grads.pop(key))
        del state.saved[key]

    def send_grad(self, i: int, g: int, key: tuple[int, int]) -> None:
        tensor = self.state.inputs.pop(key).grad
        self.state.sends.append((comm.send(tensor, self.grad_axis, self.previous,
                                           tag=self.tag(i, g - 1, 1)), tensor))


class PipeDream2BW:
    """One rank's PipeDream-2BW state across optimizer steps.

    The action list of the whole run (`schedules.pipedream_2bw`) is cut after each optimizer
    step into one segment per step; the executor's in-flight micro-batches carry over, so a
    step's segment already forwards some of the next step's micro-batches (no flush). Weights:
    micro-batch k of step t uses W(t - 1) for its forward and its backward, W(-1) = W(0), so the
    gradient applied at step t was computed at W(t - 1). `current` (what the optimizer steps)
    holds W(n) after n steps, `previous` W(n - 1); the model's parameters hold whichever version
    the next forward or backward needs, copied in through `.data` so that the autograd graphs of
    in-flight micro-batches, which reference the parameters, see no in-place change.
    """

    def __init__(self, params: list[torch.nn.Parameter], current: list[torch.Tensor], *,
                 p: int, s: int, m: int, first_step: int, num_steps: int,
                 previous: list[torch.Tensor] | None = None):
        self.segments: list[list[Action]] = [[]]
        for a in pipedream_2bw(p, m, num_steps)[s]:
            self.segments[-1].append(a)
            if a.kind == OPTIMIZER_STEP:
                self.segments.append([])
        self.first_step, self.m = first_step, m
        self.carry = InFlight()
        self.params, self.current = params, current
        # W(first_step - 1): from the checkpoint when resuming, else W(-1) = W(0)
        self.previous = [w.detach().clone() for w in previous or current]
        self.version = 0  # optimizer steps taken since `first_step`
        self.loaded = 0  # the version the model's parameters hold

    def segment(self, step: int) -> list[Action]:
        """This rank's actions from the end of step - 1's optimizer step to step's."""
        return self.segments[step - self.first_step]

    def steps_read(self, step: int) -> list[int]:
        """The optimizer steps whose micro-batches the segment of `step` forwards."""
        return sorted({self.first_step + a.micro // self.m for a in self.segment(step)
                       if a.kind == FORWARD})

    def end_segment(self, step: int) -> None:
        """After the run's last step nothing is in flight: wait the last sends (the drain)."""
        if step - self.first_step == len(self.segments) - 2:
            assert not self.carry.saved, "2BW: micro-batches left in flight at the end"
            self.carry.wait_sends()

    def use_weights_of(self, micro: int) -> None:
        self.load(micro // self.m - 1)  # -1: the version before the first step

    @torch.no_grad()
    def load(self, version: int) -> None:
        if version == self.loaded:
            return
        assert version in (self.version, self.version - 1), (version, self.version)
        source = self.current if version == self.version else self.previous
        for param, weights in zip(self.params, source, strict=True):
            param.data.copy_(weights)
        self.loaded = version

    @torch.no_grad()
    def step(self, optimizer_step: Callable[[], None]) -> None:
        """Keep W(n) as the previous version, then let the optimizer make W(n + 1)."""
        for previous, current in zip(self.previous, self.current, strict=True):
            previous.copy_(current)
        optimizer_step()
        self.version += 1
