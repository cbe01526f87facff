"""A registry of the trainer's stateful components, from which its checkpoint is made.

Each component registers once under a key with how to read and restore its state; the
checkpoint is every key's state, restored in registration order. A component that may be
absent (a scheduler, a GradScaler, the cost calibration, the weight average) is registered
through a getter returning None when it is: its state is saved as None, and restoring skips it
when either side has none (or calls ``on_missing`` when the run has one and the checkpoint not).
Getters, not objects: components rebuilt when the trained set changes (predictor, snapshots)
are looked up at save and load time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


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
