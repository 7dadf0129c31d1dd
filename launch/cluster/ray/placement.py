"""Where Ray puts a launch's processes: placement-group bundles from the launch.* keys.

    pg = place(cfg.launch, size=2, wait=600.0)      # 2 learner bundles, or None after `wait` s
    Host.options(**host_options(cfg.launch, "learner", pg, index=0, max_restarts=0)).remote(...)
    capacity_free(cfg.launch, 1, group_nodes)       # could the group grow by one bundle, its way?

A bundle is `launch.{learner,actor}_cpus` CPUs, `_gpus` GPUs and the custom resources
`_resources` ("name=amount"); the learner's bundles go in one group (`launch.learner_strategy`),
each actor's in a group of its own.
"""
from __future__ import annotations

import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group, remove_placement_group
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


def capacity_free(launch, missing: int, group_nodes=()) -> bool:
    """Could the group, restarted with `missing` more learner bundles, be placed now under its own
    strategy (launch.learner_strategy)? `group_nodes`: the node ids its processes hold now (their
    bundles free up when it restarts). A probe, released at once:
      STRICT_SPREAD  the missing bundles, each on a node of its own that holds none of the group's;
      STRICT_PACK    all on one node: the group's, with room for `missing` more, or another node
                     with room for the whole group;
      PACK, SPREAD   the missing bundles anywhere (soft strategies place wherever there is room).
    A probe that ignored the strategy said yes to room beside the group's own process, which a
    STRICT_SPREAD group cannot use: the group restarted and shrank again."""
    strategy, nodes = launch.learner_strategy, sorted(set(filter(None, group_nodes)))
    if strategy == "STRICT_SPREAD" and nodes:
        return _probe(launch, missing, strategy, _on_nodes(nodes, exclude=True))
    if strategy == "STRICT_PACK" and nodes:
        return (_probe(launch, missing, strategy, _on_nodes(nodes, exclude=False)) or
                _probe(launch, missing + len(group_nodes), strategy, _on_nodes(nodes, exclude=True)))
    return _probe(launch, missing, strategy, None)


def _on_nodes(nodes: list[str], exclude: bool) -> dict[str, str]:
    """A bundle label selector: on one of `nodes`, or (exclude) on none of them."""
    return {NODE_ID_LABEL_KEY: ("!" if exclude else "") + f"in({','.join(nodes)})"}


def _probe(launch, n: int, strategy: str, selector: dict | None) -> bool:
    kwargs = {"bundle_label_selector": [selector] * n} if selector else {}
    probe = placement_group([bundle(launch, "learner")] * n, strategy=strategy, **kwargs)
    ready, _ = ray.wait([probe.ready()], timeout=2.0)
    remove_placement_group(probe)
    return bool(ready)
