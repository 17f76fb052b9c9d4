"""An engines-only job joins a running run on tools/slurm-dev's cluster and is cancelled mid-rollout.

pytest tests/e2e/test_slurm_join.py              # starts the cluster when it is not up (root)
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from hpcrl.cli import main
from tests.support import SlurmCluster, check_metrics, real_config, result, wait_for

pytestmark = pytest.mark.slurm

STEPS = 40


def _events(run_dir: Path, kind: str) -> list[dict]:
    from hpcrl.store import load_events
    from hpcrl.store.metrics import StoreError

    try:
        return [e for e in load_events(run_dir / "metrics.h5") if e["kind"] == kind]
    except (OSError, StoreError, KeyError):  # not written yet, or being written
        return []


@pytest.mark.slow
def test_an_engine_job_joins_a_running_async_run_and_its_scancel_loses_no_group(
    slurm_cluster: SlurmCluster,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hpcrl.rollout.ledger import ledger_problems
    from hpcrl.slurm.executor import submit_run
    from hpcrl.store import load_metrics

    monkeypatch.chdir(tmp_path)  # the join job runs (and logs) here
    run_dir = tmp_path / "run"
    sft = {"num_steps": 0, "batch_size": 16, "lr": 3e-3, "log_every_steps": 10}
    overrides = {"num_steps": STEPS, "sft": sft, "sync.transport": "disk_delta", "rollout.mode": "async"}
    job = submit_run(real_config(tiny_model_dir, **overrides), run_dir)
    # Submitted with the run: the join job's engine starts while the run's do, and waits for the run's identity.
    assert main(["submit", "--engines-only", "--join", str(run_dir)]) == 0
    join_id = capsys.readouterr().out.split("job ", 1)[1].split()[0]
    wait_for(lambda: _events(run_dir, "engine_joined"), 400, "the run to admit the joined engine")
    joined = _events(run_dir, "engine_joined")[0]["detail"]
    assert joined["job_id"] == join_id
    time.sleep(1.0)  # into a rollout with its requests in flight
    subprocess.run(["scancel", join_id], check=True)
    assert slurm_cluster.wait_done(join_id, 120) in {"CANCELLED", "COMPLETED"}
    outcome = result(job, slurm_cluster, 600)
    assert outcome["final_model"]
    check_metrics(run_dir, STEPS)
    m = load_metrics(run_dir / "metrics.h5")
    assert m["fleet/engines_joined"].sum() == 1 and m["fleet/engines_left"].sum() == 1
    assert m["fleet/engines_live"].max() == 2 and m["fleet/engines_live"][-1] == 1
    # It joined with the version the run had just pushed, and left without a group lost.
    assert joined["version"] in set(m["sync/weight_version"].astype(int))
    ledger = json.loads((run_dir / "prompt_ledger.json").read_text())
    assert ledger_problems(ledger, num_drawn=ledger["next_position"], prompts_per_step=4) == []
    assert sorted({s for s in ledger["step"] if s is not None}) == list(range(STEPS))
    print(f"joined at version {joined['version']}, {int(m['fleet/reissued_requests'].sum())} requests re-issued")
