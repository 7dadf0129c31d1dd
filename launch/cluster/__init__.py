"""Placing processes: actor processes under a supervisor, learner hosts over jax.distributed
(learner_group), one actor process's main (actor_process), and Ray (ray/). Imports nothing from
run/ or observe/."""
