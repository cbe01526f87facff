"""Several optimizers over disjoint parameters, stepped as one ``torch.optim.Optimizer``.

Some optimizers take only part of a model: ``torch.optim.Muon`` updates 2-D weight matrices and
refuses embeddings, biases and norms, which a second optimizer (AdamW) trains. The trainer,
its rollback anchors, checkpoints and LR schedulers all speak to one optimizer, so this class
presents the parts as one::

    hidden = [m.weight for m in model.blocks.modules() if isinstance(m, nn.Linear)]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    optimizer = CombinedOptimizer(torch.optim.Muon(hidden, lr=0.02),
                                  torch.optim.AdamW(rest, lr=2e-3))

``param_groups`` is the parts' own group dicts, in order, read afresh at each access (so a
scheduler's or the user's ``lr`` edit reaches the part, and a group added to a part with its
``add_param_group`` is followed), and ``state`` reads and writes each parameter's state in the
part that owns it.
"""
from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch


class _StateByOwner(MutableMapping):
    """``optimizer.state`` of the combination: each parameter's entry lives in its owner's state."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self._parts = parts
        self._owner = owners(parts)

    def _owner_of(self, param: object) -> torch.optim.Optimizer | None:
        part = self._owner.get(param)  # type: ignore[call-overload]
        if part is None:  # a group added to a part since the map was built
            self._owner = owners(self._parts)
            part = self._owner.get(param)  # type: ignore[call-overload]
        return part

    def _part(self, param: torch.Tensor) -> torch.optim.Optimizer:
        part = self._owner_of(param)
        if part is None:
            raise KeyError("the tensor is not a parameter of any of the combined optimizers")
        return part

    def __getitem__(self, param: torch.Tensor) -> Any:
        return self._part(param).state[param]  # a part's defaultdict creates the entry, as torch's would

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        self._part(param).state[param] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._part(param).state[param]

    def __contains__(self, param: object) -> bool:
        part = self._owner_of(param)
        return part is not None and param in part.state

    def get(self, param: Any, default: Any = None) -> Any:
        # Mapping.get goes through __getitem__, which would create an empty entry in the part.
        return self[param] if param in self else default

    def __iter__(self) -> Iterator[torch.Tensor]:
        for part in self._parts:
            yield from part.state

    def __len__(self) -> int:
        return sum(len(part.state) for part in self._parts)


def owners(parts: list[torch.optim.Optimizer]) -> dict[torch.Tensor, torch.optim.Optimizer]:
    """Each parameter of ``parts`` mapped to the part that trains it."""
    return {param: part for part in parts for group in part.param_groups for param in group["params"]}


class CombinedOptimizer(torch.optim.Optimizer):
    """``optimizers`` (each a ``torch.optim.Optimizer``, over disjoint parameters) as one.

    ``step`` steps every part in order; ``zero_grad`` clears every parameter; ``state_dict`` is
    ``{"parts": [part.state_dict(), ...]}`` and ``load_state_dict`` takes one from a combination
    of the same parts.
    """

    def __init__(self, *optimizers: torch.optim.Optimizer):
        if not optimizers:
            raise ValueError("optimizers: give at least one torch.optim.Optimizer")
        owner: dict[torch.Tensor, torch.optim.Optimizer] = {}
        for index, part in enumerate(optimizers):
            if not isinstance(part, torch.optim.Optimizer):
                raise TypeError(f"optimizers[{index}]: expected a torch.optim.Optimizer, got {type(part).__name__}")
            for group in part.param_groups:
                for param in group["params"]:
                    if param in owner:
                        raise ValueError(f"optimizers[{index}]: a parameter of shape {tuple(param.shape)} is also "
                                         f"trained by optimizers[{optimizers.index(owner[param])}]; the parts must "
                                         "train disjoint parameters")
                    owner[param] = part
        # The base constructor sets up hooks and the profiler's step wrapper; its copies of the
        # groups (set aside by the param_groups setter) and its own state are not used: the parts'
        # hold the truth.
        super().__init__(list(owner), {})
        self.parts = list(optimizers)
        self.state = _StateByOwner(self.parts)  # type: ignore[assignment]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        if "parts" not in self.__dict__:  # inside the base constructor
            return self.__dict__["_construction_groups"]
        return [group for part in self.parts for group in part.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        if "parts" in self.__dict__:
            raise AttributeError("param_groups of a CombinedOptimizer are its parts'; set them on a part")
        self.__dict__["_construction_groups"] = groups  # the base constructor's copies, unused

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "parts" not in self.__dict__:  # the base constructor's own groups
            return super().add_param_group(param_group)
        raise TypeError("add_param_group: a CombinedOptimizer does not know which part should train the "
                        "new parameters; call add_param_group on that part (the combination follows it)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = state_dict.get("parts") if isinstance(state_dict, dict) else None
        if not isinstance(parts, list) or len(parts) != len(self.parts):
            found = "no 'parts' list" if not isinstance(parts, list) else f"{len(parts)} parts"
            raise ValueError(f"state_dict: expected the state of a CombinedOptimizer with {len(self.parts)} "
                             f"parts, got {found}")
        for part, state in zip(self.parts, parts):
            part.load_state_dict(state)

    def __repr__(self) -> str:
        inner = ",\n".join("    " + repr(part).replace("\n", "\n    ") for part in self.parts)
        return f"{type(self).__name__}(\n{inner}\n)"
