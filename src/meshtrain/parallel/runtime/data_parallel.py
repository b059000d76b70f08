"""Data parallelism: gradients averaged over the data-parallel axis in buckets, overlapped
with backward.

Every parameter's `.grad` is a view into one flat buffer per bucket, so a ready bucket is reduced
in place with no packing copy. Buckets are filled in reverse parameter order (roughly the order
backward produces gradients) and closed before they would overflow, so the (tied) word embedding,
whose gradient is complete only at the very end of backward, does not hold back the layers next
to it. When the gradient dtype differs from the parameters' (16-bit parameters, fp32
accumulation) the hook instead adds each fresh gradient into its fp32 view and frees it. Each
bucket launches an asynchronous all-reduce from a post-accumulate-grad
hook as soon as its last gradient of the step has arrived. With gradient accumulation only the
last micro-batch's backward communicates (`sync` is False before it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication import comm


def check_grad_views(params: list[nn.Parameter], buffer: torch.Tensor) -> None:
    """Fail loudly if a gradient that should be a view into `buffer` was replaced (e.g.
    `optimizer.zero_grad()` set it to None and backward made a fresh one): it would silently
    escape the reduction."""
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    for p in params:
        if p.grad is None or not start <= p.grad.data_ptr() < end:
            raise RuntimeError("a parameter's .grad no longer lives in its gradient bucket; zero"
                               " gradients with the reducer's zero_grad(), not"
                               " optimizer.zero_grad() or model.zero_grad()")


def reverse_buckets(params: list[nn.Parameter], bucket_bytes: int,
                    itemsize: int) -> list[list[nn.Parameter]]:
    """Group `params` in reverse order (roughly backward's) into buckets of at most
    `bucket_bytes`, each closed before it would overflow (a single larger parameter gets one of
    its own)."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    current_bytes = 0
    for p in reversed(params):
        nbytes = p.numel() * itemsize
        if current and current_bytes + nbytes > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += nbytes
    return buckets + ([current] if current else [])


class _Bucket:
    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device,
                 *, as_grads: bool):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.pending = len(params)
        self.work: dist.Work | None = None
        self.as_grads = as_grads
        self.views: dict[int, torch.Tensor] = {}
        offset = 0
        for p in params:
            self.views[id(p)] = self.buffer[offset:offset + p.numel()].view_as(p)
            if as_grads:
                p.grad = self.views[id(p)]
            offset += p.numel()

    def check_views(self) -> None:
        if self.as_grads:
            check_grad_views(self.params, self.buffer)


class GradientReducer:
    """Average the gradients of `params` over `axis` (dp, or dp x cp), bucket by bucket.

    `scale` multiplies the averaged gradients (experts: see Trainer). `late` parameters get
    their gradient in several backward passes (`ParameterRoles.reused`): they have buckets of
    their own, reduced in `wait()`. Usage per optimizer step:
    `zero_grad()`; for each micro-batch set `sync = (last micro-batch)` before its backward;
    after the last backward `wait()`. The optimizer must not set grads to None (call
    `reducer.zero_grad()` instead of `optimizer.zero_grad()`).
    """

    def __init__(self, params: list[nn.Parameter], axis: MeshAxis, *,
                 bucket_bytes: int = 25 * 2**20, grad_dtype: torch.dtype = torch.float32,
                 scale: float = 1.0, late: list[nn.Parameter] = ()):
        if bucket_bytes <= 0:
            raise SettingError(Code.RANGE,
                               f"`bucket_mb` must be positive, got {bucket_bytes / 2**20}")
        self.axis = axis
        self.scale = scale
        self.sync = True
        params = [p for p in params if p.requires_grad]
        self.params = params
        as_grads = all(p.dtype == grad_dtype for p in params)
        itemsize = torch.empty((), dtype=grad_dtype).element_size()
        self.late = {id(p) for p in late}
        groups = reverse_buckets([p for p in params if id(p) not in self.late], bucket_bytes,
                                 itemsize)
        groups += reverse_buckets([p for p in params if id(p) in self.late], bucket_bytes,
                                  itemsize)
        self.buckets = [_Bucket(group, grad_dtype, group[0].device, as_grads=as_grads)
                        for group in groups]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        if axis.size > 1 or not as_grads:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def grad(self, param: nn.Parameter) -> torch.Tensor:
        """The (reduced, after `wait()`) gradient of `param` in its bucket."""
        return self._bucket_of[id(param)].views[id(param)]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if not bucket.as_grads:  # accumulate in the bucket's dtype, free the 16-bit gradient
            bucket.views[id(param)].add_(param.grad)
            param.grad = None
        if not self.sync or self.axis.size == 1 or id(param) in self.late:
            return
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.work = comm.all_reduce(bucket.buffer, self.axis, op=dist.ReduceOp.AVG,
                                      async_op=True)

    def wait(self) -> None:
        """Finish every bucket's reduction (launching any bucket backward did not complete,
        e.g. holding a parameter that got no gradient this step)."""
        for bucket in self.buckets:
            bucket.check_views()
        if self.axis.size > 1:
            for bucket in self.buckets:
                if bucket.work is None:
                    self._launch(bucket)
            for bucket in self.buckets:
                bucket.work.wait()
                bucket.work = None
                bucket.pending = len(bucket.params)
        if self.scale != 1.0:
            for bucket in self.buckets:
                bucket.buffer.mul_(self.scale)

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()

    @property
    def num_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)
