"""Trained-set tracking: which tensors the optimizer trains now, and whether that changed.

The trainer guards, snapshots and predicts exactly the tensors that train. Freezing or
unfreezing (``requires_grad_()``, ``add_param_group``) changes that set between steps;
:meth:`TrainedSet.changed` notices it cheaply at the start of each step, and the trainer then
rebuilds everything kept per trained tensor.
"""
from __future__ import annotations

import torch


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


class TrainedSet:
    """The tensors trained now (``params``, of which ``outside_model`` are not the model's) and
    what is watched to notice a change: the optimizer's frozen tensors and its group count."""

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
        self.param_groups = len(self.optimizer.param_groups)

    def changed(self) -> bool:
        """Whether a group was added, a watched tensor unfroze or a trained one froze (per step:
        a length compare and two scans of ``requires_grad``)."""
        return (len(self.optimizer.param_groups) != self.param_groups
                or any(p.requires_grad for p in self.untracked)
                or not all(p.requires_grad for p in self.params))
