"""Trained-set tracking: which tensors the optimizer trains now, and whether that changed.

The trainer guards, snapshots and predicts exactly the tensors that train. Freezing or
unfreezing (``requires_grad_()``, ``add_param_group``) changes that set between steps;
:meth:`TrainedSet.changed` notices it cheaply at the start of each step, and
:func:`follow_trainable_change` then rebuilds everything the trainer keeps per trained tensor
(:func:`retarget_trainer`).
"""
from __future__ import annotations

from operator import attrgetter, itemgetter

import torch

from .anchor import buffer_slots
from .averaging import WeightAverage
from .distributed import unwrap
from .offload import StateOffloader
from .phases import Phase
from .setup_checks import check_predictable


def trained_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(params, outside)``: every tensor ``optimizer`` trains now, ``model``'s parameters
    first in model order, and those of them outside the model. All of them are guarded,
    snapshotted and predicted: a trained tensor outside the model (a learned loss weight or
    temperature) would otherwise take a NaN update and keep it through a rollback. Those
    outside are in no model ``state_dict``, so the checkpoint holds their values itself."""
    optimized = [p for group in optimizer.param_groups for p in group["params"]]
    ids, in_model = {id(p) for p in optimized}, {id(p) for p in model.parameters()}
    params = [p for p in model.parameters() if p.requires_grad and id(p) in ids]
    outside = [p for p in optimized if p.requires_grad and id(p) not in in_model]
    return params + outside, outside


_PARAMS_OF = itemgetter("params")
_REQUIRES_GRAD = attrgetter("requires_grad")


class TrainedSet:
    """The tensors trained now (``params``, of which ``outside_model`` are not the model's) and
    what is watched to notice a change: the optimizer's frozen tensors and the sizes of its
    param groups (a group added, or a tensor appended to one: ``group["params"].append(p)``,
    which users do and which adds no group)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.track(*trained_tensors(model, optimizer))

    def current(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(params, outside)`` as the optimizer trains them now (see :func:`trained_tensors`)."""
        return trained_tensors(self.model, self.optimizer)

    def track(self, params: list[torch.Tensor], outside: list[torch.Tensor]) -> None:
        """Make ``params`` the trained set and watch the rest of the optimizer's tensors."""
        self.params, self.outside_model = params, outside
        tracked = {id(p) for p in params}
        self.untracked = [p for group in self.optimizer.param_groups for p in group["params"]
                          if id(p) not in tracked]  # frozen now: watched for unfreezing
        self.group_sizes = self._group_sizes()

    def _group_sizes(self) -> list[int]:
        return list(map(len, map(_PARAMS_OF, self.optimizer.param_groups)))

    def changed(self) -> bool:
        """Whether a group was added or grew, a watched tensor unfroze or a trained one froze (per
        step: one length per group and two scans of ``requires_grad``). The scans are ``map``s
        over an attribute getter, which iterate in C: a generator expression runs a Python frame
        step per tensor, and this runs before every step."""
        return (self._group_sizes() != self.group_sizes
                or any(map(_REQUIRES_GRAD, self.untracked))
                or not all(map(_REQUIRES_GRAD, self.params)))


# The trainer's side of a change of the trained set: everything it keeps per trained tensor. Kept
# here, beside what notices the change, so the trainer's loop only calls it.
def retarget_trainer(trainer, params: list[torch.Tensor], outside: list[torch.Tensor]) -> None:
    """(Re)build everything ``trainer`` (a :class:`~hybrid_trainer.HybridTrainer`) keeps per trained
    tensor: the prediction buffers, the good state, the weight average (carried over, see
    :meth:`WeightAverage.retarget`) and the offloader's extra tensors."""
    cfg = trainer.config
    trainer.trained.track(params, outside)
    buffers = buffer_slots(unwrap(trainer.model))  # e.g. batch-norm statistics: forwards change them too
    trainer.predict_phase.retarget(params, buffers)
    trainer.guard.retarget(params, buffers, unwrap(trainer.model))
    if cfg.weight_average:
        trainer.weight_average = (WeightAverage(params) if trainer.weight_average is None
                                  else trainer.weight_average.retarget(params))
    # The int8 update history ("linear" direction) is not read while predicting either.
    trainer.offloader = (StateOffloader(trainer.optimizer, extra=trainer.predictor.history_tensors)
                         if cfg.offload_while_predicting else None)


def follow_trainable_change(trainer) -> None:
    """Follow a change of which tensors train (``requires_grad_()``, ``add_param_group``:
    gradual unfreezing, or freezing), before it reaches any weight: the NaN guard, both
    snapshots and predicted steps must cover exactly what trains, or an unfrozen layer would
    take a NaN update unchecked and keep its update through a rollback, and a frozen one would
    go on moving with predicted steps. The update history restarts (a FULL phase follows);
    the weight average carries over."""
    if trainer.ranks.active:
        raise ValueError("optimizer: the tensors that train changed under DistributedDataParallel, which "
                         "fixes the parameters whose gradients it averages when it is constructed; wrap "
                         "the model again after freezing or unfreezing, and construct a new HybridTrainer")
    params, outside = trainer.trained.current()
    if not params:
        raise ValueError("optimizer: no tensor trains any more (every parameter frozen)")
    check_predictable(trainer.config, trainer.model, params)
    before, old_phase, undone = trainer.params, trainer.controller.phase, 0
    if old_phase is Phase.PREDICT:
        undone = trainer.predict_phase.abort()  # predicted for the old set: only verified steps stay
        trainer.stats.predicted_steps_rolled_back += undone
    trainer._state_home()
    retarget_trainer(trainer, params, outside)
    trainer.worth.forget()  # measured along the old direction
    trainer.controller.force_full()
    trainer.stats.trained_set_changes += 1
    trainer.events.trained_set_changed(trainer.step_count, before, params, undone, old_phase, trainer.controller)
