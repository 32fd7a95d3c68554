"""What a trainer's checkpoint holds state of, and what the trainer restores now, by name.

Trainers skip saved state that nothing restores without a word: ``accelerator.load_state`` an
``optimizer.bin`` when no optimizer is prepared, Lightning a second optimizer's or scheduler's
state (it zips the saved list with the configured one) and a callback it no longer has (a warning),
the HF ``Trainer`` every callback's state unless ``restore_callback_states_from_checkpoint=True``.
Each function names both sides for ``FolderCheckpoints.refuse_untracked`` (``state.refuse_untracked``),
which refuses the resume, naming the difference, unless ``untracked="accept"``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

#: How an AcceleratorGuard restores an object (``state.refuse_untracked``'s ``fix``).
ACCELERATE_FIX = "Prepare each with accelerator.prepare, or register it with guard.track"
#: How the HF Trainer restores a callback's state.
HF_FIX = "Pass TrainingArguments(restore_callback_states_from_checkpoint=True) and each callback to the Trainer"
#: How Lightning restores an object.
LIGHTNING_FIX = "Return each optimizer and scheduler from configure_optimizers and pass each callback to the Trainer"

# ``save_state``'s files whose object ``load_state`` restores only when the accelerator holds it: the
# first of each kind has no index (``model.safetensors``, ``optimizer.bin``), the next ones ``_1``, ``_2``.
_ACCELERATE = re.compile(
    r"(model|pytorch_model|optimizer|scheduler)(_\d+)?\.(?:safetensors|bin)|custom_checkpoint_(\d+)\.pkl"
)


def _numbered(kind: str, count: int) -> list[str]:
    return [kind + (f"_{i}" if i else "") for i in range(count)]


def accelerate(folder: Path, accelerator: Any) -> tuple[list[str], list[str]]:
    """The objects ``folder`` (``save_state``'s) holds state of, and those ``accelerator.load_state``
    restores now: ``model``, ``optimizer_1``, ``scheduler``, ``custom_checkpoint_0``."""
    saved = []
    for path in folder.iterdir():
        if (match := _ACCELERATE.fullmatch(path.name)) is not None:
            kind, index, custom = match.groups()
            saved.append(f"custom_checkpoint_{custom}" if custom else kind.replace("pytorch_", "") + (index or ""))
    kinds = (("model", "_models"), ("optimizer", "_optimizers"), ("scheduler", "_schedulers"))
    tracked = [name for kind, attr in kinds for name in _numbered(kind, len(getattr(accelerator, attr, [])))]
    tracked += [f"custom_checkpoint_{i}" for i in range(len(getattr(accelerator, "_custom_objects", [])))]
    return saved, tracked


def lightning_saved(checkpoint: dict[str, Any]) -> list[str]:
    """What a Lightning checkpoint holds state of: ``optimizer``, ``lr_scheduler_1``, ``callback <state key>``."""
    return [
        *_numbered("optimizer", len(checkpoint.get("optimizer_states") or [])),
        *_numbered("lr_scheduler", len(checkpoint.get("lr_schedulers") or [])),
        *(f"callback {key}" for key in checkpoint.get("callbacks") or {}),
    ]


def lightning_tracked(trainer: Any) -> list[str]:
    """What ``trainer`` restores from a checkpoint now, named as ``lightning_saved`` names it."""
    keys = [key for cb in trainer.callbacks for key in (cb.state_key, getattr(cb, "_legacy_state_key", None)) if key]
    return [
        *_numbered("optimizer", len(trainer.optimizers)),
        *_numbered("lr_scheduler", len(trainer.lr_scheduler_configs)),
        *(f"callback {key}" for key in keys),
    ]
