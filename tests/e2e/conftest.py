import pytest

from cadence.launch.config import load_config

# Small but real: the default model and task, fewer steps, a smaller held-out set.
FAST = ["learner.sft.steps=10", "task.heldout_size=64", "run.progress=false"]


@pytest.fixture
def small_config():
    def make(*overrides):
        return load_config(overrides=FAST + list(overrides))
    return make
