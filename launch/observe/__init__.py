"""Watching a run: metric sinks (TensorBoard, W&B, Prometheus, heartbeat), `cadence status`,
`cadence report` and its plots. Imports nothing from run/ or cluster/."""
