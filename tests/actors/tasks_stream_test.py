"""Training streams and held-out sets of the built-in tasks."""

import pytest

from cadence.actors.tasks import TaskConfig
from cadence.actors.tasks.registry import make_task

CONFIGS = [TaskConfig(name="sort", num_digits=6), TaskConfig(name="add_reversed", num_digits=3)]


@pytest.fixture(params=CONFIGS, ids=lambda c: c.name)
def cfg(request):
    return request.param


def test_prompt_is_a_pure_function_of_seed_and_index(cfg):
    a, b = make_task(cfg), make_task(cfg)
    forward = [a.prompt(i) for i in range(50)]
    backward = [b.prompt(i) for i in reversed(range(50))][::-1]
    assert forward == backward
    assert a.prompt(123_456) == b.prompt(123_456)  # a resumed run can start anywhere


def test_prompt_ids_and_indices(cfg):
    task = make_task(cfg)
    p = task.prompt(1234)
    assert p.prompt_id == f"{task.name}/train/1234" and p.index == 1234
    assert "/" not in task.name
    for i, h in enumerate(task.heldout()):
        assert h.prompt_id == f"{task.name}/heldout/{i}" and h.index == i


def test_training_stream_depends_on_seed(cfg):
    a = make_task(cfg)
    b = make_task(TaskConfig(**{**cfg.__dict__, "seed": cfg.seed + 1}))
    same = sum(a.prompt(i).tokens == b.prompt(i).tokens for i in range(200))
    assert same < 10  # collisions happen only by chance in a space of 10**6 prompts


def test_stream_varies_across_indices(cfg):
    task = make_task(cfg)
    tokens = {task.prompt(i).tokens for i in range(500)}
    assert len(tokens) > 480


def test_prompt_shapes(cfg):
    task = make_task(cfg)
    tok = task.tokenizer
    for i in range(100):
        p = task.prompt(i)
        assert p.tokens[0] == tok.bos_id and tok.bos_id not in p.tokens[1:]
        assert len(p.tokens) == task.max_prompt_len
        assert len(p.answer) == task.max_completion_len
        assert p.answer[-1] == tok.eos_id and tok.eos_id not in p.answer[:-1]
        assert isinstance(p.tokens, tuple) and isinstance(p.answer, tuple)


def test_negative_index_rejected(cfg):
    with pytest.raises(ValueError):
        make_task(cfg).prompt(-1)


def test_heldout_fixed_sized_unique_and_independent_of_training_seed(cfg):
    task = make_task(cfg)
    held = task.heldout()
    assert len(held) == cfg.heldout_size
    assert len({p.tokens for p in held}) == len(held)
    other_seed = make_task(TaskConfig(**{**cfg.__dict__, "seed": 99}))
    assert other_seed.heldout() == held
    other_heldout_seed = make_task(TaskConfig(**{**cfg.__dict__, "heldout_seed": 99}))
    assert len({p.tokens for p in other_heldout_seed.heldout()} & {p.tokens for p in held}) < 10
    held.pop()  # the caller's list is a copy
    assert len(task.heldout()) == cfg.heldout_size


def test_larger_heldout_extends_smaller_one(cfg):
    small = make_task(TaskConfig(**{**cfg.__dict__, "heldout_size": 16})).heldout()
    large = make_task(TaskConfig(**{**cfg.__dict__, "heldout_size": 64})).heldout()
    assert large[:16] == small


def test_heldout_disjoint_from_first_20k_training_prompts(cfg):
    task = make_task(cfg)
    held = {p.tokens for p in task.heldout()}
    assert all(task.is_heldout(p) for p in task.heldout())
    for i in range(20_000):
        assert task.prompt(i).tokens not in held, i


@pytest.mark.parametrize("name, num_digits", [("sort", 3), ("add_reversed", 1)])
def test_redraws_keep_heldout_out_of_a_crowded_space(name, num_digits):
    # Half of the space is held out, so about half of all first draws collide and are redrawn.
    space = 10**3 if name == "sort" else 10**2
    cfg = TaskConfig(name=name, num_digits=num_digits, heldout_size=space // 2)
    task = make_task(cfg)
    held = {p.tokens for p in task.heldout()}
    train = [task.prompt(i) for i in range(8000)]  # coupon collector: ~ 500 * ln(500) needed
    seen = {p.tokens for p in train}
    assert not seen & held
    # Redraws reach every non-held-out prompt, and are as deterministic as first draws.
    assert len(seen) == space - space // 2
    again = make_task(cfg)
    assert [again.prompt(i) for i in range(7999, -1, -1)][::-1] == train
