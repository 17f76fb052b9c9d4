"""The driver's side of a run (trainer rank 0): what runs where, and the parts it wires together.

- `prepare.py`  — checks and the model dir, before anything is written to the run dir
- `placement.py` — what runs where: local processes, Slurm roles, MPI ranks (trainer ranks, engines)
- `run.py`      — `Run`, which builds every part from the config and closes them in order

The loop itself is hpcrl/driver.py; each part lives in its role's folder (rollout/, trainer/, sync/, store/).
"""
