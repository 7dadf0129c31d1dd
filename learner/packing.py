"""Token-budget microbatches: samples packed several to a row (learner.microbatch_tokens > 0).

The padded layout (learner/batching.py) gives every sample a whole row of seq_len columns, so a
batch of short completions and one long one pays seq_len per sample. Here each sample (prompt +
completion, the same tokens as there) goes into the first row with room, longest first (first-fit
decreasing), and a row holds as many as fit:

  tokens     [p p c c c | p p p c c | pad pad]      two sequences and padding in one row
  mask       [1 1 1 1 1 | 2 2 2 2 2 | 0   0  ]      segment ids: 1..k per row, 0 = padding
  positions  [0 1 2 3 4 | 0 1 2 3 4 | 0   0  ]      restart at 0 for each sequence (RoPE)
  loss_mask  [0 0 1 1 1 | 0 0 0 1 1 | 0   0  ]      as in the padded layout
  advantages [a a a a a | b b b b b | 0   0  ]      per token: its sequence's advantage

The model confines attention to a token's own segment (learner/models/llama.attention_allowed),
and the sequence-level parts of the loss treat each segment as a sequence, so a packed batch has
the padded batch's loss and gradient. A segment's first token is always a prompt token (loss
mask 0): its log-prob would be scored from the previous segment's last position.

Shapes stay fixed: rows are seq_len long (longest prompt + completion budget, the padded row) and
a microbatch holds rows_per_microbatch = microbatch_tokens // seq_len of them, so the jitted step
sees one shape; only the number of microbatches follows the batch's real token count. Keeping the
row at seq_len also keeps attention's cost per row (quadratic in the row length) what it is
padded.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from cadence.learner import segments
from cadence.learner.batching import Microbatch, _advantages_per_group, _packed_groups, batch_stats, build_microbatches


def rows_per_microbatch(microbatch_tokens: int, seq_len: int, row_multiple: int = 1) -> int:
    """Rows of seq_len columns per microbatch for a token budget.

    Raises:
      ValueError naming learner.microbatch_tokens: a budget below one row, or one whose rows do
      not split over `row_multiple` devices (data x fsdp of a mesh).
    """
    if microbatch_tokens < seq_len:
        raise ValueError(f"learner.microbatch_tokens: {microbatch_tokens} is less than one row of "
                         f"{seq_len} tokens (learner.row_tokens, or seq_len: longest prompt + "
                         "engine.max_new_tokens, rounded up to 8); set it to a multiple of the row")
    rows = microbatch_tokens // seq_len
    if rows % row_multiple:
        raise ValueError(f"learner.microbatch_tokens: {microbatch_tokens} // rows of {seq_len} tokens = {rows} "
                         f"rows per microbatch do not split over data x fsdp = {row_multiple} devices")
    return rows


def packed_row_len(learner_cfg, seq_len: int) -> int:
    """The length of a packed row: learner.row_tokens, or seq_len when that is 0 (and for the
    one-sample-per-row layout, whose rows are seq_len).

    Raises:
      ValueError naming learner.row_tokens: a row shorter than seq_len (a sample must fit one).
    """
    rows = learner_cfg.row_tokens
    if learner_cfg.microbatch_tokens <= 0 or not rows:
        return seq_len
    if rows < seq_len:
        raise ValueError(f"learner.row_tokens: {rows} is shorter than seq_len = {seq_len} (longest prompt + "
                         "engine.max_new_tokens, rounded up to 8): a sample must fit one row")
    return rows


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Places items of `lengths` (each <= capacity) into rows of `capacity`: longest first, each
    into the first row with room.

    Returns:
      (row [N], offset [N] (first column), segment [N] (1..k within its row, in placement order),
      number of rows used).
    """
    n = len(lengths)
    row, offset, segment = (np.zeros(n, np.int64) for _ in range(3))
    free = np.zeros(n, np.int64)  # room left in each opened row
    count = np.zeros(n, np.int64)  # segments in each opened row
    used = 0
    for i in np.argsort(-np.asarray(lengths), kind="stable"):
        length = int(lengths[i])
        fits = np.flatnonzero(free[:used] >= length)
        if fits.size:
            r = int(fits[0])
        else:
            r, used = used, used + 1
            free[r] = capacity
        row[i], offset[i] = r, capacity - free[r]
        free[r] -= length
        count[r] += 1
        segment[i] = count[r]
    return row, offset, segment, used


def _place_units(lengths: np.ndarray, bounds, seq_len: int, rows_per_mb: int):
    """Items of `lengths` placed first-fit decreasing into rows of seq_len, the items of each unit
    (bounds: the item index where each starts, then the end) into microbatches of their own.

    Returns:
      (row [N], offset [N], segment [N] (1..k in its row), microbatches of each unit, rows used).
    """
    row, offset, segment = (np.zeros(len(lengths), np.int64) for _ in range(3))
    unit_mbs, used, first_row = [], 0, 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        r, o, sg, n_rows = first_fit_decreasing(lengths[a:b], seq_len)
        row[a:b], offset[a:b], segment[a:b] = r + first_row, o, sg
        unit_mbs.append(max(1, -(-n_rows // rows_per_mb)))
        used += n_rows
        first_row += unit_mbs[-1] * rows_per_mb
    return row, offset, segment, unit_mbs, used


def _split_rows(fields, rows_per_mb: int) -> list[Microbatch]:
    """Microbatches of rows_per_mb rows from whole-batch (tokens, positions, mask, loss_mask,
    behavior_logprobs, advantages) arrays."""
    return [Microbatch(*(x[i : i + rows_per_mb] for x in fields), rewards=None)
            for i in range(0, len(fields[0]), rows_per_mb)]


def _trained_and_behavior(src, behavior, policy, kept_mass, nucleus: bool, truncation_kl: list):
    """(loss mask, behavior log-probs) of the completion tokens at flat indices `src` (0 where the
    policy mask says a token was not sampled by the policy); top-p's -kept_logmass of the trained
    tokens is appended to truncation_kl, and with behavior_logprobs "nucleus" taken off."""
    trained = np.ones(len(src), np.float32) if policy is None else policy.values[src].astype(np.float32)
    behavior_values = behavior.values[src] * trained
    if kept_mass is not None:
        kept_values = kept_mass.values[src] * trained
        truncation_kl.append(-kept_values[trained > 0])
        if nucleus:
            behavior_values -= kept_values
    return trained, behavior_values


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the range, position within it) for the concatenation of ranges of `lengths`."""
    lengths = np.asarray(lengths, np.int64)
    which = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return which, within


def pack_microbatches(
    groups: Sequence[Any], seq_len: int, rows_per_mb: int, pad_id: int, grpo_cfg,
    unit_groups: Sequence[int] | None = None, share_prompts: bool = False,
) -> tuple[list[Microbatch], dict]:
    """Lays out rollout groups packed several samples to a row (see the module docstring).

    Args:
      groups: RolloutGroup-like objects, as for learner.batching.build_microbatches.
      seq_len: T, the row length; a sample longer than that has its completion cut (counted in
        stats["truncated_samples"]), as in the padded layout.
      rows_per_mb: rows per microbatch (rows_per_microbatch).
      pad_id: token id of padding.
      grpo_cfg: GRPOConfig (advantages; behavior_logprobs "nucleus").
      unit_groups: groups per unit, in order (summing to len(groups)): each unit of whole groups
        is packed into microbatches of its own (split_units); None: one unit.
      share_prompts: a group's completions in a row share one copy of its prompt (see
        _pack_shared); stats then has shared_prompt_tokens (prompt tokens not laid out).

    Returns:
      (microbatches of [rows_per_mb, T]: mask = int32 segment ids, advantages [rows_per_mb, T]
      per token, rewards None; stats as build_microbatches's, plus packed_rows (rows holding a
      sequence), row_fill (real tokens / tokens of all microbatches) and unit_microbatches
      (microbatches of each unit, in order)).

    Raises:
      ValueError: as build_microbatches.
    """
    if not groups:
        raise ValueError("pack_microbatches: no groups")
    if rows_per_mb < 1:
        raise ValueError(f"pack_microbatches: rows_per_mb must be >= 1, got {rows_per_mb}")
    packed = _packed_groups(groups, seq_len)
    advantages = _advantages_per_group(groups, grpo_cfg)

    # Every sample's kept length, then where it goes.
    prompt_lens = [len(g.prompt_tokens) for g in groups]
    full = [tokens.lengths.astype(np.int64) for tokens, *_ in packed]
    kept = [np.minimum(f, seq_len - p) for f, p in zip(full, prompt_lens)]
    sample_lens = np.concatenate([p + k for p, k in zip(prompt_lens, kept)])
    unit_groups = list(unit_groups or [len(groups)])
    if share_prompts:
        return _pack_shared(groups, packed, advantages, kept, full, seq_len, rows_per_mb, pad_id, grpo_cfg,
                            unit_groups)
    # Each unit of whole groups is packed on its own, into microbatches of its own.
    bounds = np.cumsum([0] + [len(k) for k in kept])[np.cumsum([0] + unit_groups)]  # sample index
    row, offset, segment, unit_mbs, used = _place_units(sample_lens, bounds, seq_len, rows_per_mb)
    num_mb = sum(unit_mbs)
    n_rows = num_mb * rows_per_mb
    shape = (n_rows, seq_len)
    tokens_out = np.full(shape, pad_id, np.int32)
    positions = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    behavior_out = np.zeros(shape, np.float32)
    adv_out = np.zeros(shape, np.float32)

    nucleus = getattr(grpo_cfg, "behavior_logprobs", "full") == "nucleus"
    first, truncated, lengths, trained_tokens, truncation_kl = 0, 0, [], 0, []
    for g, (tokens, behavior, policy, kept_mass), adv, p, k, f in zip(
            groups, packed, advantages, prompt_lens, kept, full):
        n = len(tokens)
        r, o, s = (x[first : first + n] for x in (row, offset, segment))
        first += n
        # The whole sequence (prompt + kept completion): segment id, position, advantage.
        which, within = _ranges(o, p + k)
        cells = (r[which], o[which] + within)
        segment_ids[cells] = s[which]
        positions[cells] = within
        adv_out[cells] = np.asarray(adv, np.float32)[which]
        prompt_cells = within < p
        tokens_out[cells[0][prompt_cells], cells[1][prompt_cells]] = np.tile(np.asarray(g.prompt_tokens, np.int32), n)
        # The completion: flat copies from the packed buffers, as in build_microbatches.
        which, within = _ranges(o, k)
        src = tokens.offsets[:-1][which] + within
        dst = (r[which], o[which] + p + within)
        tokens_out[dst] = tokens.values[src]
        trained, behavior_out[dst] = _trained_and_behavior(src, behavior, policy, kept_mass, nucleus, truncation_kl)
        loss_mask[dst] = trained
        truncated += int((k < f).sum())
        lengths.extend(k.tolist())
        trained_tokens += int(trained.sum())

    microbatches = _split_rows((tokens_out, positions, segment_ids, loss_mask, behavior_out, adv_out), rows_per_mb)
    stats = batch_stats(groups, advantages, trained_tokens, len(sample_lens), num_mb, lengths,
                        truncated, truncation_kl)
    stats["packed_rows"] = int(used)
    stats["row_fill"] = float(sample_lens.sum() / (n_rows * seq_len))
    stats["unit_microbatches"] = unit_mbs
    return microbatches, stats


def _prompt_chunks(prompt_len: int, kept: np.ndarray, seq_len: int) -> list[list[int]]:
    """A group's samples (in order) cut into chunks that each fit one row with the shared prefix:
    prefix (prompt_len - 1 tokens) + per sample its last prompt token and its kept completion."""
    chunks, chunk, used = [], [], prompt_len - 1
    for j, k in enumerate(kept):
        if chunk and used + 1 + int(k) > seq_len:
            chunks.append(chunk)
            chunk, used = [], prompt_len - 1
        chunk.append(j)
        used += 1 + int(k)
    return chunks + [chunk]


def _pack_shared(groups, packed, advantages, kept, full, seq_len, rows_per_mb, pad_id, grpo_cfg, unit_groups):
    """pack_microbatches with shared prompts: a group's completions in one row follow a single
    copy of its prompt instead of one each, so a prompt of P tokens costs P - 1 + one token per
    completion instead of P per completion (GRPO samples G completions per prompt):

      tokens     [p p | p c c c | p c c | pad]      the prefix, then two completions of its group
      sequence   [1 1 | 2 2 2 2 | 3 3 3 | 0  ]      learner/segments.py: ids 1..k per row
      prefix     [0 0 | 1 1 1 1 | 1 1 1 | 0  ]      the prefix each token also attends to
      positions  [0 1 | 2 3 4 5 | 2 3 4 | 0  ]      as if each completion followed the whole prompt
      loss_mask  [0 0 | 0 1 1 1 | 0 1 1 | 0  ]

    The prompt's last token is repeated at the head of each completion, whose first token is
    scored from it, so every token sees what it sees unshared, at the same position: the same
    log-probs, loss and gradient (the prefix's gradient is the sum of its copies'). A group whose
    completions do not fit one row is cut into chunks (_prompt_chunks), a prefix each; chunks of
    all groups are then placed first-fit decreasing, each unit of groups apart."""
    nucleus = getattr(grpo_cfg, "behavior_logprobs", "full") == "nucleus"
    items = []  # (group, samples, length), unit after unit
    bounds = [0]  # item index where each unit starts, then the end
    ends = np.cumsum([0, *unit_groups])
    for a, b in zip(ends[:-1], ends[1:]):
        for gi in range(a, b):
            p = len(groups[gi].prompt_tokens)
            for chunk in _prompt_chunks(p, kept[gi], seq_len):
                items.append((gi, chunk, p - 1 + sum(1 + int(kept[gi][j]) for j in chunk)))
        bounds.append(len(items))
    lengths = np.array([n for *_, n in items], np.int64)
    row, offset, _, unit_mbs, used = _place_units(lengths, bounds, seq_len, rows_per_mb)
    num_mb = sum(unit_mbs)
    shape = (num_mb * rows_per_mb, seq_len)
    tokens_out = np.full(shape, pad_id, np.int32)
    positions, segments_out = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    loss_mask, behavior_out, adv_out = (np.zeros(shape, np.float32) for _ in range(3))
    next_id = np.ones(shape[0], np.int64)  # the next sequence id of each row
    trained_tokens, truncation_kl = 0, []
    for i in np.lexsort((offset, row)):  # row by row, left to right: ids 1..k in order
        gi, chunk, _ = items[i]
        tokens, behavior, policy, kept_mass = packed[gi]
        prompt = np.asarray(groups[gi].prompt_tokens, np.int32)
        p, r, col, prefix = len(prompt), int(row[i]), int(offset[i]), 0
        if p > 1:  # the shared prefix: its own sequence, no loss
            prefix, next_id[r] = int(next_id[r]), next_id[r] + 1
            tokens_out[r, col : col + p - 1] = prompt[:-1]
            positions[r, col : col + p - 1] = np.arange(p - 1)
            segments_out[r, col : col + p - 1] = segments.encode(prefix)
            col += p - 1
        for j in chunk:
            k = int(kept[gi][j])
            sid, next_id[r] = int(next_id[r]), next_id[r] + 1
            cells = slice(col, col + 1 + k)
            src = tokens.offsets[j] + np.arange(k)
            tokens_out[r, col] = prompt[-1]
            tokens_out[r, col + 1 : col + 1 + k] = tokens.values[src]
            positions[r, cells] = np.arange(p - 1, p + k)
            segments_out[r, cells] = segments.encode(sid, prefix)
            adv_out[r, cells] = advantages[gi][j]
            trained, behavior_out[r, col + 1 : col + 1 + k] = _trained_and_behavior(
                src, behavior, policy, kept_mass, nucleus, truncation_kl)
            loss_mask[r, col + 1 : col + 1 + k] = trained
            trained_tokens += int(trained.sum())
            col += 1 + k
    microbatches = _split_rows((tokens_out, positions, segments_out, loss_mask, behavior_out, adv_out), rows_per_mb)
    truncated = sum(int((k < f).sum()) for k, f in zip(kept, full))
    stats = batch_stats(groups, advantages, trained_tokens, sum(len(k) for k in kept), num_mb,
                        np.concatenate(kept).tolist(), truncated, truncation_kl)  # per sample, in group order
    stats["packed_rows"] = int(used)
    stats["row_fill"] = float(lengths.sum() / (shape[0] * seq_len))
    unshared = sum(len(g.prompt_tokens) * len(k) for g, k in zip(groups, kept))
    laid_out = sum(len(groups[gi].prompt_tokens) - 1 + len(chunk) for gi, chunk, _ in items)
    stats["shared_prompt_tokens"] = int(unshared - laid_out)
    stats["unit_microbatches"] = unit_mbs
    return microbatches, stats


def split_units(num_groups: int, units: int, step: int = 1) -> list[int]:
    """Groups per unit when `num_groups` consecutive groups are cut into up to `units` units of whole
    groups, as evenly as cuts every `step` groups allow (fewer units when there are fewer places
    to cut: one group, one unit)."""
    cuts = np.arange(step, num_groups, step)  # allowed boundaries strictly inside
    want = min(max(units, 1), len(cuts) + 1)
    if want <= 1:
        return [num_groups]
    chosen: list[int] = []
    for k in range(1, want):  # the allowed cut nearest each even split point, each used once
        free = [c for c in cuts if c not in chosen]
        chosen.append(int(min(free, key=lambda c: abs(c - k * num_groups / want))))
    edges = [0, *sorted(chosen), num_groups]
    return [b - a for a, b in zip(edges[:-1], edges[1:])]



def layout_microbatches(groups: Sequence, seq_len: int, microbatch_size: int, microbatch_tokens: int, pad_id: int,
                        grpo_cfg, units: int = 0, separate_flat: bool = False, share_prompts: bool = False,
                        ) -> tuple[list[Microbatch], dict]:
    """A batch's microbatches as the learner's config lays them out: packed to microbatch_tokens
    when it is > 0, else one sample per row, microbatch_size rows each (what a train step built
    from the same config expects: its loss reads segment ids only when packed).

    units >= 2: the groups also split into units of whole groups, consecutive microbatches each
    (the noise scale's small batches, learner/controller/noise.py): packed, into up to `units`
    units, each filling microbatches of its own; one sample per row, at every place a microbatch
    and a group end together (no layout change, so as many as there are). stats then has
    unit_microbatches and unit_samples (one unit where the batch cannot be cut: one group).

    separate_flat: within each unit, the groups whose advantages are all zero come after the
    others and (packed) fill microbatches of their own, so a train step with
    learner.skip_zero_advantage can skip them whole (one sample per row: every microbatch after
    the unit's last group with a signal). The units keep their groups; stats["flat_groups"].

    share_prompts (packed only, learner.share_prompts): a group's completions in a row share one
    copy of its prompt (pack_microbatches)."""
    num_samples = sum(len(g.rewards) for g in groups)
    sizes = {len(g.rewards) for g in groups}
    unit_groups, step = None, 1
    if units >= 2:
        if microbatch_tokens > 0:
            unit_groups = split_units(len(groups), units)
        elif len(sizes) == 1:  # equal groups of G: a cut wherever a group and a microbatch end together
            g = next(iter(sizes))  # (free there: as many units as such places, however few were asked for)
            step = math.lcm(g, microbatch_size) // g
            unit_groups = split_units(len(groups), max(units, -(-num_samples // microbatch_size)), step)
        else:
            unit_groups = [len(groups)]
    bounds = np.cumsum([0, *(unit_groups or [len(groups)])])
    parts = list(unit_groups or [len(groups)])  # groups of each separately packed part, in order
    if separate_flat:
        flat = [not np.any(a) for a in _advantages_per_group(groups, grpo_cfg)]
        order, parts = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):  # signal first, then flat, within each unit
            signal = [i for i in range(a, b) if not flat[i]]
            order += signal + [i for i in range(a, b) if flat[i]]
            parts += [n for n in (len(signal), b - a - len(signal)) if n]
        groups = [groups[i] for i in order]
    if microbatch_tokens > 0:
        mbs, stats = pack_microbatches(groups, seq_len, rows_per_microbatch(microbatch_tokens, seq_len), pad_id,
                                       grpo_cfg, parts if len(parts) > 1 else None, share_prompts)
        if unit_groups is not None:  # the parts' microbatches summed back into their units
            part_mbs, counts, k = iter(stats["unit_microbatches"]), [], 0
            part_ends = np.cumsum(parts)
            for end in bounds[1:]:
                n = 0
                while k < len(part_ends) and part_ends[k] <= end:
                    n, k = n + next(part_mbs), k + 1
                counts.append(n)
            stats["unit_microbatches"] = counts
    else:
        if share_prompts:
            raise ValueError("share_prompts: needs packed rows (learner.microbatch_tokens > 0)")
        mbs, stats = build_microbatches(groups, seq_len, microbatch_size, pad_id, grpo_cfg)
        if unit_groups is not None:
            if len(sizes) == 1:
                g = next(iter(sizes))
                counts = [n * g // microbatch_size for n in unit_groups]
                counts[-1] = len(mbs) - sum(counts[:-1])  # the last one holds the batch's part-filled end
            else:
                counts = [len(mbs)]
            stats["unit_microbatches"] = counts
    if unit_groups is None:
        stats.pop("unit_microbatches", None)
    else:
        ends = np.cumsum([0, *unit_groups])
        stats["unit_samples"] = [sum(len(g.rewards) for g in groups[a:b]) for a, b in zip(ends[:-1], ends[1:])]
    if separate_flat:
        stats["flat_groups"] = int(sum(flat))
    return mbs, stats
