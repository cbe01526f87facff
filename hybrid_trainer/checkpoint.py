"""Atomic checkpoint files and RNG capture, so a crash never leaves a half-written file and a
resumed run draws the same random numbers as the uninterrupted one."""
from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch


def capture_rng() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": _numpy_state_to_plain(np.random.get_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuple(state["python"]))
    np.random.set_state(_plain_to_numpy_state(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_state_to_plain(state) -> list:
    kind, keys, pos, has_gauss, cached = state
    return [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)]


def _plain_to_numpy_state(plain) -> tuple:
    kind, keys, pos, has_gauss, cached = plain
    return kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached


def _to_tuple(value):
    return tuple(_to_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def atomic_save(obj, path: str | os.PathLike) -> Path:
    """``torch.save`` to a temporary file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


# Plain-data classes some third-party optimizers keep in their state (low-rank projectors of
# GaLore and APOLLO: tensors and numbers in their attributes), allowed when their package is
# installed so a checkpoint of such an optimizer loads with weights_only=True.
OPTIMIZER_STATE_CLASSES = (("galore_torch.galore_projector", "GaLoreProjector"),
                           ("apollo_torch.random_projector", "GradientProjector"),
                           ("apollo_torch.svd_projector", "GaLoreProjector"))


def _optimizer_state_classes() -> list[type]:
    import importlib
    import sys

    found = []
    for module_name, name in OPTIMIZER_STATE_CLASSES:
        if module_name.split(".")[0] in sys.modules:  # only packages the run already uses
            try:
                found.append(getattr(importlib.import_module(module_name), name))
            except (ImportError, AttributeError):
                pass
    return found


def load(path: str | os.PathLike, map_location=None):
    """Load a checkpoint written by :func:`atomic_save` (tensors, numbers, strings, containers
    only, and the optimizer-state classes of :data:`OPTIMIZER_STATE_CLASSES`)."""
    with torch.serialization.safe_globals(_optimizer_state_classes()):
        return torch.load(path, map_location=map_location, weights_only=True)
