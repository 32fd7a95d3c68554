"""``rehearse --reference``: is the preempted run's result the uninterrupted run's, bit for bit?

The final checkpoints of both storages are fetched (verified) and compared: every tensor bit for
bit (dtype, shape and bytes, NaNs included) and every other value of the saved state, a sharded
save's DCP shards read whole in this process (``shards.model...``, ``shards.optimizer...``). Where the job
logs per-step values the comparison also says at which step the runs parted: in ``guard.extra`` as
a dict keyed by step (``guard.extra.setdefault("loss", {})[str(step)] = loss.item()``), or in a
Hugging Face Trainer's ``trainer_state.json`` (its ``log_history``).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard import checkpoint
from spotguard.checkpoint.format.manifest import CheckpointInfo
from spotguard.storage import open_storage

TENSOR_FILES = (".pt", ".pth", ".bin", ".ckpt", ".pkl")  # .ckpt: Lightning's; .pkl: Accelerate's (torch.save)
#: Where saved random streams are: spotguard's ``rng``, Accelerate's ``random_states_N.pkl``, the HF Trainer's
#: ``rng_state.pth``.
RNG = re.compile(r"\.rng\.|^random_states_\d+\.pkl\.|^rng_state(_\d+)?\.pth\.")
SHARDS = "shards/metadata.dcp"  # a sharded save: its model and optimizer in DCP shards beside it
TRAINER_STATE = "trainer_state.json"  # the HF Trainer's counters, logs and callbacks' state
TIMED = ("_runtime", "_per_second")  # wall-clock figures the Trainer logs: no two runs share them
SHOWN = 5  # differences named in the report


@dataclass
class Comparison:
    exact: bool
    step: int | None  # the rehearsed run's final step
    reference_step: int | None
    first_difference_step: int | None = None  # the first step whose logged values differ
    differences: list[str] = field(default_factory=list)  # the first few places that differ
    compared: int = 0  # values compared
    skipped: list[str] = field(default_factory=list)  # files not compared: not loadable as plain state
    hint: str = ""  # what to do about the differences, named before them

    def line(self) -> str:
        if self.exact:
            left = f"; not compared: {', '.join(self.skipped)}" if self.skipped else ""
            return f"exact: yes ({self.compared} values of the final checkpoint of step {self.step}, bit for bit{left})"
        at = f", first difference at step {self.first_difference_step}" if self.first_difference_step else ""
        return f"exact: no{at} ({'; '.join(([self.hint] if self.hint else []) + self.differences[:SHOWN])})"


def compare(url: str, reference_url: str) -> Comparison:
    """Compare the newest complete checkpoints of ``url`` and ``reference_url``."""
    a, b = open_storage(url), open_storage(reference_url)
    try:
        ia, ib = checkpoint.latest(a), checkpoint.latest(b)
        result = Comparison(False, ia.step if ia else None, ib.step if ib else None)
        if ia is None or ib is None or ia.manifest is None or ib.manifest is None:
            result.differences.append(f"no complete checkpoint in {url if ia is None else reference_url}")
            return result
        with tempfile.TemporaryDirectory(prefix="spotguard-compare-") as tmp:
            da = checkpoint.fetch(a, ia, Path(tmp) / "run")
            db = checkpoint.fetch(b, ib, Path(tmp) / "reference")
            diffs: list[str] = []
            if ia.step != ib.step:
                diffs.append(f"final steps differ: {ia.step} vs {ib.step}")
            result.compared = _compare_files(da, db, ia, ib, diffs, result.skipped)
            if not result.compared:  # exact over nothing is no answer: a format this does not read
                diffs.append(f"no value compared: no file of {', '.join(TENSOR_FILES)} or .safetensors loads")
            steps_a, steps_b = _logged(ia.manifest.extra, da), _logged(ib.manifest.extra, db)
            result.first_difference_step = _first_step(steps_a, steps_b)
            if result.first_difference_step is not None:
                diffs.insert(0, f"logged values differ from step {result.first_difference_step}")
        if diffs and all(RNG.search(d) for d in diffs):  # the line names only the first few differences
            result.hint = "only random streams differ: one the job never seeds differs between any two runs; seed it"
        result.differences = diffs
        result.exact = not diffs
        return result
    finally:
        a.close()
        b.close()


def _load(path: Path) -> Any:
    """A torch file, weights only (no code runs); numpy arrays allowed (a Trainer's RNG states), and the
    plain data classes DeepSpeed pickles into its ZeRO optimizer files where DeepSpeed is installed."""
    import numpy as np
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        core = getattr(np, "_core", None) or np.core  # numpy 2 / 1
        allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), core.multiarray._reconstruct]
        if "GLOBAL deepspeed." in str(e):
            allowed += _deepspeed_globals()
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)


def _deepspeed_globals() -> list[Any]:
    """Its loss scaler (attributes), the ZeRO stage (an enum) and a parameter's fragment address (a dataclass)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _compare_files(
    da: Path, db: Path, ia: CheckpointInfo, ib: CheckpointInfo, diffs: list[str], skipped: list[str]
) -> int:
    assert ia.manifest is not None and ib.manifest is not None
    names_a, names_b = {f.name for f in ia.manifest.files}, {f.name for f in ib.manifest.files}
    for name in sorted(names_a ^ names_b):
        diffs.append(f"{name} only in {'the run' if name in names_a else 'the reference'}")
    n = _compare_shards(da, db, diffs, skipped) if SHARDS in names_a & names_b else 0
    for name in sorted(names_a & names_b):
        if name.endswith(TENSOR_FILES):
            try:
                va, vb = _load(da / name), _load(db / name)
            except Exception as e:  # pickled objects (a Trainer's arguments): configuration, not state
                skipped.append(f"{name} ({type(e).__name__})")
                continue
        elif name.endswith(".safetensors"):
            from safetensors.torch import load_file

            va, vb = load_file(str(da / name)), load_file(str(db / name))
        elif name.endswith(TRAINER_STATE):
            va, vb = (_untimed(json.loads((d / name).read_text())) for d in (da, db))
        else:
            continue  # not state: a trainer's config, logs, RNG files in other formats
        n += _same(va, vb, name, diffs)
    return n


def _untimed(value: Any) -> Any:
    """``value`` without the wall-clock figures of a Trainer's log (``eval_runtime``, ``..._per_second``)."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if not str(k).endswith(TIMED)}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _compare_shards(da: Path, db: Path, diffs: list[str], skipped: list[str]) -> int:
    """A sharded save's model and optimizer, each side's DCP shards read into one whole state here."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # DCP's reads would be collective
        skipped.append(f"DCP shards (not read inside a process group of {dist.get_world_size()} ranks)")
        return 0
    try:
        va, vb = _read_shards(da), _read_shards(db)
    except (Exception, CheckpointException) as e:  # named, not passed over; DCP wraps what its reader raised
        failures = list(e.failures.values()) if isinstance(e, CheckpointException) else []
        cause = failures[0][0] if failures else e
        skipped.append(f"DCP shards ({type(cause).__name__}: {cause})")
        return 0
    return _same(va, vb, "shards", diffs)


def _read_shards(folder: Path) -> dict[str, Any]:
    """The whole state in ``folder``'s shards (verified when fetched): DCP plans the read from their metadata
    alone, the full tensors whatever the number of ranks that wrote them, and spotguard's reader loads each
    item weights-only. Outside a process group of several ranks, where DCP's reads would be collective."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from spotguard.checkpoint.sharded.dcp import METADATA_FILE, SpotguardReader, load_metadata

    load_metadata(folder / "shards" / METADATA_FILE)  # its own error, before DCP wraps one in its report
    with SpotguardReader(lambda name: contextlib.nullcontext(folder / name)) as reader, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        return _load_state_dict_from_keys(storage_reader=reader)


def _same(a: Any, b: Any, where: str, diffs: list[str]) -> int:
    """Compare two loaded states; append where they differ; return the count of leaves compared."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape
        if same and a.numel():
            same = torch.equal(_bytes(a), _bytes(b))
        if not same:
            diffs.append(f"{where}: tensor differs")
        return 1
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if not (a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()):
            diffs.append(f"{where}: array differs")
        return 1
    if isinstance(a, dict) and isinstance(b, dict):
        n = 0
        for k in a.keys() | b.keys():
            if k not in a or k not in b:
                diffs.append(f"{where}.{k}: only in {'the run' if k in a else 'the reference'}")
            else:
                n += _same(a[k], b[k], f"{where}.{k}", diffs)
        return n
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return sum(_same(x, y, f"{where}[{i}]", diffs) for i, (x, y) in enumerate(zip(a, b, strict=True)))
    if type(a) is type(b) and type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        return _same(vars(a), vars(b), where, diffs)  # an object allowed in (DeepSpeed's loss scaler): its values
    nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    if not (nan or (type(a) is type(b) and a == b)):
        diffs.append(f"{where}: {a!r} vs {b!r}")
    return 1


def _bytes(t: Any) -> Any:
    import torch

    return t.detach().contiguous().reshape(-1).view(dtype=torch.uint8)


def _logged(extra: dict[str, Any], folder: Path) -> dict[str, dict[int, Any]]:
    """Per-step values: dicts keyed by step in ``extra``, and a Trainer's ``log_history``."""
    found: dict[str, dict[int, Any]] = {}
    for key, value in extra.items():
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            found[key] = {int(k): v for k, v in value.items()}
    state = folder / "trainer_state.json"
    if state.is_file():
        try:
            history = json.loads(state.read_text()).get("log_history", [])
        except (OSError, ValueError):
            history = []
        for rec in history:
            if isinstance(rec, dict) and "loss" in rec and "step" in rec:
                found.setdefault("loss", {})[int(rec["step"])] = rec["loss"]
    return found


def _first_step(a: dict[str, dict[int, Any]], b: dict[str, dict[int, Any]]) -> int | None:
    first = None
    for key in a.keys() & b.keys():
        for step in sorted(a[key].keys() & b[key].keys()):
            if a[key][step] != b[key][step]:
                first = step if first is None else min(first, step)
                break
    return first
