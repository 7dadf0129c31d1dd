"""`cadence launch slurm`: the Launcher that submits and follows one batch job (launcher), the
driver inside the job that runs and restarts srun steps (job), the SLURM commands it uses
(steps), and a one-node SLURM for tests (local_cluster)."""
