"""What a full training state is: the tracked objects' state dicts plus every global RNG stream.

Everything produced here loads with ``torch.load(weights_only=True)``: RNG states are stored as
tensors, lists and ints, never as NumPy arrays or arbitrary objects.
"""

from __future__ import annotations

import copy
import enum
import logging
import random
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from spotguard.errors import CheckpointMismatchError, ConfigError
from spotguard.value import adapt

logger = logging.getLogger(__name__)

try:
    import numpy as np
except ImportError:  # numpy is a core dependency, but a missing one must not break the guard
    np = None  # type: ignore[assignment]


#: One thread at a time reads or sets the streams: two threads in ``torch.get_rng_state()`` at once can
#: deadlock (one holds the generator's mutex while it waits for the GIL, the other holds the GIL while it
#: waits for the mutex), as in-process ranks staging at once did. Never held across a block of user code.
_RNG_LOCK = threading.RLock()


def capture_rng() -> dict[str, Any]:
    """The state of Python's ``random``, NumPy's legacy global, torch CPU and every CUDA device."""
    with _RNG_LOCK:
        return _capture_rng()


def _capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    rng: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
        rng["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Put every stream back exactly where ``capture_rng()`` found it."""
    with _RNG_LOCK:
        _restore_rng(rng)


def _restore_rng(rng: Mapping[str, Any]) -> None:
    py = rng["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    torch.set_rng_state(rng["torch"])
    if np is not None and "numpy" in rng:
        n = rng["numpy"]
        np.random.set_state(
            (n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            logger.warning(
                "checkpoint has RNG states for %d CUDA devices, this machine has %d; "
                "CUDA random streams are not restored",
                len(states),
                torch.cuda.device_count(),
            )


@contextmanager
def rng_isolated() -> Iterator[None]:
    """Run a block without a trace on the global RNG streams (for libraries that draw from them)."""
    saved = capture_rng()
    try:
        yield
    finally:
        restore_rng(saved)


def trackable(name: str, obj: Any) -> Any:
    """What to keep for ``track(name=obj)``: ``obj`` when it has ``state_dict()``/``load_state_dict()``,
    an in-place adapter for a tensor, dict or list (``spotguard.value``); else a ``ConfigError``."""
    if not name.isidentifier():
        raise ConfigError(f"tracked name {name!r} must be a Python identifier")
    return adapt(name, obj)


def collect(objects: Mapping[str, Any]) -> dict[str, Any]:
    """Each object's ``state_dict()``, by name."""
    return {name: obj.state_dict() for name, obj in objects.items()}


def restore(objects: Mapping[str, Any], states: Mapping[str, Any], where: str = "checkpoint") -> None:
    """Load each object's state; a missing or ill-fitting entry is a ``CheckpointMismatchError``."""
    missing = sorted(set(objects) - set(states))
    if missing:
        raise CheckpointMismatchError(
            f"{where} has no state for tracked object(s) {', '.join(missing)} "
            f"(it has: {', '.join(sorted(states)) or 'none'})"
        )
    for name, obj in objects.items():
        try:
            obj.load_state_dict(states[name])
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            raise CheckpointMismatchError(f"{where}: cannot load state of {name!r}: {e}") from e


def unmapped(objects: Mapping[str, Any], states: Mapping[str, Any]) -> dict[str, Any]:
    """``states`` with a copy of each CPU tensor that a tracked object's ``load_state_dict`` may keep.

    Why: each tensor of ``torch.load(mmap=True)`` keeps the whole file mapped, and what an object
    keeps of its state dict it keeps by reference: an optimizer's tensors already on its parameter's
    device (every state tensor of a CPU model, ``step`` of a GPU one), LBFGS's history lists, a
    scheduler's tensor learning rates. The disk space of a checkpoint pruned later, or of a
    downloaded copy, then stayed taken until the process ended. Not copied: what a module or
    spotguard's own adapters load (they copy into their own tensors; a module that keeps what it is
    given, as torchmetrics' ``Metric`` does, keeps the file mapped), and an optimizer's state for a
    parameter on a GPU (``load_state_dict`` moves it there; a copy would only cost host memory).
    """
    memo: dict[int, torch.Tensor] = {}  # a tensor in two places stays one tensor
    out = dict(states)
    for name, obj in objects.items():
        if name in states and not isinstance(obj, torch.nn.Module) and type(obj).__module__ != "spotguard.value":
            out[name] = _copied(states[name], memo, _moved(obj, states[name]))
    return out


def _moved(obj: Any, saved: Any) -> set[int]:
    """The tensors of ``saved`` an optimizer's ``load_state_dict`` moves off the CPU (torch's rule: all
    of a parameter's state there but ``step``)."""
    if not isinstance(obj, torch.optim.Optimizer) or not isinstance(saved, dict):
        return set()
    groups, entries = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(entries, dict):
        return set()
    out: set[int] = set()
    for old, new in zip(groups, obj.param_groups, strict=False):  # a mismatch is load_state_dict's to report
        for pid, param in zip(old.get("params", []) if isinstance(old, dict) else [], new["params"], strict=False):
            entry = entries.get(pid)
            if isinstance(entry, dict) and param.device.type != "cpu":
                out |= {id(t) for k, t in entry.items() if k != "step" and isinstance(t, torch.Tensor)}
    return out


def _copied(tree: Any, memo: dict[int, torch.Tensor], skip: set[int]) -> Any:
    if isinstance(tree, torch.Tensor):
        if id(tree) in skip or tree.device.type != "cpu" or not tree.numel():
            return tree
        if id(tree) not in memo:
            with torch.no_grad():
                copy_ = tree.detach().clone()
            if isinstance(tree, torch.nn.Parameter):
                copy_ = torch.nn.Parameter(copy_, requires_grad=tree.requires_grad)
            memo[id(tree)] = copy_.requires_grad_(tree.requires_grad)
        return memo[id(tree)]
    if isinstance(tree, dict):
        out = copy.copy(tree)  # its own type (an OrderedDict stays one)
        for k, v in tree.items():
            out[k] = _copied(v, memo, skip)
        return out
    if isinstance(tree, list):
        return [_copied(v, memo, skip) for v in tree]
    if type(tree) is tuple:
        return tuple(_copied(v, memo, skip) for v in tree)
    return tree


#: How a Guard tracks an object (``refuse_untracked``'s ``fix``).
TRACK_FIX = "Track each with guard.track(name=obj) before resume()"


class Untracked(str, enum.Enum):
    """What a resume does with a checkpoint that holds the state of an object nothing tracks now."""

    REFUSE = "refuse"  # CheckpointMismatchError naming them: the run would go on with their state fresh
    ACCEPT = "accept"  # a warning naming them, and the resume goes on without their state


def refuse_untracked(
    saved: Iterable[str], tracked: Iterable[str], where: str, policy: Untracked | str, fix: str
) -> None:
    """Refuse a resume that would drop saved state without a word (``untracked="accept"``: warn).

    A checkpoint of model, optimizer and scheduler resumed with only the model tracked goes on with
    a fresh optimizer: a silent wrong resume, as one that lacks a tracked object (which ``restore``
    refuses). Called before anything is loaded, by the Guard's engines and every trainer integration,
    each naming what it saved (``saved``) and what it restores now (``tracked``); ``fix``: how to
    track the objects in that integration."""
    saved, tracked = set(saved), set(tracked)
    left = sorted(saved - tracked)
    if not left:
        return
    names, missing = ", ".join(left), ", ".join(sorted(tracked - saved))
    if Untracked(policy) is Untracked.ACCEPT:
        logger.warning(
            "%s: the saved state of %s is not restored: nothing tracks it (untracked='accept')", where, names
        )
        return
    raise CheckpointMismatchError(
        f"{where} holds the state of {names}, which nothing tracks now"
        + (f" (and none of {missing}, which is tracked)" if missing else "")
        + f": resumed without it, the run would go on with it fresh. {fix}, or pass untracked='accept' to resume "
        "without it"
    )
