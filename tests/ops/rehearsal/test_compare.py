"""``rehearse --reference``'s comparison of two final checkpoints (``ops.rehearsal.compare``), on real Guard saves."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

import spotguard
from spotguard.ops.rehearsal.compare import SHOWN, compare


def _final(storage: str, seed: int) -> None:
    """A run of 2 steps whose weights are seeded alike and whose Python and NumPy streams are seeded by ``seed``."""
    torch.manual_seed(0)
    random.seed(seed)
    np.random.seed(seed)
    guard = spotguard.Guard(storage, providers=[])
    guard.track(model=torch.nn.Linear(4, 2))
    guard.resume()
    with guard:
        for step in (1, 2):
            guard.step(step)


def test_streams_the_job_never_seeds_are_named_first_with_the_hint(tmp_path):
    """nanoGPT seeds torch only: the Python and NumPy streams differ in many places, and the hint to seed them,
    which came last, was cut off the report (it names the first few differences)."""
    _final(str(tmp_path / "run"), seed=1)
    _final(str(tmp_path / "reference"), seed=2)
    result = compare(str(tmp_path / "run"), str(tmp_path / "reference"))
    assert not result.exact and len(result.differences) > SHOWN, result.differences
    assert "seed it" in result.line() and "seed it" in result.hint, result.line()
    assert all(".rng." in d for d in result.differences)  # the hint is not one of them (the JSON report's list)
    assert compare(str(tmp_path / "run"), str(tmp_path / "run")).exact  # the same checkpoint: exact


def test_a_lightning_checkpoint_is_compared_value_by_value(tmp_path):
    """Lightning's ``lightning.ckpt`` (a torch.save of nested dicts, its loops' counters among them) was left out:
    a run whose logger step was one ahead of the reference's compared as exact, over no value at all."""
    from spotguard import checkpoint
    from spotguard.storage import open_storage

    for name, counter in (("run", 70), ("reference", 69)):
        folder = tmp_path / f"{name}-folder"
        folder.mkdir()
        state = {"state_dict": {"w": torch.ones(2)}, "loops": {"fit_loop": {"_batches_that_stepped": counter}}}
        torch.save(state, folder / "lightning.ckpt")
        checkpoint.write_dir(open_storage(str(tmp_path / name)), 70, folder, reason="final")
    result = compare(str(tmp_path / "run"), str(tmp_path / "reference"))
    assert not result.exact and result.compared == 2, result.line()
    assert result.differences == ["lightning.ckpt.loops.fit_loop._batches_that_stepped: 70 vs 69"]


def _sharded_final(storage: str, seed: int) -> None:
    """A sharded save (a process group of one) of 2 steps of a model and an optimizer seeded by ``seed``."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
        opt = torch.optim.AdamW(model.parameters())
        torch.manual_seed(0)  # the same RNG streams saved on both sides: only the model and optimizer differ
        guard = spotguard.Guard(storage, providers=[]).track(model=model, optimizer=opt)
        for _ in range(2):
            model(torch.randn(4, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        guard.save(2)
        guard.close()
    finally:
        dist.destroy_process_group()


def test_a_sharded_saves_model_and_optimizer_are_compared_from_its_dcp_shards(tmp_path):
    """The model and optimizer of a sharded save are in ``*.distcp`` shards, which were not read: a torchrun
    job compared on its per-rank RNG files alone, and any two such runs compared as exact."""
    for name, seed in (("run", 1), ("same", 1), ("other", 2)):
        _sharded_final(str(tmp_path / name), seed)
    same = compare(str(tmp_path / "run"), str(tmp_path / "same"))
    # the 4 tensors of the model, 3 of Adam's per parameter, its param_groups' values, the per-rank file's
    assert same.exact and same.compared > 4 + 4 * 3, same.line()
    assert not same.skipped, same.line()
    other = compare(str(tmp_path / "run"), str(tmp_path / "other"))
    assert not other.exact and other.compared == same.compared, other.line()
    assert "shards.model.0.weight: tensor differs" in other.differences, other.differences
    assert "shards.optimizer.state.0.weight.exp_avg: tensor differs" in other.differences, other.differences
    assert not any(d.startswith("rank-") for d in other.differences), other.differences  # the RNG files agree


def test_shards_that_cannot_be_read_are_named_and_nothing_read_is_not_exact(tmp_path):
    """Shards this cannot read are named as not compared, never passed over in silence; a checkpoint of which
    no value was read is no "exact: yes"."""
    from spotguard import checkpoint
    from spotguard.storage import open_storage

    for name in ("run", "reference"):
        for with_rank_file in (True, False):
            folder = tmp_path / f"{name}-{with_rank_file}"
            (folder / "shards").mkdir(parents=True)
            (folder / "shards" / "metadata.dcp").write_bytes(b"not DCP metadata")
            (folder / "shards" / "rank-00000.distcp").write_bytes(name.encode())
            if with_rank_file:
                torch.save({"rng": torch.ones(2)}, folder / "rank-00000.pt")
            storage = open_storage(str(tmp_path / f"{with_rank_file}" / name))
            checkpoint.write_dir(storage, 3, folder, reason="final")
    some = compare(str(tmp_path / "True" / "run"), str(tmp_path / "True" / "reference"))
    assert some.exact and some.compared == 1, some.line()
    assert "not compared: DCP shards (CheckpointCorruptError: metadata.dcp: unreadable DCP metadata" in some.line()
    none = compare(str(tmp_path / "False" / "run"), str(tmp_path / "False" / "reference"))
    assert not none.exact and none.compared == 0 and "no value compared" in none.line(), none.line()


def test_accelerates_random_states_are_compared_and_named_as_streams(tmp_path):
    """Accelerate's ``random_states_0.pkl`` (a torch.save of Python's, NumPy's and torch's streams) was not read:
    a job that never seeds Python's or NumPy's streams compared as exact, and the hint to seed them never came."""
    from spotguard import checkpoint
    from spotguard.storage import open_storage

    for name, seed in (("run", 1), ("reference", 2)):
        folder = tmp_path / f"{name}-folder"
        folder.mkdir()
        random.seed(seed)
        np.random.seed(seed)
        states = {"random_state": random.getstate(), "numpy_random_seed": np.random.get_state()}
        torch.save({**states, "torch_manual_seed": torch.get_rng_state()}, folder / "random_states_0.pkl")
        torch.save({"w": torch.ones(2)}, folder / "optimizer.bin")
        checkpoint.write_dir(open_storage(str(tmp_path / name)), 5, folder, reason="final")
    result = compare(str(tmp_path / "run"), str(tmp_path / "reference"))
    assert not result.exact and not result.skipped, result.line()
    assert all(d.startswith("random_states_0.pkl.") for d in result.differences), result.differences
    assert "seed it" in result.hint, result.line()


def test_deepspeeds_zero_optimizer_files_are_compared_value_by_value(tmp_path):
    """DeepSpeed pickles its loss scaler, the ZeRO stage and fragment addresses into ``*_optim_states.pt``:
    weights-only loading refused them, and a ZeRO job's optimizer state was "not compared"."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from spotguard import checkpoint
    from spotguard.storage import open_storage

    for name, scale in (("run", 1.0), ("reference", 2.0)):
        folder = tmp_path / f"{name}-folder" / "step40"
        folder.mkdir(parents=True)
        state = {"loss_scaler": LossScaler(scale), "zero_stage": ZeroStageEnum.gradients, "exp_avg": torch.ones(3)}
        torch.save({"optimizer_state_dict": state}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        checkpoint.write_dir(open_storage(str(tmp_path / name)), 40, folder.parent, reason="final")
    result = compare(str(tmp_path / "run"), str(tmp_path / "reference"))
    assert not result.skipped and result.compared >= 4, result.line()
    key = "step40/zero_pp_rank_0_mp_rank_00_optim_states.pt.optimizer_state_dict.loss_scaler.cur_scale"
    assert result.differences == [f"{key}: 1.0 vs 2.0"], result.differences


def test_inside_a_process_group_of_several_ranks_the_shards_are_named_not_read(tmp_path, monkeypatch):
    """DCP's reads are collective where a group is up: a compare called on one rank of it would wait forever."""
    for name in ("run", "same"):
        _sharded_final(str(tmp_path / name), 1)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    result = compare(str(tmp_path / "run"), str(tmp_path / "same"))
    assert "not compared: DCP shards (not read inside a process group of 2 ranks)" in result.line(), result.line()


def test_a_trainers_state_is_compared_without_its_wall_clock_figures(tmp_path):
    """``trainer_state.json`` (the HF Trainer's counters, best metric, logs and its callbacks' state) was not read;
    it is now, but for the figures no two runs share (``eval_runtime``, ``..._per_second``)."""
    import json

    from spotguard import checkpoint
    from spotguard.storage import open_storage

    def state(runtime: float, should_save: bool) -> dict:
        log = [
            {"step": 10, "loss": 0.5},
            {"step": 10, "eval_loss": 0.4, "eval_runtime": runtime, "eval_samples_per_second": 1 / runtime},
        ]
        control = {"TrainerControl": {"args": {"should_save": should_save}}}
        return {"global_step": 10, "log_history": log, "stateful_callbacks": control}

    for name, runtime, should_save in (("run", 0.1, True), ("same", 0.2, True), ("other", 0.1, False)):
        folder = tmp_path / f"{name}-folder"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps(state(runtime, should_save)))
        checkpoint.write_dir(open_storage(str(tmp_path / name)), 10, folder, reason="final")
    same = compare(str(tmp_path / "run"), str(tmp_path / "same"))
    # global_step, the 2 logs' steps and losses, the flag
    assert same.exact and same.compared == 6, same.line()
    other = compare(str(tmp_path / "run"), str(tmp_path / "other"))
    assert other.differences == ["trainer_state.json.stateful_callbacks.TrainerControl.args.should_save: True vs False"]
