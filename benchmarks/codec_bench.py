"""Codec speed: encode+decode round trips per second of a RolloutGroup vs bare msgpack.

Baseline: `msgspec.msgpack.encode` / `decode` of an equivalent plain dict (no envelope, no types,
no validation). Ours: `protocols.codec.encode` / `decode` (envelope, typed decode, validation).
`validate_us` is the time of the message's own consistency checks, which decode runs once and the
baseline never does. Prints one JSON line. Run: `.venv/bin/python benchmarks/codec_bench.py [--seconds 0.5]`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time

import msgspec

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from cadence.protocols.codec import decode, encode  # noqa: E402
from cadence.protocols.messages import EngineTimings, RolloutGroup  # noqa: E402

SHAPES = ((8, 8), (16, 1024))  # (completions G, tokens per completion T)


def make_group(group_size: int, num_tokens: int, seed: int = 0) -> RolloutGroup:
    rng = random.Random(seed)
    tokens = [[rng.randrange(32000) for _ in range(num_tokens)] for _ in range(group_size)]
    logprobs = [[-rng.expovariate(1.0) for _ in range(num_tokens)] for _ in range(group_size)]
    return RolloutGroup(
        prompt_id="bench-0", task="bench", prompt_tokens=[rng.randrange(32000) for _ in range(128)],
        completion_tokens=tokens, behavior_logprobs=logprobs,
        rewards=[float(rng.random() < 0.5) for _ in range(group_size)],
        exact_match=[bool(rng.random() < 0.5) for _ in range(group_size)], policy_version=12,
        actor_id="actor-0",
        timings=EngineTimings(queued_at=1.0, started_at=2.0, finished_at=3.0, generate_seconds=1.0,
                              num_tokens=group_size * num_tokens, engine="jax"),
    )


def round_trips_per_second(round_trip, seconds: float, repeats: int = 3) -> float:
    """Best of `repeats` timed runs, each at least `seconds` long."""
    round_trip()  # warm up
    best = 0.0
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            for _ in range(8):
                round_trip()
            n += 8
        best = max(best, n / elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="length of each timed run")
    args = parser.parse_args()
    result: dict[str, object] = {"benchmark": "codec_round_trip"}
    for group_size, num_tokens in SHAPES:
        group = make_group(group_size, num_tokens)
        plain = msgspec.to_builtins(group, builtin_types=(bytes,))  # the same content as a plain dict
        ours = round_trips_per_second(lambda: decode(encode(group)), args.seconds)
        bare = round_trips_per_second(
            lambda: msgspec.msgpack.decode(msgspec.msgpack.encode(plain)), args.seconds
        )
        checks = round_trips_per_second(group.validate, args.seconds)  # the part bare msgpack skips
        key = f"g{group_size}_t{num_tokens}"
        result[key] = {
            "bytes": len(encode(group)),
            "cadence_round_trips_per_s": round(ours, 1),
            "baseline_round_trips_per_s": round(bare, 1),
            "ratio_cadence_over_baseline": round(ours / bare, 3),
            "validate_us": round(1e6 / checks, 2),  # runs once per round trip, inside decode
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
