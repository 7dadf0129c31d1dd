"""`cadence launch ray`: the Launcher (launcher), its watch loop (driver), the learner group
(learner_hosts), the actor fleet and log gathering (fleet), placement bundles (placement), one
process inside a Ray actor (hosts), and a local two-node cluster for tests and benchmarks
(local_cluster)."""
