"""AdmissionGate: samples admitted under version v are consumed at most max_staleness steps later."""
import random
import threading

import pytest

from cadence.protocols.admission import AdmissionGate


def simulate(max_staleness, batch_sizes, group=4, seed=0):
    """One actor issuing groups as fast as the gate allows, a FIFO learner; returns staleness seen."""
    rng = random.Random(seed)
    gate = AdmissionGate(batch_sizes[0], max_staleness)
    version = 0
    line = []  # FIFO of (version, n)
    seen = []
    for B in batch_sizes:
        gate.set_batch_size(B)
        # the actor fills as far as admission lets it, in random-sized bursts
        for _ in range(rng.randint(1, 40)):
            if gate.try_admit(group, version):
                line.append(version)
        # learner takes a batch (if the line holds one) and then publishes the next version
        if len(line) * group < B:
            while gate.try_admit(group, version):
                line.append(version)
        need = B // group
        if len(line) < need:
            continue  # the bound stops the actor: it must wait for the learner
        step = gate.steps_taken
        kept = []
        while len(kept) < need and line:
            v = line.pop(0)
            if gate.is_too_stale(v, step):
                gate.drop(group)
                continue
            kept.append(v)
        if len(kept) < need:
            line[:0] = kept  # not enough: give back (simulation only)
            continue
        gate.take_batch(B)
        seen.extend(step - v for v in kept)
        version = step + 1
    return seen


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_constant_batch_never_exceeds_bound(eta):
    seen = simulate(eta, [32] * 60)
    assert len(seen) > 100
    assert max(seen) <= eta
    if eta == 0:
        assert set(seen) == {0}
    else:
        assert max(seen) == eta  # an eager actor runs as far ahead as allowed


def test_admission_counts_in_samples_when_batch_grows():
    # Growing B never creates over-stale samples: the line ahead is consumed faster.
    seen = simulate(2, [16] * 20 + [64] * 20 + [32] * 20)
    assert max(seen) <= 2


def test_sync_gate_blocks_until_version_published():
    gate = AdmissionGate(8, 0)
    assert gate.try_admit(8, 0)         # the batch for step 0, under version 0
    assert not gate.try_admit(8, 0)     # a second batch would be consumed at step 1: stale
    gate.take_batch(8)                  # learner trains step 0; version is still 0
    assert not gate.try_admit(8, 0)
    assert gate.try_admit(8, 1)         # version 1 published: next batch allowed


def test_admit_blocks_then_wakes_on_new_version():
    gate = AdmissionGate(4, 0)
    version = [0]
    assert gate.admit(4, lambda: version[0], timeout=1.0) == 0
    got = []
    t = threading.Thread(target=lambda: got.append(gate.admit(4, lambda: version[0], timeout=5.0)))
    t.start()
    gate.take_batch(4)
    t.join(0.2)
    assert t.is_alive() and not got  # still blocked: version 0 would be stale at step 1
    version[0] = 1
    gate.notify()
    t.join(5.0)
    assert got == [1]


def test_admit_times_out_and_close_releases():
    gate = AdmissionGate(4, 0)
    assert gate.admit(4, lambda: 0, timeout=0.5) == 0
    assert gate.admit(4, lambda: 0, timeout=0.1) is None
    gate.close()
    assert gate.admit(4, lambda: 5, timeout=1.0) is None


def test_drop_frees_slots_and_bad_arguments_rejected():
    gate = AdmissionGate(4, 0)
    assert gate.try_admit(4, 0)
    assert not gate.try_admit(4, 0)
    gate.drop(4)
    assert gate.try_admit(4, 0)
    with pytest.raises(ValueError, match="max_staleness"):
        AdmissionGate(4, -1)
    with pytest.raises(ValueError, match="batch_size"):
        AdmissionGate(0, 1)
