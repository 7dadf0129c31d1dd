import dataclasses

import pytest

from cadence.actors.tasks import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.actors.tasks.add_reversed import AddReversedTask
from cadence.actors.tasks.sort import SortTask


def test_defaults_validate():
    TaskConfig().validate()
    TaskConfig(name="add_reversed", num_digits=3).validate()


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TaskConfig().num_digits = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"name": "parity"}, "name"),
        ({"reward": "dense"}, "reward"),
        ({"num_digits": 0}, "num_digits"),
        ({"num_digits": 13}, "num_digits"),
        ({"seed": -1}, "seed"),
        ({"heldout_seed": -1}, "heldout_seed"),
        ({"heldout_size": 0}, "heldout_size"),
        # sort with 2 digits has 100 distinct prompts: at most 50 may be held out.
        ({"num_digits": 2, "heldout_size": 51}, "heldout_size"),
    ],
)
def test_validate_names_the_bad_field(overrides, field):
    cfg = TaskConfig(**overrides)
    with pytest.raises(ValueError, match=f"^{field}: "):
        cfg.validate()
    with pytest.raises(ValueError, match=f"^{field}: "):
        make_task(cfg)


def test_heldout_limit_is_exactly_half_the_prompt_space():
    TaskConfig(num_digits=2, heldout_size=50).validate()
    TaskConfig(name="add_reversed", num_digits=1, heldout_size=50).validate()
    with pytest.raises(ValueError, match="^heldout_size: "):
        TaskConfig(name="add_reversed", num_digits=1, heldout_size=51).validate()


def test_make_task_builds_the_named_task():
    sort = make_task(TaskConfig(name="sort", num_digits=5))
    add = make_task(TaskConfig(name="add_reversed", num_digits=3))
    assert isinstance(sort, SortTask) and sort.name == "sort5"
    assert isinstance(add, AddReversedTask) and add.name == "add3rev"
