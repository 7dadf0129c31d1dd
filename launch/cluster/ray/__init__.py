"""`cadence launch ray`: the learner and actor processes placed and restarted on a Ray cluster
(launcher), its hosts (hosts), actor fleet (fleet), status (status) and a local two-node cluster
for tests and benchmarks (local_cluster)."""
