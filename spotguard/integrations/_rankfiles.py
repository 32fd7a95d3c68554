"""Each trainer's per-rank files: which rank alone reads a file of its checkpoint folder (None: any rank).

The rules behind a node's resume fetch (``spotguard.checkpoint.folders.pernode``): a node fetches the shared
files and its own ranks' files, not other nodes' ranks' ones. Each rule is a pure function of the
file's relative name, written from the names the trainer's own save writes and its load reads
(checked in their sources, versions in docs/integrations.md); a name a rule does not claim is shared,
so a name it misses is fetched by every node, never left out:

- HF ``Trainer``: ``rng_state_<process_index>.pth`` (``_save_rng_state``/``_load_rng_state``; each
  rank loads its own only). Weights, optimizer, scheduler, ``trainer_state.json``: shared. With a
  DeepSpeed config, also DeepSpeed's ZeRO files in the Trainer's ``global_step<N>/`` folder (below:
  the Trainer loads through ``engine.load_checkpoint``). Under FSDP its shard files are fetched
  whole (not claimed).
- Accelerate: ``random_states_<process_index>.pkl`` (``load_accelerator_state`` reads its own) and
  spotguard's ``spotguard-loaders-NNNNN.pt`` (``_accelerate_loaders``).
- Lightning: spotguard's ``rng-rank-NNNNN.pt`` (Lightning writes rank 0's ``.ckpt`` only).
- DeepSpeed (in the tag's folder): spotguard's ``spotguard-rank<R>.pt``, and ZeRO's
  ``[bf16_]zero_pp_rank_<D>_mp_rank_<M>_{optim,model}_states.pt``, named by the data-parallel rank:
  DeepSpeed 0.19 reads only its own (``_get_all_zero_checkpoint_state_dicts`` loads the other ranks'
  partitions only with ``zero_elastic_checkpoint()``; ``_get_all_zero_checkpoint_names`` builds their
  names and needs no file; ZeRO-3's ``_get_all_ckpt_names`` globs its own ``zero_pp_rank``), so no
  placeholder is needed. The data-parallel rank is the global rank only without model, pipeline,
  sequence or expert parallelism: ``DeepSpeedGuard`` says it is unsure otherwise.
"""

from __future__ import annotations

import re
from typing import Any

from spotguard.checkpoint.folders.pernode import RankFiles

_HF = re.compile(r"rng_state_(\d+)\.pth")
_ACCELERATE = re.compile(r"random_states_(\d+)\.pkl|spotguard-loaders-(\d+)\.pt")
_LIGHTNING = re.compile(r"rng-rank-(\d+)\.pt")
_DEEPSPEED = re.compile(
    r"[^/]+/(?:spotguard-rank(\d+)\.pt|(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt)"
)


def _rank(pattern: re.Pattern[str], name: str) -> int | None:
    match = pattern.fullmatch(name)
    if match is None:
        return None
    return int(next(g for g in match.groups() if g is not None))


def hf(name: str) -> int | None:
    """The rank whose own file ``name`` is in an HF ``Trainer`` checkpoint folder; None: shared."""
    return _rank(_HF, name)


def accelerate(name: str) -> int | None:
    """The rank whose own file ``name`` is in an ``accelerator.save_state`` folder; None: shared."""
    return _rank(_ACCELERATE, name)


def lightning(name: str) -> int | None:
    """The rank whose own file ``name`` is in spotguard's Lightning checkpoint folder; None: shared."""
    return _rank(_LIGHTNING, name)


def deepspeed(name: str) -> int | None:
    """The (data-parallel) rank whose own file ``name`` is in a ``DeepSpeedGuard`` folder; None: shared."""
    return _rank(_DEEPSPEED, name)


def hf_deepspeed(name: str) -> int | None:
    """As ``hf``, for a Trainer with a DeepSpeed config: its ZeRO files too (``global_step<N>/...``)."""
    rank = hf(name)
    return rank if rank is not None else deepspeed(name)


def trainer_files(trainer: Any) -> RankFiles:
    """An HF ``Trainer`` node's fetch rule: its ranks' ``rng_state_N``, and with DeepSpeed their ZeRO
    partitions (known once ``cb.train`` was given the Trainer; without it DeepSpeed's files are fetched whole)."""
    if trainer is None or not getattr(trainer, "is_deepspeed_enabled", False):
        return RankFiles(hf)
    ds_config = getattr(getattr(trainer.args, "hf_deepspeed_config", None), "config", None)
    if not isinstance(ds_config, dict):
        return RankFiles(hf)
    return RankFiles(hf_deepspeed, config_doubt(ds_config, getattr(trainer, "model", None)))


# Why a node cannot trust the DeepSpeed rule (``deepspeed.fetch_rule`` from the engine, ``config_doubt``
# from the config before the engine exists): every node then fetches every file.
ELASTIC = "DeepSpeed's elastic checkpoint is on: every rank reads every ZeRO partition"
UNIVERSAL = "DeepSpeed loads a universal checkpoint"
EXPERTS = "DeepSpeed's expert parallelism names files by expert-parallel rank"
PARALLEL = "model, pipeline or sequence parallelism: ZeRO files are named by data-parallel rank"


def config_doubt(config: dict[str, Any], model: Any = None) -> str:
    """The DeepSpeed rule's doubt before the engine exists (the HF Trainer builds it inside ``train``):
    from the DeepSpeed config dict and the model's modules ("" when the ZeRO files are per rank)."""
    zero, ckpt = config.get("zero_optimization") or {}, config.get("checkpoint") or {}
    if zero.get("elastic_checkpoint") is True:
        return ELASTIC
    if ckpt.get("load_universal") is True:
        return UNIVERSAL
    if model is not None and any(type(m).__module__.startswith("deepspeed.moe") for m in model.modules()):
        return EXPERTS
    sizes = ((config.get("tensor_parallel") or {}).get("autotp_size"), config.get("sequence_parallel_size"))
    if any(isinstance(n, int) and n > 1 for n in sizes):
        return PARALLEL
    return ""
