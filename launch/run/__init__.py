"""The run: one training job wired from its config (train), its actors and queue (pipeline), resume
and the run directory's state (run_state, recorder), and shutdown on signals (lifecycle).

Imports cluster/ (to start learner and actor processes) and observe/ (to report); neither imports it."""
