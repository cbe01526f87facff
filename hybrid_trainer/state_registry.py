"""A registry of the trainer's stateful components, from which its checkpoint is made.

Each component registers once under a key with how to read and restore its state; the
checkpoint is every key's state, restored in registration order. A component that may be
absent (a scheduler, a GradScaler, the cost calibration, the weight average) is registered
through a getter returning None when it is: its state is saved as None, and restoring skips it
when either side has none (or calls ``on_missing`` when the run has one and the checkpoint not).
Getters, not objects: components rebuilt when the trained set changes (predictor, snapshots)
are looked up at save and load time.

:func:`trainer_registry` lists the trainer's components. Also here: the layout upgrade of older
checkpoints (:func:`in_current_layout`), the key fix of a DDP-wrapped model's weights and which random
streams a rank resumes with.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from . import checkpoint
from .averaging import WeightAverage
from .distributed import unwrap
from .predictor import DeltaPredictor

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


def in_current_layout(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a checkpoint of any version that still loads) in the current layout, entries added
    since it was written filled with what they meant then; ``ValueError`` for a version that does not
    load. ``state`` itself is not changed."""
    if state.get("version") == 1:
        state = upgrade_v1(state)
    if "nowcast" not in state:  # saved before nowcast jumps existed: none was in flight
        state = dict(state, nowcast=None)
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"checkpoint version {state.get('version')!r} is not {CHECKPOINT_VERSION} "
                         f"(nor 1, which still loads)")
    return {"optimizer_class": None, **state}  # written before the class was saved: not compared


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


def check_trains_what_was_saved(state: dict[str, Any], params: list[torch.Tensor]) -> None:
    """ValueError unless checkpoint ``state`` was saved by a trainer training as many tensors
    and values as ``params``: the predictor and snapshots hold one slot per trained tensor."""
    saved = (len(state["predictor"]["scales"]), DeltaPredictor.saved_numel(state["predictor"]))
    here = (len(params), sum(p.numel() for p in params))
    if saved != here:
        raise ValueError(f"checkpoint: saved by a trainer training {saved[0]} parameter tensors ({saved[1]} "
                         f"values), this one trains {here[0]} ({here[1]}): freeze and unfreeze as the saved "
                         f"run had before constructing the trainer that loads it")


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


def trainer_registry(trainer: Any) -> StateRegistry:
    """Every stateful part of ``trainer`` (a :class:`~hybrid_trainer.HybridTrainer`), in the
    order it is restored: weights before the optimizer, snapshots after the weights, random
    streams last. Getters read the trainer's attributes at save and load time."""
    t = trainer
    reg = StateRegistry()
    reg.register("version", lambda: CHECKPOINT_VERSION, lambda v: None)  # checked in load_state_dict
    reg.register("config", t.config.to_dict, lambda v: None)  # for the reader: this run's config decides
    # The wrapped module's own keys: a DDP run resumes in a single process and back.
    reg.register("model", lambda: unwrap(t.model).state_dict(),
                 lambda weights: unwrap(t.model).load_state_dict(without_ddp_prefix(weights, unwrap(t.model))))
    reg.register("outside_model", lambda: [p.detach().clone() for p in t.trained.outside_model],
                 lambda values: _copy_into(t.trained.outside_model, values))
    reg.register_component("optimizer", lambda: t.optimizer)
    # Compared on load (resume_check): another class's state would load and fail steps later.
    reg.register("optimizer_class", lambda: type(t.optimizer).__name__, lambda v: None)
    reg.register_component("scheduler", lambda: t.scheduler)
    reg.register_component("scaler", lambda: t.scaler)
    reg.register_component("predictor", lambda: t.predictor)
    reg.register_component("anchor", lambda: t.anchor)
    reg.register_component("good_state", lambda: t.guard.settled_good_state())  # a due snapshot taken first
    # Saved without one: the average starts at the loaded weights.
    reg.register_component("weight_average", lambda: t.weight_average,
                           on_missing=lambda: setattr(t, "weight_average", WeightAverage(t.params)))
    reg.register_component("history", lambda: t.forecaster.history)
    reg.register_component("normalizer", lambda: t.forecaster.normalizer)
    # Built at first use: saved as None until then; loading builds it (or drops one built here).
    reg.register("dynamics", lambda: t.forecaster.dynamics_state(), lambda v: t.forecaster.load_dynamics_state(v))
    reg.register_component("monitor", lambda: t.guard.monitor)
    reg.register_component("controller", lambda: t.controller)
    reg.register_component("loss_trend", lambda: t.loss_trend)
    reg.register_component("cost", lambda: t.worth.cost)
    reg.register("stats", lambda: asdict(t.stats), t.stats.load_state_dict)
    reg.register_component("worth", lambda: t.worth)
    reg.register("forecast", lambda: t.forecaster.forecast, lambda v: setattr(t.forecaster, "forecast", v))
    reg.register_component("predict_phase", lambda: t.predict_phase)
    reg.register_component("nowcast", lambda: t.nowcast)  # PREDICT as a nowcast jump (None when off)
    reg.register("trainer", lambda: {"step_count": t.step_count, "last_update_cosine": t._last_update_cosine},
                 lambda v: _load_loop_state(t, v))
    reg.register("rng", checkpoint.capture_rng, lambda v: None)  # restored by load_state_dict, per rank
    return reg


def _load_loop_state(trainer: Any, state: dict[str, Any]) -> None:
    trainer.step_count, trainer._last_update_cosine = state["step_count"], state["last_update_cosine"]


def _copy_into(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, saved in zip(tensors, values):
            p.copy_(saved)
