"""Where Accelerate's prepared data loaders are in their epochs, which ``save_state`` leaves out.

A prepared loader (``DataLoaderShard``) counts its epochs in ``iteration`` and sets the sampler's
epoch from it at each ``__iter__``; in a process group it also shuffles with a generator that rank
0 broadcasts to all ranks at the start of each epoch. ``save_state`` keeps neither: resumed in its
second epoch, a job reshuffles as in its first (seen here: a 2-rank resume diverged at the first
step after it). So each save writes, per rank, every prepared loader's epoch count and its shuffle
generator as it was when the current epoch began (captured as the epoch starts, before the
permutation is drawn), and the resume puts both back before the loader's next iterator.

Each save also writes what a resume compares (``data.loader_facts``: worker count, batch size), and
``check`` runs the resume's checks (``FolderCheckpoints.check_loaders``, as for ``Guard``) on the
states ``save_state`` wrote, before ``load_state`` hands them to torchdata.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spotguard.checkpoint.state import data

if TYPE_CHECKING:
    from ._folders import FolderCheckpoints

logger = logging.getLogger(__name__)


def file_name(process_index: int) -> str:
    return f"spotguard-loaders-{process_index:05d}.pt"


def watch(loaders: list[Any]) -> None:
    """Record, at each epoch's start, the shuffle generator before it draws (idempotent)."""
    for loader in loaders:
        if not hasattr(loader, "iteration") or getattr(loader, "_spotguard_watched", False):
            continue
        original = loader.set_epoch  # called by __iter__ after the generator is synchronised

        def set_epoch(epoch: int, _loader: Any = loader, _original: Any = original) -> None:
            generator = getattr(_loader, "synchronized_generator", None)
            _loader._spotguard_epoch_start = generator.get_state() if generator is not None else None
            _original(epoch)

        loader.set_epoch = set_epoch
        loader._spotguard_watched = True


def save(loaders: list[Any], folder: Path, process_index: int, cut: bool = False) -> None:
    """Write each prepared loader's epoch count and epoch-start generator into ``folder``; ``cut``: the
    save is of a step whose evaluation a notice cut short (``AcceleratorGuard.evaluation``)."""
    states = []
    for loader in loaders:
        iteration, generator = int(getattr(loader, "iteration", 0)), getattr(loader, "synchronized_generator", None)
        if getattr(loader, "end_of_dataloader", False) and cut:
            # As at its last batch (a cut evaluation's save): the resumed loader's first pass is empty and counts
            # no epoch, but fast-forwarding through the epoch draws its order again, from the epoch-start generator.
            states.append({"iteration": iteration + 1, "generator": getattr(loader, "_spotguard_epoch_start", None)})
        elif getattr(loader, "end_of_dataloader", False):
            # Saved after the epoch's last batch: the resume begins the next epoch, with the generator as it is now.
            states.append({"iteration": iteration + 1, "generator": generator.get_state() if generator else None})
        else:
            states.append({"iteration": iteration, "generator": getattr(loader, "_spotguard_epoch_start", None)})
    folder.mkdir(parents=True, exist_ok=True)
    facts = data.loader_facts(_stateful(loaders))  # what a resume compares (worker count, batch size)
    torch.save({"loaders": states, "evaluation_cut": cut, "facts": facts}, folder / file_name(process_index))


def restore(loaders: list[Any], folder: Path, process_index: int) -> bool:
    """Put the epoch counts and epoch-start generators of ``folder`` back (a checkpoint of an older
    spotguard has none: the loaders start at epoch 0, as before). True: it was saved inside a cut
    evaluation, which the resumed run must run again."""
    path = folder / file_name(process_index)
    if not path.is_file():
        logger.debug("%s has no loader positions (an older spotguard's checkpoint)", folder)
        return False
    saved_file = torch.load(path, weights_only=True)
    states, cut = saved_file["loaders"], bool(saved_file.get("evaluation_cut", False))
    if len(states) != len(loaders):
        logger.warning(
            "the checkpoint has %d prepared data loader(s), this run %d: their epochs are not restored",
            len(states),
            len(loaders),
        )
        return cut
    for loader, saved in zip(loaders, states, strict=True):
        if hasattr(loader, "iteration"):
            loader.iteration = saved["iteration"]
        generator = getattr(loader, "synchronized_generator", None)
        if generator is not None and saved["generator"] is not None:
            generator.set_state(saved["generator"])
            loader._spotguard_epoch_start = saved["generator"]
    return cut


def _stateful(loaders: list[Any]) -> dict[str, Any]:
    """The prepared loaders whose position ``save_state`` writes, by index (``dl_state_dict_<i>.bin``)."""
    return {str(i): loader for i, loader in enumerate(loaders) if getattr(loader, "use_stateful_dataloader", False)}


def _state_file(folder: Path, index: str) -> Path:
    return folder / ("dl_state_dict.bin" if index == "0" else f"dl_state_dict_{index}.bin")  # save_state's names


def check(
    loaders: list[Any], folder: Path, process_index: int, checkpoints: FolderCheckpoints, where: str
) -> dict[str, Any]:
    """The resume's checks of each prepared loader against ``folder``'s state (before ``load_state``):
    refused (``CheckpointMismatchError``) or accepted as ``Guard`` does; returns the states moved to
    another worker count, by index, for ``reload`` once ``load_state`` has loaded the saved ones."""
    objects = _stateful(loaders)
    states = {
        i: torch.load(_state_file(folder, i), weights_only=True) for i in objects if _state_file(folder, i).is_file()
    }
    path = folder / file_name(process_index)
    facts = torch.load(path, weights_only=True).get("facts", {}) if path.is_file() else {}
    saved = dict(states)
    checkpoints.check_loaders(objects, states, facts, where)
    return {i: state for i, state in states.items() if state is not saved[i]}


def reload(loaders: list[Any], moved: dict[str, Any]) -> None:
    """After ``load_state``: the states ``check`` moved to the loaders' worker counts, in place of the saved ones."""
    for i, state in moved.items():
        loaders[int(i)].load_state_dict(state)
