"""The same decisions on every rank under ``torch.distributed`` DistributedDataParallel.

Under DDP every rank holds the same weights and, after each backward, the same averaged
gradients, so optimizer steps and predicted deltas (functions of the update history) agree. What
each rank measures for itself differs: the loss of its own shard of data, and its clock. Every
trainer decision (divergence refusal, verification verdict, worth gate, phase length) reads only
those, so the trainer averages them over the ranks before any decision sees them; each rank then
runs the same deterministic decision code on the same numbers and takes the same path. A rank
that took another path would wait in a collective the others never enter (a hang), or apply a
predicted delta the others roll back (weights that silently drift apart).

One input is computed rather than measured and may still differ: the dynamics model's forecast,
on a GPU whose kernels are not bit-reproducible (atomics in its training's backward). Rank 0's
forecast is broadcast, so confidence and forecast scoring read the same numbers everywhere.

Collectives per ``trainer.step``: one all-reduce of one number per real step and per
verification; predicted steps without verification communicate nothing. Once per dynamics
forecast a broadcast of ``3 × horizon`` numbers; once per calibrated timing (a handful per run)
an all-reduce of one number.

The trainer synchronises only when its model is a ``DistributedDataParallel`` (its process group
is used); an unwrapped model on an initialised process group is trained as an independent run.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class RankSync:
    """Collectives the trainer needs, over the process group of a DDP ``model``.

    On a single process (or a model that is not DDP-wrapped) every method returns its input and
    communicates nothing, so the trainer calls them unconditionally.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | str = "cpu"):
        """``device``: where the model's parameters live (this rank's GPU under NCCL)."""
        self.ddp = isinstance(model, DistributedDataParallel)
        self.group = model.process_group if self.ddp else None
        self.world_size = dist.get_world_size(self.group) if self.ddp else 1
        self.rank = dist.get_rank(self.group) if self.ddp else 0
        self.active = self.world_size > 1
        # NCCL only moves tensors on the rank's own GPU; gloo and the others take CPU tensors.
        nccl = self.ddp and dist.get_backend(self.group) == "nccl"
        self.device = torch.device(device) if nccl else torch.device("cpu")

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes shared files (metrics, checkpoints): rank 0 of the group."""
        return self.rank == 0

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of ``value`` (any shape, float) over the ranks, identical on every rank; non-finite
        on every rank if it is on any. A new tensor on ``value``'s device and dtype (on a single
        process ``value`` itself)."""
        return self.start_mean(value).wait()

    def start_mean(self, value: torch.Tensor) -> PendingMean:
        """:meth:`mean`, launched now and read with ``.wait()``: work done in between (a backward)
        overlaps the all-reduce, which otherwise adds a round trip between ranks to every step."""
        if not self.active:
            return PendingMean(value)
        total = value.detach().to(self.device, torch.float64, copy=True)
        # A sum, not ReduceOp.AVG, which gloo does not implement; the division is the same
        # float operation on every rank.
        work = dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return PendingMean(value, work, total, self.world_size)

    def mean_float(self, value: float) -> float:
        """:meth:`mean` of one Python float (NaN and inf pass through)."""
        if not self.active:
            return value
        return float(self.mean(torch.tensor(value, dtype=torch.float64)))

    def from_rank0(self, value: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``value`` (same shape and dtype on every rank) on every rank."""
        if not self.active:
            return value
        shared = value.detach().to(self.device, copy=True)
        dist.broadcast(shared, src=dist.get_global_rank(self.group, 0), group=self.group)
        return shared.to(value.device)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        if not self.active:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        with self._own_device():
            dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def barrier(self) -> None:
        if self.active:
            with self._own_device():
                dist.barrier(group=self.group)

    def _own_device(self):
        """This rank's GPU made current: NCCL's object collectives and barrier put their tensors
        on the current CUDA device, which stays cuda:0 on every rank unless the user called
        ``torch.cuda.set_device`` (moving the model with ``.to(f"cuda:{rank}")`` does not)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    def check_same(self, name: str, value: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the keys of ``value`` that differ between ranks: a trainer
        configured differently on one rank would take other paths and hang in a collective."""
        if not self.active:
            return
        differing = set()
        for other in self.gather(value):
            differing |= {key for key in set(value) | set(other) if not _same(value.get(key), other.get(key))}
        if differing:
            raise ValueError(f"{name} differs between ranks in {sorted(differing)}: every rank must "
                             f"construct the trainer with the same {name}")

    def micro_batch_context(self, model: torch.nn.Module, last: bool):
        """``model.no_sync()`` for every micro-batch but the last: DDP then all-reduces the
        accumulated gradients once per step instead of once per micro-batch."""
        return model.no_sync() if self.ddp and not last else nullcontext()


class PendingMean:
    """An all-reduced mean in flight (or, on a single process, ``value`` itself)."""

    def __init__(self, value: torch.Tensor, work=None, total: torch.Tensor | None = None, world_size: int = 1):
        self.value, self.work, self.total, self.world_size = value, work, total, world_size

    def wait(self) -> torch.Tensor:
        if self.work is None:
            return self.value
        self.work.wait()
        return (self.total / self.world_size).to(self.value.device, self.value.dtype)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module a DDP wrapper holds (``model`` itself otherwise)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
