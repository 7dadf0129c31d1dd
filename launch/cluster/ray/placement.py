"""Where Ray puts a launch's processes: placement-group bundles from the launch.* keys.

    pg = place(cfg.launch, size=2, wait=600.0)      # 2 learner bundles, or None after `wait` s
    Host.options(**host_options(cfg.launch, "learner", pg, index=0, max_restarts=0)).remote(...)
    capacity_free(cfg.launch, 1)                    # could one more learner bundle be placed now?

A bundle is `launch.{learner,actor}_cpus` CPUs, `_gpus` GPUs and the custom resources
`_resources` ("name=amount"); the learner's bundles go in one group (`launch.learner_strategy`),
each actor's in a group of its own.
"""
from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def _resources(entries) -> dict[str, float]:
    return {k.strip(): float(v) for k, _, v in (e.partition("=") for e in entries)}


def bundle(launch, role: str) -> dict:
    cpus, gpus, extra = ((launch.learner_cpus, launch.learner_gpus, launch.learner_resources) if role == "learner"
                         else (launch.actor_cpus, launch.actor_gpus, launch.actor_resources))
    b = {"CPU": cpus, **_resources(extra)}
    if gpus:
        b["GPU"] = gpus
    return b


def host_options(launch, role: str, pg, index: int, max_restarts: int) -> dict:
    """`.options()` of a ProcessHost in bundle `index` of `pg`."""
    b = bundle(launch, role)
    return dict(num_cpus=b.get("CPU", 0), num_gpus=b.get("GPU", 0),
                resources={k: v for k, v in b.items() if k not in ("CPU", "GPU")} or None,
                max_restarts=max_restarts, max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index))


def place(launch, size: int, wait: float):
    """A ready placement group of `size` learner bundles, or None after `wait` seconds."""
    pg = placement_group([bundle(launch, "learner")] * size, strategy=launch.learner_strategy)
    ready, _ = ray.wait([pg.ready()], timeout=max(wait, 0.1))
    if ready:
        return pg
    remove_placement_group(pg)
    return None


def capacity_free(launch, missing: int) -> bool:
    """Could `missing` more learner bundles be placed now? (a probe, released at once)"""
    probe = placement_group([bundle(launch, "learner")] * missing, strategy="PACK")
    ready, _ = ray.wait([probe.ready()], timeout=2.0)
    remove_placement_group(probe)
    return bool(ready)
