"""Launching and watching runs: the `cadence` command (cli), the config tree (config, config_loader),
and three rooms: run/ (one training job's wiring), cluster/ (placing processes: supervisor, learner
hosts, Ray) and observe/ (sinks, status, report). What two of them share sits here: the run
directory's layout (artifacts), metrics and clocks (metrics), the compile cache, host memory."""
