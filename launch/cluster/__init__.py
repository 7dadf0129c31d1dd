"""Placing processes: the Launcher protocol behind `cadence launch KIND` (launcher) and what every
launch leaves in RUN_DIR/launch (launch_state); Ray (ray/) and SLURM (slurm/) behind it; actor
processes under a supervisor, learner hosts over jax.distributed (learner_group), one actor
process's main (actor_process). Imports nothing from run/ or observe/."""
