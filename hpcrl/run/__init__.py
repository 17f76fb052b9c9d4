"""The driver's side of a run (trainer rank 0): what runs where, and the parts it wires together.

- `prepare.py`  — checks, the SFT batches and the evaluation prompts, before anything is written to the run dir
- `claim.py`    — `RunDirClaim`: the run dir locked, checked, and left as found by a start that fails early
- `placement.py` — what runs where: local processes, Slurm roles, MPI ranks (trainer ranks, engines)
- `run.py`      — `Run`, which builds every part from the config and closes them in order

The loop itself is hpcrl/driver.py; each part lives in its role's folder (rollout/, trainer/, sync/, store/).
"""
