"""The RNG streams a checkpoint holds are the loop's, whatever collecting the state draws."""

from __future__ import annotations

import pytest
import torch

from spotguard import Guard


class DrawsWhenSaved:
    """A tracked object whose ``state_dict()`` draws from the global stream (as some loaders do)."""

    def state_dict(self) -> dict:
        torch.rand(4)
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


@pytest.mark.parametrize("async_save", [True, False])
def test_the_saved_rng_is_the_loops_even_when_collecting_draws(tmp_path, async_save):
    torch.manual_seed(0)
    g = Guard(str(tmp_path), providers=None, every_steps=1, save_on_exit=False, async_save=async_save)
    g.track(d=DrawsWhenSaved())
    with g:
        g.step(1)  # checkpoint of step 1: the loop's streams must come out of it untouched and saved as they are
        expected = torch.rand(3)  # what the loop draws next
    torch.manual_seed(123)
    again = Guard(str(tmp_path), providers=None).track(d=DrawsWhenSaved())
    assert again.resume() == 1
    assert torch.equal(torch.rand(3), expected)
