"""Pipeline parallelism: which layers a stage holds, and the executor that runs a schedule.

The executor runs one rank's action list (`parallel/schedules/`) on its model chunks (one, or v
under the interleaved schedule: rank s holds global chunks s, s + p, ...): forwards take token
ids (first global chunk) or the activation received from the previous global chunk; backwards
take the loss (last global chunk) or the gradient received from the next one. The previous
chunk lives on rank s - 1, or on rank p - 1 for rank 0's later chunks (the wrap-around), and the
next on rank s + 1, or rank 0. Sends are asynchronous; each is waited, and its tensor freed, as
soon as this rank has received something its receiver sent after taking it
(`schedules/releases.py`), else at the end of the step (under 2BW, one step later), so a rank
holds a number of boundary tensors set by the schedule and pp, not by the micro-batches.
Receives block just before the compute that needs them, and waiting a send already taken
blocks on nothing, so any schedule the simulator accepts runs without deadlock. Shapes are
known ahead (`[micro, s, h]`), so no handshake precedes a transfer. Under zb-v
(`actions.v_shape_chunk`) the previous and next chunk's rank follow the V, and the boundary in
the V's turn, inside rank p - 1, is handed over in memory.

The split backward (zb-h1, zb-v): `I` runs the chunk's backward for its input gradient only,
while the layers queue their weight-gradient work (`layers/weight_grads.py`); parameters of
other layers (norms, biases, the router) get their gradients computed then but kept aside.
`W` runs the queue and accumulates everything through autograd, so data-parallel and ZeRO-1
reductions fire after a parameter's last `W`, as they do after a fused backward. The first
global chunk sends no input gradient: its `I` does nothing and its `W` is the fused backward.

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
from meshtrain.parallel.layers.weight_grads import WeightGradients, accumulate_deferred
from meshtrain.parallel.schedules.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    OPTIMIZER_STEP,
    RECV_ACTIVATION,
    RECV_GRAD,
    SEND_ACTIVATION,
    SEND_GRAD,
    WEIGHT_GRAD,
    Action,
    Placement,
    model_chunk,
)
from meshtrain.parallel.schedules.pipedream import pipedream_2bw
from meshtrain.parallel.schedules.releases import Releases, send_releases


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
    peak_boundary_tensors: int = 0  # most distinct tensors held among forward outputs, sends
    # not yet waited and received gradients not yet consumed (what grew with the micro-batches)


@dataclass
class InFlight:
    """What the executor holds between actions: micro-batches forwarded and not yet backwarded
    (keyed by (micro, local chunk)) and sends not yet waited. A schedule that does not flush
    (PipeDream-2BW) carries it from one optimizer step to the next."""

    inputs: dict = field(default_factory=dict)  # received activations
    handed: dict = field(default_factory=dict)  # transfers inside this rank, by tag
    outputs: dict = field(default_factory=dict)  # forward outputs (losses on the last chunk)
    grads: dict = field(default_factory=dict)  # received gradients
    extra: dict = field(default_factory=dict)  # the chunk's own extra loss per forward
    saved: dict = field(default_factory=dict)  # bytes autograd holds per in-flight chunk
    sends: dict = field(default_factory=dict)  # send action -> (work, tensor), until waited
    weight_work: dict = field(default_factory=dict)  # split backward: what each W runs

    def wait_sends(self, which=None) -> None:
        """Wait the sends `which` (send actions; default all) still pending, freeing them."""
        for action in list(self.sends) if which is None else which:
            if action in self.sends:
                self.sends.pop(action)[0].wait()

    def boundary_tensors(self) -> int:
        """Distinct storages among held forward outputs (not losses), pending sends and
        received gradients."""
        held = [t for t in self.outputs.values() if t.dim() > 0] + list(self.grads.values()) \
            + [t for _, t in self.sends.values()]
        return len({t.untyped_storage().data_ptr() for t in held})


def run_schedule(actions: list[Action], *, stage: Callable, loss_fn: Callable,
                 micro_batches, mesh: ParallelMesh, activation_shape: tuple[int, ...],
                 dtype: torch.dtype, num_chunks: int = 1, num_micro_batches: int | None = None,
                 before_backward: Callable[[int], None] = lambda micro: None,
                 use_weights_of: Callable[[int], None] = lambda micro: None,
                 loss_scale: float = 1.0, count_saved_of=None,
                 carry: InFlight | None = None, timeline: list | None = None,
                 placement: Placement = model_chunk,
                 weight_grads: WeightGradients | None = None, params=(),
                 releases: Releases | None = None) -> ScheduleRun:
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
    `releases` (`releases.send_releases` of every rank's list, this rank's): after which
    action each send is waited; without them every send waits for the end.
    `carry`: state kept across calls; a send its `releases` do not free is waited one call
    later (its receiver may post it only after the optimizer step), and `carry.wait_sends()`
    drains the last ones.
    `timeline`, when given, gets one (kind, micro, chunk, start, end) per action, in
    `time.perf_counter()` seconds (see `pipeline_trace.py`).
    `placement` maps local chunks to global ones (`actions.v_shape_chunk` for zb-v); a list
    with `I` and `W` actions needs the layers' `weight_grads` and the stage's `params`.
    """
    state = carry or InFlight()
    earlier_sends = list(state.sends)
    runner = _Runner(stage=stage, loss_fn=loss_fn, micro_batches=micro_batches, mesh=mesh,
                     activation_shape=activation_shape, dtype=dtype, num_chunks=num_chunks,
                     m=num_micro_batches or len(micro_batches),
                     before_backward=before_backward, use_weights_of=use_weights_of,
                     loss_scale=loss_scale, count_saved_of=count_saved_of, state=state,
                     placement=placement, weight_grads=weight_grads, params=list(params))
    for index, a in enumerate(actions):
        runner.receive_ahead(actions, index)
        start = time.perf_counter()
        runner.run(a)
        if timeline is not None:
            timeline.append((a.kind, a.micro, a.chunk, start, time.perf_counter()))
        runner.held(releases.get(index, ()) if releases else ())
    state.wait_sends(earlier_sends)
    if carry is None:
        state.wait_sends()
    return runner.result


class _Runner:
    """What each kind of action does on this rank (see `run_schedule`)."""

    def __init__(self, *, stage, loss_fn, micro_batches, mesh: ParallelMesh,
                 activation_shape, dtype, num_chunks: int, m: int, before_backward,
                 use_weights_of, loss_scale: float, count_saved_of, state: InFlight,
                 placement: Placement, weight_grads: WeightGradients | None, params: list):
        self.stage, self.loss_fn, self.micro_batches = stage, loss_fn, micro_batches
        self.mesh, self.activation_shape, self.dtype = mesh, activation_shape, dtype
        self.axis, self.grad_axis = mesh.pp, mesh.axis("pp_grad")
        p = mesh.pp.size
        self.placement, self.weight_grads, self.params = placement, weight_grads, params
        self.owner = {placement(r, c, p): r for r in range(p) for c in range(num_chunks)}
        self.last = p * num_chunks - 1
        self.m, self.loss_scale, self.count_saved_of = m, loss_scale, count_saved_of
        self.before_backward, self.use_weights_of = before_backward, use_weights_of
        self.state = state
        self.result = ScheduleRun([], 0, 0)
        # gloo only: NCCL runs a communicator's point-to-point calls in order on one stream,
        # where a receive posted early would hold up this rank's own sends behind it.
        self.ahead = {RECV_ACTIVATION: 0, RECV_GRAD: 0} if mesh.device.type == "cpu" else {}
        self.posted: dict[tuple[str, int], tuple] = {}  # (kind, tag) -> (work, buffer)
        # Evaluation's activations get their own tags: 2BW training sends may still be in
        # flight.
        self.forward_tag = 0 if torch.is_grad_enabled() else 2
        self.handlers = {RECV_ACTIVATION: self.recv_activation, FORWARD: self.forward,
                         SEND_ACTIVATION: self.send_activation, RECV_GRAD: self.recv_grad,
                         BACKWARD: self.backward, SEND_GRAD: self.send_grad,
                         INPUT_GRAD: self.input_grad, WEIGHT_GRAD: self.weight_grad,
                         OPTIMIZER_STEP: lambda i, g, key: None}

    def run(self, a: Action) -> None:
        g = self.placement(self.mesh.pp.rank, a.chunk, self.mesh.pp.size)
        self.handlers[a.kind](a.micro, g, (a.micro, a.chunk))

    def held(self, released) -> None:
        """After an action: wait the sends it `released`, then count what is held."""
        self.state.wait_sends(released)
        self.result.peak_boundary_tensors = max(self.result.peak_boundary_tensors,
                                                self.state.boundary_tensors())

    def tag(self, i: int, boundary: int, kind: int) -> int:
        """Boundary b lies between global chunks b and b + 1: one tag per (micro, boundary,
        kind: 0 activation, 1 gradient, 2 evaluation activation)."""
        return 3 * (i * (self.last + 1) + boundary) + kind

    def _source(self, a: Action) -> tuple:
        """Where a receive action's tensor comes from: (axis, global chunk, tag)."""
        g = self.placement(self.mesh.pp.rank, a.chunk, self.mesh.pp.size)
        if a.kind == RECV_ACTIVATION:
            return self.axis, g - 1, self.tag(a.micro, g - 1, self.forward_tag)
        return self.grad_axis, g + 1, self.tag(a.micro, g, 1)

    def receive_ahead(self, actions: list[Action], index: int) -> None:
        """Post the next receive of each kind from another rank before action `index` runs
        (one outstanding per kind), so its transfer proceeds while this rank computes instead
        of starting when the receive is reached."""
        for kind, cursor in self.ahead.items():
            if any(posted == kind for posted, _ in self.posted):
                continue
            cursor = max(cursor, index)
            while cursor < len(actions) and not (
                    actions[cursor].kind == kind
                    and self.owner[self._source(actions[cursor])[1]] != self.mesh.pp.rank):
                cursor += 1
            self.ahead[kind] = cursor + 1
            if cursor < len(actions):
                axis, from_chunk, tag = self._source(actions[cursor])
                buffer = self._buffer()
                self.posted[kind, tag] = (comm.recv(buffer, axis, self.owner[from_chunk],
                                                    tag=tag, async_op=True), buffer)

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.activation_shape, dtype=self.dtype, device=self.mesh.device)

    def _send(self, a: Action, tensor: torch.Tensor, axis, to_chunk: int, tag: int) -> None:
        """To the rank holding global chunk `to_chunk`, or in memory when that is this one."""
        if self.owner[to_chunk] == self.mesh.pp.rank:
            self.state.handed[tag] = tensor
        else:
            self.state.sends[a] = (
                comm.send(tensor, axis, self.owner[to_chunk], tag=tag), tensor)

    def _recv(self, kind: str, axis, from_chunk: int, tag: int) -> torch.Tensor:
        if self.owner[from_chunk] == self.mesh.pp.rank:
            return self.state.handed.pop(tag)
        if (kind, tag) in self.posted:
            work, buffer = self.posted.pop((kind, tag))
            work.wait()
            return buffer
        buffer = self._buffer()
        comm.recv(buffer, axis, self.owner[from_chunk], tag=tag)
        return buffer

    def recv_activation(self, i: int, g: int, key: tuple[int, int]) -> None:
        received = self._recv(RECV_ACTIVATION, self.axis, g - 1,
                              self.tag(i, g - 1, self.forward_tag))
        self.state.inputs[key] = received.requires_grad_(torch.is_grad_enabled())

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
        self._send(Action(SEND_ACTIVATION, i, key[1]), tensor, self.axis, g + 1,
                   self.tag(i, g, self.forward_tag))

    def recv_grad(self, i: int, g: int, key: tuple[int, int]) -> None:
        self.state.grads[key] = self._recv(RECV_GRAD, self.grad_axis, g + 1, self.tag(i, g, 1))

    def _roots(self, g: int, key: tuple[int, int]) -> tuple[list, list]:
        """What a chunk's backward starts from: the loss (last chunk) or the output with the
        received gradient, and the chunk's own extra loss."""
        state, m, scale = self.state, self.m, self.loss_scale
        own = state.extra.pop(key)
        if g == self.last:
            return [(state.outputs.pop(key) + own / m) * scale], [None]
        if isinstance(own, torch.Tensor):
            return [state.outputs.pop(key), own * (scale / m)], [state.grads.pop(key), None]
        return [state.outputs.pop(key)], [state.grads.pop(key)]

    def backward(self, i: int, g: int, key: tuple[int, int]) -> None:
        self.use_weights_of(i)
        self.before_backward(i)
        torch.autograd.backward(*self._roots(g, key))
        del self.state.saved[key]

    def input_grad(self, i: int, g: int, key: tuple[int, int]) -> None:
        """The input gradient only; what the weights need waits for this chunk's `W`."""
        if g == 0:  # nothing to send: the W runs the whole backward
            self.state.weight_work[key] = None
            return
        x = self.state.inputs[key]
        roots, root_grads = self._roots(g, key)
        with self.weight_grads.deferred() as queued:
            grads = torch.autograd.grad(roots, [x, *self.params], root_grads, allow_unused=True)
        x.grad = grads[0]
        kept = [(p, grad) for p, grad in zip(self.params, grads[1:], strict=True)
                if grad is not None]
        self.state.weight_work[key] = (queued, kept)

    def weight_grad(self, i: int, g: int, key: tuple[int, int]) -> None:
        self.before_backward(i)
        work = self.state.weight_work.pop(key)
        if work is None:
            torch.autograd.backward(*self._roots(g, key))
        else:
            queued, kept = work
            accumulate_deferred(kept, queued)
        del self.state.saved[key]

    def send_grad(self, i: int, g: int, key: tuple[int, int]) -> None:
        tensor = self.state.inputs.pop(key).grad
        self._send(Action(SEND_GRAD, i, key[1]), tensor, self.grad_axis, g - 1,
                   self.tag(i, g - 1, 1))


class PipeDream2BW:
    """One rank's PipeDream-2BW state across optimizer steps.

    The action list of the whole run (`pipedream.pipedream_2bw`) is cut after each optimizer
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
        lists = pipedream_2bw(p, m, num_steps)
        released = send_releases(lists)[s]
        self.segments: list[list[Action]] = [[]]
        self.released: list[Releases] = [{}]  # by segment, at indices into it
        for k, a in enumerate(lists[s]):
            if k in released:
                self.released[-1][len(self.segments[-1])] = released[k]
            self.segments[-1].append(a)
            if a.kind == OPTIMIZER_STEP:
                self.segments.append([])
                self.released.append({})
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

    def releases(self, step: int) -> Releases:
        """Where the segment of `step` waits its sends (over the whole run's lists)."""
        return self.released[step - self.first_step]

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
