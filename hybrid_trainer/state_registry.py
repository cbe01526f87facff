"""A registry of the trainer's stateful components, from which its checkpoint is made.

Each component registers once under a key with how to read and restore its state; the
checkpoint is every key's state, restored in registration order. A component that may be
absent (a scheduler, a GradScaler, the cost calibration, the weight average) is registered
through a getter returning None when it is: its state is saved as None, and restoring skips it
when either side has none (or calls ``on_missing`` when the run has one and the checkpoint not).
Getters, not objects: components rebuilt when the trained set changes (predictor, snapshots)
are looked up at save and load time.

Also here: the layout upgrade of older checkpoints (:func:`upgrade_v1`), the key fix of a
DDP-wrapped model's weights and which random streams a rank resumes with.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

CHECKPOINT_VERSION = 2  # 2: the worth gate, forecast and predict phase under keys of their own


@dataclass(frozen=True)
class _Entry:
    save: Callable[[], Any]
    load: Callable[[Any], None]


class StateRegistry:
    """Ordered ``key -> (save, load)``; :meth:`state_dict` and :meth:`load_state_dict` walk it."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def register(self, key: str, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """State under ``key``: ``save()`` reads it, ``load(value)`` restores it."""
        if key in self._entries:
            raise ValueError(f"key: {key!r} is registered already")
        self._entries[key] = _Entry(save, load)

    def register_component(self, key: str, component: Callable[[], Any], *, full: bool = False,
                           on_missing: Callable[[], None] | None = None) -> None:
        """``component()`` (or None when absent) saved with its ``state_dict()`` (``full``:
        ``full_state_dict()``) and restored with the matching loader."""
        save_name, load_name = ("full_state_dict", "load_full_state_dict") if full else \
            ("state_dict", "load_state_dict")

        def save() -> Any:
            obj = component()
            return None if obj is None else getattr(obj, save_name)()

        def load(value: Any) -> None:
            obj = component()
            if obj is None:
                return
            if value is None:
                if on_missing is not None:
                    on_missing()
                return
            getattr(obj, load_name)(value)

        self.register(key, save, load)

    def keys(self) -> list[str]:
        return list(self._entries)

    def state_dict(self) -> dict[str, Any]:
        return {key: entry.save() for key, entry in self._entries.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every registered key, in registration order; a key the checkpoint lacks is
        an error naming it (optional components are saved as None, never left out)."""
        missing = [key for key in self._entries if key not in state]
        if missing:
            raise ValueError(f"checkpoint: no state for {missing}")
        for key, entry in self._entries.items():
            entry.load(state[key])


def without_ddp_prefix(weights: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """``weights`` keyed as ``module`` expects: checkpoints written before the trainer saved the
    unwrapped module's keys hold a DDP wrapper's (``module.`` before every key)."""
    prefix = "module."
    if weights and all(k.startswith(prefix) for k in weights) and \
            not any(k.startswith(prefix) for k in module.state_dict()):
        return {k[len(prefix):]: v for k, v in weights.items()}
    return weights


def upgrade_v1(state: dict[str, Any]) -> dict[str, Any]:
    """A version-1 checkpoint in the version-2 layout (v1 kept the worth, forecast and predict
    phase state in its ``trainer`` entry, and older files may lack optional entries)."""
    state = dict(state)
    loop = dict(state["trainer"])
    state["forecast"] = loop.pop("forecast")
    state["worth"] = {"predicted_worth": loop.pop("predicted_worth"), "predicted_gain": loop.pop("predicted_gain")}
    state["predict_phase"] = {k: loop.pop(k) for k in ("predict_base_loss", "last_verified_loss",
                                                       "last_verified_single_batch", "unverified_steps")}
    state["trainer"] = loop
    for key, default in (("outside_model", []), ("cost", None), ("weight_average", None)):
        state.setdefault(key, default)
    state["version"] = CHECKPOINT_VERSION
    return state


def rng_of_rank(state: dict[str, Any], ranks) -> dict:
    """This rank's random streams from a checkpoint (``ranks``: the trainer's
    :class:`~hybrid_trainer.distributed.RankSync`): written under DDP it holds every rank's
    (``rng_by_rank``); otherwise the one process's."""
    by_rank = state.get("rng_by_rank")
    if by_rank is None:
        if ranks.active:
            warnings.warn(f"checkpoint written by one process, resumed on {ranks.world_size} ranks: every "
                          "rank takes its random streams, so the ranks draw the same dropout masks",
                          stacklevel=3)
        return state["rng"]
    if len(by_rank) != ranks.world_size:
        warnings.warn(f"checkpoint written by {len(by_rank)} ranks, resumed on {ranks.world_size}: "
                      "every rank takes rank 0's random streams, so data order and dropout will not "
                      "repeat the saved run's", stacklevel=3)
        return by_rank[0]
    return by_rank[ranks.rank]
