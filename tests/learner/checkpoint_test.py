"""Checkpointer: bitwise round trip, keep-last-K, corrupt latest -> previous, write failures."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.learner.checkpoint import CheckpointConfig, CheckpointError, Checkpointer
from cadence.learner.config import OptimizerConfig
from cadence.learner.optimizer import make_optimizer


def tree(seed):
    k = jax.random.key(seed)
    params = {"w": jax.random.normal(k, (8, 4)), "b": jnp.arange(4.0)}
    opt = make_optimizer(OptimizerConfig(lr=1e-3))
    return {"params": params, "opt_state": opt.init(params)}


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_round_trip_is_bitwise_and_keeps_last_k(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), CheckpointConfig(keep=2, async_save=True))
    for step in (1, 2, 3):
        ck.save(step, tree(step), {"step": step, "ledger": {"x": [step]}})
    ck.wait()
    assert ck.steps() == [2, 3]
    step, arrays, meta = ck.restore_latest(tree(0))
    assert step == 3 and meta["ledger"] == {"x": [3]}
    assert same(arrays, tree(3))
    ck.close()


@pytest.mark.parametrize("first,then", [(True, False), (False, True)])
def test_either_format_restores_and_a_run_may_switch(tmp_path, first, then):
    # checkpoint.ocdbt=false writes a file per array chunk; a directory holding steps of both
    # formats restores its newest, whichever the reader is set to write
    ck = Checkpointer(str(tmp_path / "ck"), CheckpointConfig(async_save=False, ocdbt=first))
    ck.save(1, tree(1), {"step": 1})
    ck.close()
    ck = Checkpointer(str(tmp_path / "ck"), CheckpointConfig(async_save=False, ocdbt=then))
    assert ck.restore_latest(tree(0))[0] == 1 and same(ck.restore_latest(tree(0))[1], tree(1))
    ck.save(2, tree(2), {"step": 2})
    step, arrays, _ = ck.restore_latest(tree(0))
    assert step == 2 and same(arrays, tree(2))
    ck.close()
    ocdbt_files = [n for _, _, files in os.walk(tmp_path / "ck" / "2" / "state") for n in files if "ocdbt" in n]
    assert bool(ocdbt_files) == then


def test_corrupt_latest_falls_back_with_a_warning(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), CheckpointConfig(keep=3, async_save=False))
    ck.save(1, tree(1), {"step": 1})
    ck.save(2, tree(2), {"step": 2})
    ck.wait()
    # damage every file of the newest step's array item
    state_dir = os.path.join(tmp_path, "ck", "2", "state")
    for root, _, files in os.walk(state_dir):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*/2"):
        step, arrays, meta = ck.restore_latest(tree(0))
    assert step == 1 and same(arrays, tree(1))
    ck.close()


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="not writable"):
        Checkpointer(str(blocker / "ck"), CheckpointConfig())


def test_failed_save_names_the_step_and_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    ck = Checkpointer(str(tmp_path / "ck"), CheckpointConfig(async_save=False))
    ck.save(1, tree(1), {"step": 1})

    def full_disk(*a, **k):  # fault injection: a real disk cannot be filled safely in a test
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.manager, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"step 2 .*No space left"):
        ck.save(2, tree(2), {"step": 2})
    monkeypatch.undo()
    step, arrays, _ = ck.restore_latest(tree(0))
    assert step == 1 and same(arrays, tree(1))
    ck.close()


def test_saving_a_step_that_exists_keeps_it_unless_the_run_finished(tmp_path):
    """A SIGTERM right after a periodic save asks for a final save of the same step."""
    ck = Checkpointer(str(tmp_path / "c"), CheckpointConfig(async_save=False))
    arrays = {"w": np.arange(3.0)}
    ck.save(4, arrays, {"finished": False, "tag": "periodic"})
    ck.save(4, arrays, {"finished": False, "tag": "preempted"})  # used to raise StepAlreadyExistsError
    assert ck.restore_latest(arrays)[2]["tag"] == "periodic"
    ck.save(4, arrays, {"finished": True, "tag": "final"})
    assert ck.restore_latest(arrays)[2]["tag"] == "final" and ck.steps() == [4]
    ck.close()
