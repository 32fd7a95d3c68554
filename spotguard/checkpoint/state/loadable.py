"""Whether a collected state will load back: the check of a Guard's first save.

Why: every resume reads checkpoints with ``torch.load(weights_only=True)``, which refuses any class
outside torch's allow-list and the user's ``torch.serialization.add_safe_globals``. A tracked object
whose ``state_dict()`` holds such a value (DeepSpeed's ``LossScaler`` object, an enum, a NumPy
array) saved without complaint, and every resume then skipped its checkpoints. So each engine calls
``check`` once on the collected state, before anything is written: at its first save, or sooner, at
the staging's reservation after the first step (the single-process engine with asynchronous saves).

How, cheaply: the state is pickled as ``torch.save`` would, but with every plain tensor replaced by
one empty tensor of its dtype (the same pickle opcodes and globals, no tensor bytes), and read back
by torch's own weights-only loader: the allow-list is exactly the one a resume will use, the user's
safe globals included. The cost is one walk and one pickle of the state's structure (a few ms for
thousands of tensors), not a second serialisation of its bytes. Tensor subclasses other than
``Parameter`` are kept as they are (their class is checked too); they are rare.
"""

from __future__ import annotations

import io
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from spotguard.errors import UnloadableStateError

_Tensor = torch.Tensor
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def check(states: Mapping[str, Any], *, as_items: bool = False) -> None:
    """Raise ``UnloadableStateError`` when a state in ``states`` (name -> ``state_dict()``) would not load.

    ``as_items``: every tensor of any subclass (a DTensor shard included) is written as a tensor item
    (DCP's sharded state), so only the values around the tensors are checked.
    """
    for name, value in states.items():
        reason = _refused(_skeleton(value, as_items))
        if reason is not None:
            path, kind, reason = _culprit(value, as_items, reason)
            raise UnloadableStateError(_message(name, path, kind, reason))


def _refused(skeleton: Any) -> str | None:
    """Why ``torch.load(weights_only=True)`` refuses ``skeleton`` after ``torch.save``, or None."""
    buf = io.BytesIO()
    try:
        torch.save(skeleton, buf)
    except Exception as e:  # the real save would fail the same way: say so now, with the object's name
        return f"it cannot be pickled: {type(e).__name__}: {e}"
    buf.seek(0)
    try:
        torch.load(buf, map_location="cpu", weights_only=True)
    except Exception as e:
        text = str(e)
        found = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
        reason = found.group(1) if found else text.strip().splitlines()[-1] if text.strip() else type(e).__name__
        return reason.split(" Please use", 1)[0].strip()
    return None


def _skeleton(obj: Any, as_items: bool, empties: dict[torch.dtype, torch.Tensor] | None = None) -> Any:
    """``obj`` with every plain tensor replaced by one empty tensor of its dtype; containers rebuilt as they are."""
    empties = {} if empties is None else empties
    if isinstance(obj, _Tensor):
        if (as_items or type(obj) in _PLAIN) and not obj.is_quantized and obj.layout is torch.strided:
            empty = empties.get(obj.dtype)
            if empty is None:
                empty = empties[obj.dtype] = torch.empty(0, dtype=obj.dtype)
            return empty
        return obj
    kind = type(obj)
    if kind is dict or kind is OrderedDict:
        return kind((k, _skeleton(v, as_items, empties)) for k, v in obj.items())
    if kind is list or kind is tuple:
        return kind(_skeleton(v, as_items, empties) for v in obj)
    return obj  # anything else as it is: a scalar, or what the check is for (its class, its content)


def _culprit(obj: Any, as_items: bool, reason: str) -> tuple[str, str, str]:
    """(path, type name, reason) of the innermost value refused on its own; only run after a failure."""
    path = ""
    while type(obj) in (dict, OrderedDict, list, tuple):
        pairs = list(obj.items()) if isinstance(obj, dict) else list(enumerate(obj))
        for key, value in pairs:
            if isinstance(obj, dict) and (why := _refused(key)) is not None:
                return f"{path} (its key {key!r})", _type_name(key), why
            why = _refused(_skeleton(value, as_items))
            if why is not None:
                obj, path, reason = value, f"{path}[{key!r}]", why
                break
        else:
            break  # no part is refused alone: the container as a whole
    return path, _type_name(obj), reason


def _type_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__


def _message(name: str, path: str, kind: str, reason: str) -> str:
    where = f"state_dict(){path}" if path else "state_dict()"
    refused = re.search(r"GLOBAL (\S+)", reason)
    allow = refused.group(1) if refused else kind
    return (
        f"cannot checkpoint tracked object {name!r}: its {where} is a {kind}, which torch.load(weights_only=True) "
        f"refuses ({reason}), so no resume could load this checkpoint. Keep only tensors, numbers, strings, None, "
        "lists, tuples and dicts in what it saves (a NumPy array as torch.from_numpy(...), an enum as its value, "
        "an object such as DeepSpeed's LossScaler as a dict of its fields, e.g. by tracking a small object whose "
        "state_dict()/load_state_dict() convert them), or, if that class is safe to unpickle, call "
        f"torch.serialization.add_safe_globals([{allow}]) before the first save and before resume(). "
        "Nothing was written."
    )
