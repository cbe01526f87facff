"""Construction-time checks of what a :class:`~hybrid_trainer.HybridTrainer` is given.

Each check raises a ``TypeError``/``ValueError`` naming the argument at fault, before anything
trains, for what would otherwise fail later and less clearly (inside the optimizer step, the
NaN guard's norm, or the predicted-step kernel).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from hybrid_kernels.int8_quant import FLOAT_DTYPES

from .config import HybridConfig
from .distributed import unwrap


def check_arguments(model: Any, optimizer: Any, loss_fn: Any, config: Any) -> HybridConfig:
    """Types of the trainer's arguments; returns the validated config (defaults if None)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:  # LBFGS
        raise TypeError(f"optimizer: {type(optimizer).__name__}.step needs a closure (it re-evaluates the "
                        f"loss itself), and the trainer steps after its own backward; use a first-order "
                        f"optimizer such as Adam")
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")
    config = HybridConfig() if config is None else config
    if not isinstance(config, HybridConfig):
        raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
    config.validate()
    return config


def check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """The trainer calls ``scheduler.step()`` with no argument after each real optimizer step."""
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError("scheduler: ReduceLROnPlateau steps on a metric (usually a validation loss) and "
                        "the trainer steps its scheduler with none; leave it out and call "
                        "scheduler.step(val_loss) yourself, the trainer's optimizer takes the new lr")
    if not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"scheduler must have a step() method (an LR scheduler), got {type(scheduler).__name__}")
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("scheduler: built over another optimizer than the trainer's, so stepping it "
                         "would leave the trainer's learning rate unchanged")


def check_dense(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Sparse gradients have no norm the guard can take (torch has no sparse vector norm)
    and no dense update the predictor can record."""
    for name, module in unwrap(model).named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse \
                and module.weight.requires_grad:
            raise ValueError(f"model: {type(module).__name__} {name!r} has sparse=True, and the trainer "
                             f"needs dense gradients (its NaN guard takes their norm); use sparse=False "
                             f"with a dense optimizer (e.g. Adam instead of SparseAdam)")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError("optimizer: SparseAdam takes sparse gradients only, and the trainer needs dense "
                         "ones; use Adam or AdamW")


def check_predictable(config: HybridConfig, model: torch.nn.Module, params: list[torch.Tensor]) -> None:
    """Checked when a tensor starts training: the first predicted step comes many steps
    later, inside the kernel."""
    wide = next((p for p in params if p.dtype not in FLOAT_DTYPES), None) if config.predict else None
    if wide is not None:
        name = next((repr(n) for n, p in unwrap(model).named_parameters() if p is wide), "outside the model")
        raise TypeError(f"model: parameter {name} is {wide.dtype}, and predicted steps "
                        f"update float32, float16 or bfloat16 weights; train it with "
                        f"HybridConfig(predict=False) (the safety layer alone) or in float32")


def check_ddp_trains_only_its_module(ranks: Any, outside_model: list[torch.Tensor]) -> None:
    """DDP averages the gradients of its module's parameters only: a trained tensor outside it
    would take a different update on each rank, and with it a different gradient norm and verdict."""
    if ranks.active and outside_model:
        raise ValueError(f"optimizer: trains {len(outside_model)} tensor(s) outside the "
                         f"DistributedDataParallel model, whose gradients DDP does not average across "
                         f"ranks; make them parameters of the wrapped module")


def check_train_mode(optimizer: torch.optim.Optimizer) -> None:
    """A schedule-free optimizer (``schedulefree``'s) holds the weights at its averaged point
    after ``optimizer.eval()``: a step, real or predicted, would move that point instead of the
    one its gradients belong at. Its own ``step()`` refuses only after the forward, backward
    and guard of the step have run; this refuses before anything runs."""
    # Every group: a CombinedOptimizer may hold the schedule-free part second.
    if not all(group.get("train_mode", True) for group in optimizer.param_groups):
        raise RuntimeError(f"optimizer: {type(optimizer).__name__} is in eval mode (optimizer.eval() was "
                           "called, so the weights are its averaged ones); call optimizer.train() before "
                           "trainer.step()")
