"""Training state that is not an object with ``state_dict()``: tensors, containers, plain values.

A training loop keeps state outside modules and optimizers: an RNN's hidden state carried from
batch to batch, EMA weights in a dict, a running count. ``Guard.track()`` accepts them:

- a tensor, a ``dict`` or a ``list`` is restored in place, so the loop's own reference keeps
  working (a tensor keeps its device and dtype; a container keeps its identity, and a tensor in it
  is copied into when its shape still fits);
- anything that is rebound rather than mutated (``hidden = model(x, hidden)[1]``, an ``int``)
  lives in a ``Value``: the loop reads and writes ``holder.value``, and a resume replaces it.

Only what ``torch.load(weights_only=True)`` reads back may be kept: tensors, ``None``, bools,
ints, floats, strings, and lists, tuples and dicts of them.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import ConfigError

_SCALARS = (bool, int, float, str, type(None))


def check_plain(value: Any, where: str) -> None:
    """Raise ``ConfigError`` unless ``value`` is made only of what a weights-only load accepts."""
    if isinstance(value, (torch.Tensor, *_SCALARS)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise ConfigError(f"{where}: dict key {key!r} must be a str or an int")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise ConfigError(
        f"{where}: a {type(value).__name__} cannot be checkpointed; keep tensors, numbers, strings, "
        "None, and lists, tuples and dicts of them"
    )


def _like(new: Any, old: Any, in_place: bool) -> Any:
    """``new`` (as loaded, on the CPU) placed like ``old``, matched by key or position: a tensor goes to
    the device of the tensor it replaces; with ``in_place`` it is copied into that tensor when the shape
    fits, so references to it keep working."""
    if isinstance(new, torch.Tensor):
        if isinstance(old, torch.Tensor):
            if in_place and old.shape == new.shape and old.dtype == new.dtype and not old.requires_grad:
                with torch.no_grad():
                    return old.copy_(new)
            return new.to(old.device, copy=True)
        return new.clone()  # never a view of the checkpoint file the loader mapped
    if isinstance(new, dict):
        return {k: _like(v, old.get(k) if isinstance(old, dict) else None, in_place) for k, v in new.items()}
    if isinstance(new, (list, tuple)):
        olds = list(old) if isinstance(old, (list, tuple)) and len(old) == len(new) else [None] * len(new)
        items = [_like(v, o, in_place) for v, o in zip(new, olds, strict=True)]
        return items if isinstance(new, list) else tuple(items)
    return new


class Value:
    """A holder for state the loop rebinds: ``guard.track(hidden=spotguard.Value(h0))``, then read and
    assign ``hidden.value``. Resuming replaces ``value`` with the checkpointed one; its tensors go to
    the device of the tensors they replace (matched by position or key), else stay on the CPU; the
    replaced tensors themselves are left alone (the loop may share them, e.g. a zero initial state)."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        check_plain(self.value, "Value")
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "value" not in state:
            raise ValueError("not the state of a spotguard.Value")
        self.value = _like(state["value"], self.value, in_place=False)  # the old tensors may be shared

    def __repr__(self) -> str:
        return f"Value({self.value!r})"


class _InPlace:
    """A tensor, dict or list tracked directly: saved as is, restored into the same object."""

    def __init__(self, obj: torch.Tensor | dict[Any, Any] | list[Any], name: str) -> None:
        self.obj, self.name = obj, name

    def state_dict(self) -> Any:
        check_plain(self.obj, self.name)
        return self.obj

    def load_state_dict(self, state: Any) -> None:
        obj = self.obj
        if isinstance(obj, torch.Tensor):
            if not isinstance(state, torch.Tensor) or state.shape != obj.shape:
                got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
                raise ValueError(f"tensor of shape {tuple(obj.shape)}, checkpoint has {got}")
            with torch.no_grad():
                obj.copy_(state)
        elif isinstance(obj, dict):
            if not isinstance(state, dict):
                raise ValueError(f"a dict, checkpoint has a {type(state).__name__}")
            restored = _like(state, obj, in_place=True)
            obj.clear()
            obj.update(restored)
        else:
            if not isinstance(state, list):
                raise ValueError(f"a list, checkpoint has a {type(state).__name__}")
            obj[:] = _like(state, obj, in_place=True)


class _GeneratorState:
    """A ``torch.Generator`` tracked: its ``get_state()``/``set_state()`` as a state dict (a uint8 tensor)."""

    def __init__(self, gen: torch.Generator, name: str) -> None:
        self.gen, self.name = gen, name

    def state_dict(self) -> torch.Tensor:
        return self.gen.get_state()

    def load_state_dict(self, state: Any) -> None:
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise ValueError(f"a generator's state (a uint8 tensor), checkpoint has {type(state).__name__}")
        try:
            self.gen.set_state(state)
        except RuntimeError as e:  # another kind of generator (CPU vs CUDA), or a state of another size
            raise ValueError(f"the checkpoint's generator state does not fit: {e}") from None


def adapt(name: str, obj: Any) -> Any:
    """What ``Guard.track()`` keeps for ``obj``: the object itself when it has ``state_dict()`` and
    ``load_state_dict()``, an in-place adapter for a tensor, dict, list or ``torch.Generator``, else a
    clear error."""
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return obj
    if isinstance(obj, torch.Generator):  # an eval sampler's or a data augmentation's own stream
        return _GeneratorState(obj, name)
    if isinstance(obj, (torch.Tensor, dict, list)):
        if isinstance(obj, torch.Tensor) and obj.requires_grad:
            raise ConfigError(
                f"cannot track {name!r}: a tensor that requires grad is a parameter; track the module that owns it"
            )
        check_plain(obj, name)
        return _InPlace(obj, name)
    if isinstance(obj, (*_SCALARS, tuple)):
        raise ConfigError(
            f"cannot track {name!r}: a {type(obj).__name__} cannot be restored in place; "
            f"use guard.extra[{name!r}] for a JSON value, or {name} = spotguard.Value(...) "
            f"and read/assign {name}.value"
        )
    raise ConfigError(
        f"cannot track {name!r}: {type(obj).__name__} has no state_dict()/load_state_dict(); tensors, dicts, "
        "lists and torch.Generators are restored in place, and a spotguard.Value holds what the loop rebinds "
        "if it is made of tensors, numbers, strings and None; give it those two methods, or keep its state "
        "in a spotguard.Value"
    )
