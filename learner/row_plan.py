"""Rows per device on the mesh the learner got: a microbatch that splits over data x fsdp.

    plan = plan_rows(cfg.learner, rows=3)   # a 4-process learner restarted on 3
    plan.learner.microbatch_size            # 24: 8 rows per device (32 did not split over 3)
    plan.notes                              # what changed and why, for the run's log
    nearest_multiple(128, 24)               # 120: the batch size the controller moves to

An elastic learner restarts on whatever devices are left (or came back), so a microbatch that
split over 4 devices may not split over 3. Instead of refusing, the microbatch becomes a multiple
of the row devices no larger than the configured one (the configured microbatch bounds activation
memory per device); among those, the one whose batch size stays nearest the configured batch
(ratio distance), then the largest. The batch size itself belongs to the controller
(`Controller.fit`): it moves the B in force to the nearest multiple of group x microbatch, with
the square-root rule's Adam values, and logs it as a decision. The configured batch size stays
in the returned config as the rule's reference point (it may then not be a multiple of the
re-planned microbatch: the controller's fit makes the B in force one).

Pure: the same config and row count give the same plan in every learner process.
"""
from __future__ import annotations

import dataclasses
import math

from cadence.learner.config import LearnerConfig


@dataclasses.dataclass(frozen=True)
class RowPlan:
    learner: LearnerConfig  # the config to build the learner with (microbatch, warm-up batch re-planned)
    notes: tuple[str, ...]  # one line per change, for the log; () when nothing changed


def nearest_multiple(batch_size: int, multiple: int) -> int:
    """The positive multiple of `multiple` nearest to batch_size in ratio (|log(b' / b)|): batch_size
    itself when it is one; a tie goes to the larger."""
    if batch_size % multiple == 0:
        return batch_size
    below = batch_size // multiple * multiple
    above = below + multiple
    if below == 0:
        return above
    return below if math.log(batch_size / below) < math.log(above / batch_size) else above


def plan_microbatch(microbatch_size: int, batch_size: int, group_size: int, rows: int,
                    minibatches: int = 1) -> int:
    """A microbatch that splits over `rows` devices (see the module docstring): microbatch_size
    itself when it does, else a multiple of rows <= max(microbatch_size, rows)."""
    if microbatch_size % rows == 0:
        return microbatch_size
    best, best_cost = rows, None
    for m in range(max(microbatch_size // rows, 1) * rows, 0, -rows):  # largest first: ties keep it
        b = nearest_multiple(batch_size, math.lcm(group_size, m))
        if b // m < minibatches:  # each optimizer update needs a microbatch of its own
            continue
        cost = abs(math.log(b / batch_size))
        if best_cost is None or cost < best_cost - 1e-12:
            best, best_cost = m, cost
    return best


def plan_rows(cfg: LearnerConfig, rows: int) -> RowPlan:
    """The learner config re-planned for `rows` row devices (data x fsdp); unchanged when
    everything already splits."""
    notes = []
    m = plan_microbatch(cfg.microbatch_size, cfg.batch_size, cfg.group_size, rows, cfg.minibatches)
    if m != cfg.microbatch_size:
        notes.append(f"learner.microbatch_size {cfg.microbatch_size} -> {m} ({m // rows} rows on each of "
                     f"data x fsdp = {rows} devices; {cfg.microbatch_size} does not split over them)")
    s = cfg.sft.batch_size
    sft = s if s % rows == 0 else max(s // rows, 1) * rows
    if sft != s:
        notes.append(f"learner.sft.batch_size {s} -> {sft} (a multiple of data x fsdp = {rows})")
    learner = dataclasses.replace(cfg, microbatch_size=m, sft=dataclasses.replace(cfg.sft, batch_size=sft))
    return RowPlan(learner, tuple(notes))


def plan_packed_rows(cfg: LearnerConfig, seq_len: int, rows: int) -> RowPlan:
    """With packing (learner.microbatch_tokens > 0): a token budget whose rows of seq_len split
    over `rows` devices (the largest such at most the configured budget, at least one row per
    device)."""
    budget = cfg.microbatch_tokens
    if budget <= 0 or budget < seq_len or (budget // seq_len) % rows == 0:
        return RowPlan(cfg, ())  # off, or too small for one row (packing's own error names it)
    tokens = max(budget // seq_len // rows, 1) * rows * seq_len
    note = (f"learner.microbatch_tokens {budget} -> {tokens} ({tokens // seq_len} rows of seq_len {seq_len} "
            f"split over data x fsdp = {rows} devices)")
    return RowPlan(dataclasses.replace(cfg, microbatch_tokens=tokens), (note,))
