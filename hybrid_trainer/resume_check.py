"""Checks a checkpoint against the trainer that is about to load it, before anything is restored.

A load that fails halfway leaves a trainer nobody can reason about: weights and optimizer state from the
file, counters and forecasts from the run it replaced. So :meth:`HybridTrainer.load_state_dict` first runs
every check here; each raises ``ValueError`` naming the component and, where there is one, the tensor or
config field, and only when all pass does anything get restored. The checks:

* the config fields that change a component's shapes or meaning are equal (:data:`SHAPED_FIELDS`);
* model keys, shapes and dtypes equal the module's, tensors outside the model likewise;
* the optimizer is of the saved class, with as many param groups of the same sizes and the same
  hyperparameter keys, and its saved state tensors have the shapes of the live ones (of the parameters,
  for torch's own optimizers before their first step);
* the snapshots (anchor, good state) and the predictor hold one slot per trained tensor, of its shape;
* the small components (dynamics model, normalizer, state history, monitor, phase controller, loss trend,
  cost calibration) load into a copy first: what their own ``load_state_dict`` would refuse is refused
  here, before the live one is touched;
* weights, buffers, optimizer state and good-state snapshot hold no NaN or Inf: such a file would
  resume into a run the guard can only refuse step after step.

What this does not check is whether the file's bytes are the ones written (that is the checkpoint file
layer's content digest).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any

import torch

from .anchor import buffer_slots
from .blas_dots import self_dot_routine, takes as blas_takes
from .distributed import unwrap
from .int8_direction import block_count
from .state_registry import check_trains_what_was_saved, without_ddp_prefix

__all__ = ["check_loadable", "SHAPED_FIELDS", "check_config", "check_model", "check_outside_model", "check_optimizer",
           "check_snapshot", "check_predictor", "check_like", "check_keys", "check_loads_into_a_copy",
           "non_finite_names"]

# HybridConfig fields a checkpoint's components were built with: a trainer built with other values holds
# components of other shapes (dynamics model, predictor history, bandit arms), or reads them otherwise.
SHAPED_FIELDS = ("dynamics_hidden", "dynamics_ensemble", "dynamics_window", "predict_lengths", "history_size",
                 "direction", "use_bandit")


def _fail(message: str) -> None:
    raise ValueError(f"checkpoint: {message}")


def _plain(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a plain tensor the foreach kernels take: a tensor subclass holding quantized
    optimizer state (torchao's 8/4-bit ``OptimState``) through its ``dequantize()``, None when it
    has none (then it cannot be checked here)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return t
    dequantize = getattr(t, "dequantize", None)
    return dequantize() if callable(dequantize) else None


def _multi_tensor_norm_pays(device: torch.device) -> bool:
    """Whether the max-abs norms of tensors on ``device`` come from one multi-tensor kernel
    (``_foreach_norm``, on a GPU) rather than from one ``aminmax`` per tensor (on a CPU, where
    ``_foreach_norm(inf)`` takes a scalar path: 5.2 ms for 1.6M floats against 0.2 ms for
    ``aminmax``, measured on this project's 2-core CPU). Tests force the GPU's way on a CPU."""
    return device.type != "cpu"


def _finite_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """Per tensor, whether every entry is finite: one host read per device. On a CPU each
    tensor's minimum and maximum; elsewhere every tensor's max-abs norm from one multi-tensor
    op (finite exactly when every entry is, without overflow), stacked and read once: a snapshot
    of the char-LM's 40 weights and their AdamW state is some 160 tensors, and the detach, two
    views and cast per tensor that gave each one's flag the CPU's shape were 3-4 dispatcher
    calls a tensor on the GPU's host every ``good_state_every`` steps."""
    by_device: dict[torch.device, list[int]] = {}
    for index, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(index)
    finite = [True] * len(tensors)
    with torch.no_grad():  # a parameter's norm would otherwise record a graph (a detach per tensor)
        for device, indices in by_device.items():
            group = [tensors[i] for i in indices]
            if _multi_tensor_norm_pays(device):
                # One kernel per dtype; the stack promotes mixed dtypes (a bf16 Inf stays Inf).
                flags = torch.isfinite(torch.stack(torch._foreach_norm(group, math.inf))).tolist()
            else:
                stand_ins = torch.stack([torch.stack(torch.aminmax(t)).float() for t in group])
                flags = torch.isfinite(stand_ins).all(dim=-1).tolist()
            for i, ok in zip(indices, flags):
                finite[i] = ok
    return finite


def _all_finite_on_cpu(tensors: list[torch.Tensor]) -> bool:
    """True when every entry of every tensor is finite, by each tensor's dot product with itself
    (BLAS past torch's dispatcher, :mod:`~hybrid_trainer.blas_dots`) or, for a tensor it cannot
    take, its sum (in float32 at least): a NaN or an Inf makes either non-finite. False can also
    mean finite entries whose squares or sum overflow, so False only sends the caller to the
    exact per-tensor check. A sum is the cheapest full pass torch has on a CPU (20 µs for 400k
    floats against 44 µs for a norm), and on a CPU each is read as it comes: over the 1 ms MLP's
    weights and AdamW state ~85 µs, against ~140 µs for one multi-tensor norm and ~115 µs for the
    sums stacked into one read (the good-state snapshot runs it every ``good_state_every``
    steps); a dot called past the dispatcher spares each tensor's two dispatcher calls and its
    ``detach``. A 0-d tensor (an optimizer's step count) is read as it is: its sum is a
    dispatcher call for nothing."""
    for t in tensors:
        if t.ndim == 0:
            value = t.item()
        else:
            routine = self_dot_routine(t.dtype) if blas_takes(t) else None
            if routine is not None:
                value = routine(t)  # reads the bytes only: no autograd, so no detach needed
            else:
                value = t.detach().sum(dtype=torch.float32 if t.element_size() < 4 else None).item()
        if not math.isfinite(value):
            return False
    return True


def non_finite_names(named: Iterable[tuple[Any, Any]], reads_free: bool | None = None) -> list[Any]:
    """Names of the floating tensors among ``named`` that hold a NaN or an Inf, as given (a
    caller may pass keys and build the text of only those returned). Where a read of a value
    waits for queued work (a GPU), one host read for all of them (the max-abs norm of a tensor is
    finite exactly when every entry is); where reads are free (``reads_free``; by default when
    every tensor is on the CPU), first one sum per tensor, read as it comes
    (:func:`_all_finite_on_cpu`)."""
    pairs = [(name, _plain(t)) for name, t in named if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    pairs = [(name, t) for name, t in pairs if t is not None]
    if not pairs:
        return []
    if reads_free is None:
        reads_free = all(t.device.type == "cpu" for _, t in pairs)
    if reads_free and _all_finite_on_cpu([t for _, t in pairs]):
        return []
    finite = _finite_flags([t for _, t in pairs])
    return [name for (name, _), ok in zip(pairs, finite) if not ok]


def _require_finite(named: Iterable[tuple[str, Any]], where: str) -> None:
    bad = non_finite_names(named)
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        _fail(f"{where} holds NaN or Inf in {shown}; refusing to resume from it")


def check_config(saved: dict[str, Any], current) -> None:
    """The fields of :data:`SHAPED_FIELDS` must be equal (others, such as ``predict``, may differ)."""
    if not isinstance(saved, dict):
        _fail(f"'config' must be a dict, got {type(saved).__name__}")
    mine = current.to_dict()
    for name in SHAPED_FIELDS:
        if name not in saved:
            continue  # written before the field existed: its default then is what the file holds
        theirs, ours = saved[name], mine[name]
        if isinstance(ours, list):
            theirs = list(theirs) if isinstance(theirs, (list, tuple)) else theirs
        if theirs != ours:
            _fail(f"saved with HybridConfig.{name}={theirs!r}, this trainer has {name}={ours!r}: the components "
                  f"it shapes do not fit; construct the trainer with {name}={theirs!r} to resume")


def check_model(saved: dict[str, Any], module: torch.nn.Module) -> None:
    """Keys, shapes and dtypes of ``saved`` (already without a DDP prefix) against ``module``'s, and finite."""
    if not isinstance(saved, dict):
        _fail(f"'model' must be a state dict, got {type(saved).__name__}")
    live = module.state_dict()
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or unexpected:
        _fail(f"model keys differ: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for key, tensor in live.items():
        value = saved[key]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            _fail(f"model tensor {key!r} has shape {shape}, the model's is {tuple(tensor.shape)}")
        if value.dtype != tensor.dtype and not (value.is_floating_point() and tensor.is_floating_point()):
            _fail(f"model tensor {key!r} is {value.dtype}, the model's is {tensor.dtype}")
    _require_finite(((f"model tensor {k!r}", v) for k, v in saved.items()), "the model state")


def check_outside_model(saved: list, outside: list[torch.Tensor]) -> None:
    if len(saved) != len(outside):
        _fail(f"holds {len(saved)} trained tensors outside the model, this trainer trains {len(outside)}")
    for i, (value, tensor) in enumerate(zip(saved, outside)):
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            _fail(f"trained tensor {i} outside the model has another shape than this one's {tuple(tensor.shape)}")
    _require_finite(((f"trained tensor {i} outside the model", v) for i, v in enumerate(saved)), "the state")


def check_optimizer(saved: dict[str, Any], optimizer: torch.optim.Optimizer, saved_class: str | None,
                    names: dict[int, str]) -> None:
    """Class, param-group structure, hyperparameter keys, state shapes and finiteness.

    ``names`` maps ``id(param)`` to a readable name for the messages."""
    mine = type(optimizer).__name__
    if saved_class is not None and saved_class != mine:
        _fail(f"saved with optimizer {saved_class}, this trainer has {mine}: their states do not carry over")
    parts = getattr(optimizer, "parts", None)
    if parts is not None:  # CombinedOptimizer: one state per part
        saved_parts = saved.get("parts") if isinstance(saved, dict) else None
        if not isinstance(saved_parts, list) or len(saved_parts) != len(parts):
            _fail(f"the optimizer is a combination of {len(parts)} parts; the saved state is not")
        for part, state in zip(parts, saved_parts):
            check_optimizer(state, part, None, names)
        return
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= set(saved):
        _fail(f"'optimizer' is not the state of a {mine}")
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    sizes = tuple(len(g["params"]) for g in groups)
    saved_sizes = tuple(len(g.get("params", ())) for g in saved_groups)
    if sizes != saved_sizes:
        _fail(f"the saved optimizer has {len(saved_sizes)} param group(s) of sizes {saved_sizes}, this {mine} has "
              f"{len(sizes)} of sizes {sizes}")
    for index, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        keys, saved_keys = set(group) - {"params"}, set(saved_group) - {"params"}
        if keys != saved_keys:
            _fail(f"optimizer param group {index} was saved with hyperparameters {sorted(saved_keys)}, this "
                  f"{mine}'s has {sorted(keys)}: saved by another optimizer class (or torch version), whose "
                  f"groups this one would step with missing settings")
    params = [p for g in groups for p in g["params"]]
    # torch's own optimizers keep param-shaped state (and 0-d counters); others may factor it (Adafactor).
    param_shaped = type(optimizer).__module__.startswith("torch.optim")
    ids = [i for g in saved_groups for i in g["params"]]
    index_of = {saved_id: position for position, saved_id in enumerate(ids)}
    named = []
    for saved_id, slot in saved["state"].items():
        if saved_id not in index_of or not isinstance(slot, dict):
            _fail(f"optimizer state entry {saved_id!r} belongs to no saved param group")
        param = params[index_of[saved_id]]
        name = names.get(id(param), f"parameter {index_of[saved_id]}")
        live = optimizer.state.get(param, {})
        for key, value in slot.items():
            if not isinstance(value, torch.Tensor):
                continue
            reference = live.get(key)
            if isinstance(reference, torch.Tensor):
                if value.shape != reference.shape:
                    _fail(f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, this run's "
                          f"{tuple(reference.shape)}")
            elif param_shaped and value.dim() > 0 and value.shape != param.shape:
                _fail(f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, the parameter "
                      f"{tuple(param.shape)}")
            named.append((f"optimizer state {key!r} of {name}", value))
    _require_finite(named, "the optimizer state")


def check_snapshot(saved: dict[str, Any], what: str, params: list[torch.Tensor], buffers: list[torch.Tensor],
                   finite: bool) -> None:
    """A :class:`~hybrid_trainer.anchor.WeightAnchor` state: one slot per trained tensor and per buffer,
    of its shape; with ``finite``, no NaN or Inf (the good state is what the guard restores)."""
    if not isinstance(saved, dict):
        _fail(f"{what!r} must be a dict, got {type(saved).__name__}")
    if "params" not in saved:
        return
    values = saved["params"]
    if len(values) != len(params) or any(v.shape != p.shape for v, p in zip(values, params)):
        _fail(f"{what!r} holds {len(values)} tensors that do not match the {len(params)} trained here")
    saved_buffers = saved.get("buffers") or []
    if saved_buffers and (len(saved_buffers) != len(buffers)
                          or any(v.shape != b.shape for v, b in zip(saved_buffers, buffers))):
        _fail(f"{what!r} holds {len(saved_buffers)} module buffers that do not match the model's {len(buffers)}")
    optimizer = saved.get("optimizer")
    if optimizer is not None and len(optimizer) != len(params):
        _fail(f"{what!r} holds optimizer state for {len(optimizer)} tensors, {len(params)} are trained here")
    if finite:
        named = [(f"{what} tensor {i}", v) for i, v in enumerate(values)]
        named += [(f"{what} buffer {i}", v) for i, v in enumerate(saved_buffers)]
        named += [(f"{what} optimizer state {k!r} of tensor {i}", v) for i, slot in enumerate(optimizer or [])
                  for k, v in slot.items()]
        _require_finite(named, f"the {what}")


def check_predictor(saved: dict[str, Any], numel: int, scales_shape: torch.Size, blocks: int | None = None) -> None:
    """The predictor's flat buffers (``numel`` values; absent while nothing was recorded; an int8
    direction with its ``blocks`` block scales), per-tensor scales and update history fit this
    trainer's trained tensors."""
    if not isinstance(saved, dict) or not {"ema", "scales", "history"} <= set(saved):
        _fail("'predictor' is not a DeltaPredictor state")
    if not isinstance(saved["scales"], torch.Tensor) or saved["scales"].shape != scales_shape:
        _fail("predictor 'scales' do not fit the trained tensors (saved by a trainer training other tensors: "
              "freeze and unfreeze as the saved run had before constructing the trainer)")
    for key in ("ema", "linear"):
        value = saved.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or value.numel() != numel):
            _fail(f"predictor {key!r} does not fit the {numel} trained values")
    if isinstance(saved["ema"], torch.Tensor) and saved["ema"].dtype == torch.int8:  # codes: their block scales too
        scales = saved.get("ema_scales")
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or \
                (blocks is not None and scales.numel() != blocks):
            _fail("predictor int8 direction has no block scales that fit the trained tensors")
    history = saved["history"]
    if not isinstance(history, list) or not all(
            isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)
            for pair in history):
        _fail("predictor update history is not a list of (codes, scales) tensor pairs")
    if len({tuple(t.shape for t in pair) for pair in history}) > 1:
        _fail("predictor update history holds entries of different shapes")


def check_like(saved: Any, live: Any, what: str, path: str = "") -> None:
    """``saved`` has ``live``'s structure: the same dict keys, list lengths and tensor shapes."""
    where = f"{what}{path}"
    if isinstance(live, dict):
        if not isinstance(saved, dict) or set(saved) != set(live):
            _fail(f"{where} does not have the structure this trainer's has")
        for key in live:
            check_like(saved[key], live[key], what, f"{path}[{key!r}]")
    elif isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            _fail(f"{where} does not have the structure this trainer's has")
        for i, (s, l) in enumerate(zip(saved, live)):
            check_like(s, l, what, f"{path}[{i}]")
    elif isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != live.shape:
            _fail(f"{where} has another shape than this trainer's {tuple(live.shape)}")


def check_keys(saved: Any, live: dict[str, Any], what: str) -> None:
    """``saved`` is a dict with ``live``'s keys (for components too entangled to copy)."""
    if not isinstance(saved, dict) or set(saved) != set(live):
        found = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        _fail(f"{what!r} has keys {found}, this trainer's {sorted(live)}")


def check_loads_into_a_copy(component: Any, saved: Any, what: str, method: str = "load_state_dict") -> None:
    """Load ``saved`` into a deep copy of ``component`` (small components only: the dynamics model, the
    normalizer, the monitor...), so whatever its own loader refuses is refused before the live one is
    touched. The error names the component."""
    probe = copy.deepcopy(component)
    try:
        getattr(probe, method)(saved)
    except Exception as error:  # any refusal of the component's own loader, reported as the checkpoint's
        raise ValueError(f"checkpoint: {what!r} does not load: {type(error).__name__}: {error}") from error


def _dynamics_to_check(trainer) -> Any:
    """The dynamics model a saved one must load into: the run's own, or, before its first use built
    it, a fresh one (the load builds it then); None for a run that never predicts."""
    if trainer.dynamics is not None:
        return trainer.dynamics
    return trainer.forecaster.new_dynamics() if trainer.forecaster.config.predict else None


def check_loadable(trainer, state: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming what in ``state`` (an upgraded, current-version checkpoint) does not
    fit ``trainer`` (a :class:`~hybrid_trainer.HybridTrainer`), before its ``load_state_dict``
    restores anything: a load that failed halfway left weights and optimizer state from the file and
    the rest from the run it replaced. The small components load into copies first; the large ones
    (model, optimizer, predictor, snapshots) are compared by structure and shape."""
    missing = [key for key in trainer.registry.keys() if key not in state]
    if missing:
        raise ValueError(f"checkpoint: no state for {missing}")
    check_config(state["config"], trainer.config)
    module = unwrap(trainer.model)
    check_model(without_ddp_prefix(state["model"], module), module)
    check_trains_what_was_saved(state, trainer.params)  # the predictor and snapshots: one slot per trained tensor
    check_outside_model(state["outside_model"], trainer.trained.outside_model)
    names = {id(p): repr(n) for n, p in module.named_parameters()}
    check_optimizer(state["optimizer"], trainer.optimizer, state["optimizer_class"], names)
    check_predictor(state["predictor"], trainer.predictor.numel, trainer.predictor.scales.shape,
                    blocks=block_count(trainer.predictor.sizes))
    buffers = [owner._buffers[name] for owner, name in buffer_slots(module)]
    check_snapshot(state["anchor"], "anchor", trainer.params, buffers, finite=False)
    check_snapshot(state["good_state"], "good_state", trainer.params, buffers, finite=True)
    if trainer.weight_average is not None and state["weight_average"] is not None:
        check_like(state["weight_average"], trainer.weight_average.state_dict(), "weight_average")
    if trainer.scheduler is not None and state["scheduler"] is not None \
            and set(state["scheduler"]) != set(trainer.scheduler.state_dict()):
        raise ValueError(f"checkpoint: 'scheduler' is not the state of a {type(trainer.scheduler).__name__}")
    small = [("history", trainer.history, "load_state_dict"), ("normalizer", trainer.normalizer, "load_state_dict"),
             ("dynamics", _dynamics_to_check(trainer), "load_full_state_dict"),
             ("monitor", trainer.monitor, "load_state_dict"),
             ("controller", trainer.controller, "load_state_dict"), ("loss_trend", trainer.loss_trend, "load_state_dict"),
             ("stats", trainer.stats, "load_state_dict")]
    if trainer.scaler is not None and state["scaler"] is not None:
        small.append(("scaler", trainer.scaler, "load_state_dict"))
    if trainer.cost is not None and state["cost"] is not None:
        small.append(("cost", trainer.cost, "load_state_dict"))
    for key, component, method in small:
        if component is not None and state[key] is not None:  # as the registry: skipped when either has none
            check_loads_into_a_copy(component, state[key], key, method)
    # These hold references to the large parts (a copy would copy them): their keys only.
    for key, live in (("worth", trainer.worth.state_dict()), ("predict_phase", trainer.predict_phase.state_dict()),
                      ("trainer", {"step_count": 0, "last_update_cosine": 0.0})):
        check_keys(state[key], live, key)
    rngs = state.get("rng_by_rank") or [state["rng"]]
    if not all(isinstance(r, dict) and isinstance(r.get("torch"), torch.Tensor) and r["torch"].dtype == torch.uint8
               for r in rngs):
        raise ValueError("checkpoint: 'rng' is not a random-stream state from capture_rng()")
