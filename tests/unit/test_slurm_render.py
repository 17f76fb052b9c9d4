"""Slurm jobs of a run without a cluster: rendering, quoting, golden scripts, placement checks, the CLI.

    HPCRL_UPDATE_GOLDEN=1 pytest tests/unit/test_slurm_render.py -k golden   # accept new golden scripts

The same jobs on a real Slurm cluster: tests/e2e/test_slurm.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpcrl.cli import main
from hpcrl.config import ConfigError, dump_yaml, from_dict, load_yaml
from hpcrl.run_config import RunConfig, load_run_config
from hpcrl.slurm.cli import render_sbatch, sbatch_command_line
from hpcrl.slurm.config import SlurmConfig
from hpcrl.slurm.join_script import render_join_script
from hpcrl.slurm.render import _config_heredoc, check_placement, directive_value, render_script
from tests.support import (
    GOLDEN,
    HOSTILE_NAME,
    REPO,
    STUB,
    make_config,
)

GOLDEN_CONFIGS = {
    "disaggregated": {
        "name": "golden",
        "engine.num_engines": 4,
        "engine.device": "cuda",
        "train.device": "cuda",
        "slurm.partition": "gpu",
        "slurm.account": "rl-team",
        "slurm.qos": "high",
        "slurm.constraint": "h100&ib",
        "slurm.time_limit": "04:00:00",
        "slurm.signal_delay_s": 300,
        "slurm.engines": {"nodes": 2, "gpus_per_node": 4, "gpus_per_engine": 2, "cpus_per_task": 8, "mem_gb": 200},
        "slurm.engines.extra_sbatch": {"exclusive": ""},
        "slurm.trainer": {"nodes": 2, "tasks_per_node": 4, "gpus_per_task": 1, "cpus_per_task": 16, "mem_gb": 400},
        "slurm.extra_sbatch": {"mail_type": "END", "mail-user": "rl@example.org"},
        "slurm.python": "/opt/venvs/hpcrl/bin/python",
        "slurm.setup": ["module load cuda/12.4"],
        "slurm.env": {"NCCL_DEBUG": "WARN"},
    },
    "colocated": {
        "name": "golden-colocated",
        "engine.num_engines": 4,
        "engine.device": "cuda",
        "train.device": "cuda",
        "slurm.colocate": True,
        "slurm.requeue": False,
        "slurm.time_limit": "2-00:00:00",
        "slurm.engines.gpus_per_engine": 2,
        "slurm.engines.cpus_per_task": 4,
        "slurm.trainer": {"nodes": 1, "tasks_per_node": 8, "gpus_per_task": 1, "cpus_per_task": 12, "mem_gb": 1.5},
    },
}


def _mask_config(text: str) -> str:
    # The embedded config lists every component's fields: the goldens pin the job's shape, not those.
    return re.sub(
        r"(<<'HPCRL_CONFIG_EOF'[^\n]*\n).*?\n(HPCRL_CONFIG_EOF\n)",
        r"\1(the run's config.yaml: masked in the golden file)\n\2",
        text,
        flags=re.S,
    )


# The directory the goldens and sbatch/'s scripts are rendered in: the scripts name every path absolutely.
BASE_DIR = "/path/to/hpcrl"


def _check_golden(text: str, path: Path) -> None:
    if os.environ.get("HPCRL_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; create it: HPCRL_UPDATE_GOLDEN=1 pytest {__file__} -k golden"
    assert text == path.read_text(), (
        f"the rendered script differs from {path}; if the change is intended, refresh it: "
        f"HPCRL_UPDATE_GOLDEN=1 pytest tests/unit/test_slurm_render.py -k golden (and review the diff)"
    )


@pytest.mark.parametrize("kind", sorted(GOLDEN_CONFIGS))
def test_golden_sbatch(kind: str) -> None:
    cfg = make_config(GOLDEN_CONFIGS[kind], model_path="/models/qwen3-8b")
    command = ["hpcrl", "sbatch", f"{kind}.yaml"]
    text = _mask_config(render_script(cfg, f"runs/{cfg.name}", command_line=command, base_dir=BASE_DIR))
    _check_golden(text, GOLDEN / f"sbatch_{kind}.sbatch")


def test_golden_cluster_example(monkeypatch: pytest.MonkeyPatch) -> None:
    """experiments/cluster-example.yaml sets every key of the slurm section: container, log dir, modules, gres."""
    monkeypatch.chdir(REPO)
    config = "experiments/cluster-example.yaml"
    cfg = load_run_config(config)
    assert cfg.slurm.container is not None and cfg.slurm.log_dir and cfg.slurm.modules and cfg.slurm.gpu_type
    unset = [f.name for f in dataclasses.fields(SlurmConfig) if f.name not in load_yaml(config)["slurm"]]
    assert not unset, f"{config} should show every slurm key; it lacks {unset}"
    text = render_sbatch(config, [], None, None, BASE_DIR)
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    _check_golden(_mask_config(text), GOLDEN / "sbatch_cluster_example.sbatch")


def test_sbatch_dir_holds_every_experiment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    stale, experiments = [], sorted(Path("experiments").glob("*.yaml"))
    local_only = [c for c in experiments if "distill" in load_yaml(c)]  # a teacher runs only beside a local run
    assert local_only, "the distillation quickstart is expected among the experiments"
    for config in local_only:
        with pytest.raises(ConfigError, match="distill: the teacher's engines start beside the trainer"):
            render_sbatch(str(config), [], f"sbatch/{config.stem}.sbatch", None, BASE_DIR)
    experiments = [c for c in experiments if c not in local_only]
    for config in experiments:
        out = f"sbatch/{config.stem}.sbatch"
        expected = render_sbatch(str(config), [], out, None, BASE_DIR)
        if not Path(out).exists() or Path(out).read_text() != expected:
            stale.append(shlex.join(sbatch_command_line(str(config), [], out, None, BASE_DIR)))
    orphans = sorted({p.stem for p in Path("sbatch").glob("*.sbatch")} - {c.stem for c in experiments})
    assert not stale, "sbatch/ is stale for some experiments; refresh with:\n  " + "\n  ".join(stale)
    assert not orphans, f"sbatch/ has scripts without an experiments/*.yaml: {orphans}; delete them"


def test_config_round_trips_through_the_script_and_values_stay_text(tmp_path: Path) -> None:
    cfg = dataclasses.replace(make_config(), name=HOSTILE_NAME)
    text = render_script(cfg, str(tmp_path / "run dir $(x)"), role_command=STUB)
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    directive = next(line for line in text.splitlines() if line.startswith("#SBATCH --job-name="))
    assert "\n" not in directive and directive.endswith('"')
    # The body names RUN_DIR once, shell-quoted; the config is in a quoted heredoc.
    assert "RUN_DIR='" in text and "<<'HPCRL_CONFIG_EOF'" in text
    heredoc = text.split("<<'HPCRL_CONFIG_EOF' || exit 1\n", 1)[1].split("\nHPCRL_CONFIG_EOF\n", 1)[0]
    (tmp_path / "embedded.yaml").write_text("\n".join(line[1:] for line in heredoc.split("\n")))
    assert from_dict(RunConfig, load_yaml(tmp_path / "embedded.yaml")) == cfg


def test_embedded_config_has_no_empty_line_and_cannot_end_the_heredoc() -> None:
    # sbatch drops the empty lines of a het job's script (Slurm 22.05): a multi-line string would change.
    lines = _config_heredoc("name: 'a\n\n  HPCRL_CONFIG_EOF\n\n  b'\nseed: 0\n")
    body = lines[lines.index(next(line for line in lines if "<<'" in line)) + 1 : lines.index("HPCRL_CONFIG_EOF")]
    assert body == ["|name: 'a", "|", "|  HPCRL_CONFIG_EOF", "|", "|  b'", "|seed: 0"]


@pytest.mark.parametrize(
    ("value", "rendered"),
    [
        ("quickstart", "quickstart"),
        ("01:00:00", "01:00:00"),
        ("a b", '"a b"'),
        ('say "hi" #1', '"say \\"hi\\" #1"'),
        ("back\\slash", '"back\\\\slash"'),
        ("two\nlines", '"two lines"'),
    ],
)
def test_directive_values_are_quoted_for_sbatch(value: str, rendered: str) -> None:
    assert directive_value(value) == rendered


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"slurm.extra_sbatch": {"mial-type": "END"}}, "did you mean 'mail-type'"),
        ({"slurm.extra_sbatch": {"partition": "gpu"}}, "set slurm.partition instead"),
        ({"slurm.trainer.extra_sbatch": {"gpus-per-task": 1}}, "slurm.trainer.gpus_per_task"),
        ({"slurm.time_limit": "1h"}, "not a Slurm time"),
        ({"slurm.time_limit": "00:01:00", "slurm.signal_delay_s": 120}, "lower signal_delay_s"),
        ({"slurm.engines.gpus_per_node": 4, "slurm.engines.gpus_per_engine": 3}, "multiple of gpus_per_engine"),
        ({"slurm.partition": " "}, "partition is empty"),
        ({"slurm.env": {"1BAD": "x"}}, "not a variable name"),
        ({"slurm.extra_sbatch": {"output": "/logs/%j.out"}}, "set slurm.log_dir (the job log is LOG_DIR/"),
        ({"slurm.extra_sbatch": {"gres": "gpu:a100:4"}}, "set slurm.gpu_type"),
        ({"slurm.gpu_type": "h100:4"}, "not a gres type name"),
        ({"slurm.modules": ["cuda/12.4; rm -rf /"]}, "one module per entry, shell code goes in slurm.setup"),
        ({"slurm.container": {"image": "x.sif", "binds": ["/a,/b"]}}, "one path per entry, no commas"),
        ({"slurm.container": {"image": "x.sif"}, "slurm.python": "/venv/bin/activate"}, "the container's interpreter"),
        ({"slurm.container": {"image": "x", "runtime": "docker"}}, "expected one of 'apptainer', 'singularity'"),
    ],
)
def test_invalid_slurm_sections_name_the_fix(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(overrides)


def test_placement_checks() -> None:
    gpu = {"engine.device": "cuda", "train.device": "cuda", "slurm.trainer.gpus_per_task": 1}
    cfg = make_config(gpu | {"slurm.engines.gpus_per_node": 8, "slurm.engines.gpus_per_engine": 2})
    with pytest.raises(ConfigError, match=r"set engine.num_engines=4"):
        check_placement(cfg)
    assert check_placement(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, num_engines=4))) == []
    with pytest.raises(ConfigError, match="gpus_per_task=0"):
        check_placement(make_config({"train.device": "cuda"}))
    with pytest.raises(ConfigError, match="set slurm.engines.gpus_per_node"):
        check_placement(make_config({"engine.device": "cuda"}))
    notes = check_placement(make_config({"slurm.colocate": True, "slurm.engines.nodes": 3, "train.num_ranks": 2}))
    assert any("engines.nodes have no effect" in n for n in notes)
    assert any("train.num_ranks=2 has no effect" in n for n in notes)


def test_cli_sbatch_dry_run_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(REPO / "experiments" / "quickstart.yaml")
    assert main(["sbatch", config, "slurm.trainer.tasks_per_node=2", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#!/bin/bash") and "#SBATCH hetjob" in out and "dry run: the script is valid" in err
    target = tmp_path / "sub" / "q.sbatch"
    assert main(["sbatch", config, "-o", str(target), "--run-dir", "runs/x"]) == 0
    assert target.stat().st_mode & 0o111 and f"RUN_DIR={Path('runs/x').absolute()}\n" in target.read_text()
    assert main(["sbatch", config, "slurm.extra_sbatch.nodez=1", "--dry-run"]) == 2
    assert "unknown sbatch option 'nodez'" in capsys.readouterr().err


def test_doctor_reports_and_passes_for_local_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--run-dir", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    for name in ("python", "torch", "run dir", "slurm", "mpi4py", "nvml", "sglang", "megatron-core"):
        assert re.search(rf"^  (ok  |miss|FAIL)  {re.escape(name)}\b", out, re.M), (name, out)
    assert "ready for local runs" in out


def test_doctor_fails_on_an_unwritable_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["doctor", "--run-dir", str(blocker / "runs")]) == 1
    assert "FAIL  run dir" in capsys.readouterr().out


def test_submit_refuses_a_run_dir_of_another_run(tmp_path: Path) -> None:
    from hpcrl.slurm.executor import write_run_config

    write_run_config(make_config(), tmp_path)
    # Extending a run and changing its Slurm shape are resumes of the same run.
    longer = make_config({"num_steps": 50, "slurm.time_limit": "12:00:00"})
    write_run_config(longer, tmp_path)
    assert from_dict(RunConfig, load_yaml(tmp_path / "config.yaml")) == longer
    with pytest.raises(ConfigError, match="holds a run with a different config"):
        write_run_config(make_config({"train.lr": 0.5}), tmp_path)


def test_watcher_reads_het_jobs_from_component_zero() -> None:
    from hpcrl.slurm.executor import HetSlurmInfoWatcher

    sacct = "JobID|State|NodeList\n12+0|RUNNING|n1\n12+0.batch|RUNNING|n1\n12+1|RUNNING|n2\n13|PENDING|None\n"
    info = HetSlurmInfoWatcher().read_info(sacct)
    assert info["12"]["State"] == "RUNNING" and info["13"]["State"] == "PENDING"


# ---- what a cluster's admins ask for: container, log dir, modules, gres type, account/qos/reservation/exclusive


def test_script_names_every_path_absolutely_and_runs_from_any_directory(tmp_path: Path) -> None:
    cfg = make_config({"slurm.log_dir": "logs/slurm", "slurm.python": ".venv/bin/python"})
    text = render_script(cfg, "runs/t", base_dir=str(tmp_path))
    assert f"#SBATCH --chdir={tmp_path}\n" in text
    assert f"#SBATCH --output={tmp_path}/logs/slurm/%x-%j.out\n" in text
    assert f"RUN_DIR={tmp_path}/runs/t\n" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_cli_creates_the_log_dir_slurm_cannot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = str(REPO / "experiments" / "quickstart.yaml")
    assert main(["sbatch", config, "slurm.log_dir=job-logs", "-o", "q.sbatch", "--base-dir", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "job-logs").is_dir()
    assert f"#SBATCH --output={tmp_path}/b/job-logs/%x-%j.out" in (tmp_path / "q.sbatch").read_text()


def test_modules_load_before_the_python_environment_and_setup_after_them() -> None:
    cfg = make_config({"slurm.modules": ["cuda/12.4", "gcc/13"], "slurm.setup": ["echo site-init"]})
    lines = render_script(cfg, "runs/t", base_dir="/b").splitlines()
    load = lines.index(
        'module load cuda/12.4 gcc/13 || { echo "hpcrl: module load cuda/12.4 gcc/13 failed (see above)" >&2; exit 1; }'
    )
    assert load < lines.index("echo site-init") < next(i for i, line in enumerate(lines) if "HPCRL_PYTHON=" in line)


def test_gpu_type_account_qos_reservation_exclusive_reach_every_component() -> None:
    cfg = make_config(
        GOLDEN_CONFIGS["disaggregated"]
        | {"slurm.gpu_type": "h100", "slurm.reservation": "rl-week", "slurm.exclusive": True}
    )
    text = render_script(cfg, "runs/t", base_dir="/b")
    first, second = text.split("#SBATCH hetjob\n")
    assert "#SBATCH --gres=gpu:h100:4\n" in first and "#SBATCH --gres=gpu:h100:4\n" in second
    assert "--gpus-per-node" not in text
    assert "#SBATCH --exclusive\n" in first and "#SBATCH --exclusive\n" in second
    for line in ("--account=rl-team", "--qos=high", "--reservation=rl-week"):
        assert f"#SBATCH {line}\n" in first and line not in second


def test_apptainer_container_wraps_every_step(tmp_path: Path) -> None:
    image = tmp_path / "hpcrl.sif"
    image.write_bytes(b"SIF")
    gpu = {"engine.device": "cuda", "train.device": "cuda", "slurm.engines.gpus_per_node": 1}
    cfg = make_config(
        gpu | {"slurm.trainer.gpus_per_task": 1, "slurm.container": {"image": "hpcrl.sif", "binds": ["/data:/data:ro"]}}
    )
    text = render_script(cfg, "runs/t", base_dir=str(tmp_path))
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    assert f'hpcrl_container=(apptainer exec --nv --bind "$RUN_DIR" --bind /data:/data:ro {image})' in text
    assert "HPCRL_PYTHON=python3\n" in text and "VIRTUAL_ENV" not in text
    steps = [line for line in text.splitlines() if line.startswith("OMP_NUM_THREADS=")]
    assert len(steps) == 2 and all('"${hpcrl_container[@]}" "$HPCRL_PYTHON" -m hpcrl.cli role' in s for s in steps)


def test_pyxis_container_goes_to_every_srun(tmp_path: Path) -> None:
    cfg = make_config({"slurm.container": {"runtime": "pyxis", "image": "nvcr.io#org/hpcrl:0.1", "binds": ["/data"]}})
    text = render_script(cfg, "runs/t", base_dir=str(tmp_path))
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    assert (
        "hpcrl_pyxis=(--container-image='nvcr.io#org/hpcrl:0.1' "
        '--container-mounts="$PWD:$PWD","$RUN_DIR:$RUN_DIR",/data --container-workdir="$PWD")'
    ) in text
    steps = [line for line in text.splitlines() if line.startswith("OMP_NUM_THREADS=")]
    assert len(steps) == 2 and all(' srun "${hpcrl_pyxis[@]}" --het-group=' in s for s in steps)


# Stand-ins for srun and the container runtimes: each logs what it was asked and runs the step's command on this
# machine, so that a rendered script runs here as far as its steps.
_FAKE_SRUN = """#!/bin/bash
for a in "$@"; do case $a in --*) echo "srun $a" >> "$HPCRL_FAKE_LOG"; shift;; *) break;; esac; done
exec "$@"
"""
_FAKE_APPTAINER = """#!/bin/bash
echo "apptainer $1" >> "$HPCRL_FAKE_LOG"; shift
while :; do
  case $1 in --nv) echo "apptainer --nv" >> "$HPCRL_FAKE_LOG"; shift;;
    --bind) echo "apptainer --bind $2" >> "$HPCRL_FAKE_LOG"; shift 2;;
    *) echo "apptainer image $1" >> "$HPCRL_FAKE_LOG"; shift; break;; esac
done
exec "$@"
"""
_FAKE_PYTHON = """#!/bin/bash
echo "python $* (in $PWD)" >> "$HPCRL_FAKE_LOG"
"""


def _container_run(tmp_path: Path, runtime: str) -> tuple[dict[str, Any], Path]:
    """A started disk_delta run in a container, its weights in a directory of their own (sync.delta_dir)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", _FAKE_SRUN), ("apptainer", _FAKE_APPTAINER), ("python", _FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    image = "img/hpcrl.sif" if runtime == "apptainer" else "nvcr.io#org/hpcrl:0.1"
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "hpcrl.sif").write_bytes(b"SIF")
    overrides = {
        "engine.device": "cuda", "train.device": "cuda", "engine.num_engines": 2, "slurm.engines.gpus_per_node": 2,
        "slurm.trainer.gpus_per_task": 1, "slurm.python": str(bin_dir / "python"),
        "sync.transport": "disk_delta", "sync.delta_dir": "shared fs/weights",
        "slurm.container": {"runtime": runtime, "image": image, "binds": ["/data:/data:ro"]},
    }  # fmt: skip
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_yaml(make_config(overrides)))
    return overrides, run_dir


@pytest.mark.parametrize("runtime", ["apptainer", "pyxis"])
def test_a_join_job_runs_its_engine_in_the_runs_image_with_the_runs_mounts(tmp_path: Path, runtime: str) -> None:
    overrides, run_dir = _container_run(tmp_path, runtime)
    run_script = render_script(make_config(overrides), "runs/t", base_dir=str(tmp_path))
    join_script = render_join_script(Path("runs/t"), [], base_dir=str(tmp_path))
    assert subprocess.run(["bash", "-n"], input=join_script, text=True).returncode == 0
    # The join job enters the image exactly as the run's steps do: same image, same mounts.
    setup = "hpcrl_container=(" if runtime == "apptainer" else "hpcrl_pyxis=("
    (line,) = [x for x in join_script.splitlines() if x.startswith(setup)]
    assert line in run_script.splitlines()
    # Run here, with srun and the runtime standing in: `hpcrl engine join` (whose children are the engine and its
    # disk-delta agent) runs in the image and sees the run dir, the job's directory and the weight directory.
    log = tmp_path / "fake.log"
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HPCRL_FAKE_LOG": str(log), "HOME": str(tmp_path)}
    done = subprocess.run(["bash", "-c", join_script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    weights = tmp_path / "shared fs" / "weights"
    assert weights.is_dir()  # created on the host: a mount's source must exist before the container starts
    steps = log.read_text().splitlines()
    assert steps[-1] == f"python -m hpcrl.cli engine join {run_dir} (in {tmp_path})"
    if runtime == "apptainer":
        check = steps.index("python -c import hpcrl (in " + str(tmp_path) + ")")  # the in-image import check
        wrapped = ["apptainer exec", "apptainer --nv", f"apptainer --bind {run_dir}", f"apptainer --bind {weights}",
                   "apptainer --bind /data:/data:ro", f"apptainer image {tmp_path / 'img' / 'hpcrl.sif'}"]  # fmt: skip
        srun = ["srun --ntasks-per-node=1", "srun --cpus-per-task=1"]
        assert steps[:check] == wrapped and steps[check + 1 : -1] == [*srun, *wrapped]
    else:
        mounts = f"{tmp_path}:{tmp_path},{run_dir}:{run_dir},{weights}:{weights},/data:/data:ro"
        assert steps[:-1] == [
            "srun --container-image=nvcr.io#org/hpcrl:0.1", f"srun --container-mounts={mounts}",
            f"srun --container-workdir={tmp_path}", "srun --ntasks-per-node=1", "srun --cpus-per-task=1",
        ]  # fmt: skip


def test_a_join_job_refuses_a_missing_image_file_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _container_run(tmp_path, "apptainer")
    (tmp_path / "img" / "hpcrl.sif").unlink()
    monkeypatch.chdir(tmp_path)
    assert main(["sbatch", "--engines-only", "--join", "runs/t", "-o", "join.sbatch"]) == 2
    err = capsys.readouterr().err
    assert "slurm.container.image 'img/hpcrl.sif' does not exist" in err and "apptainer build IMAGE.sif" in err
    assert not (tmp_path / "join.sbatch").exists()


def test_a_weight_directory_a_container_mount_cannot_carry_is_refused() -> None:
    cfg = make_config(
        {"sync.transport": "disk_delta", "sync.delta_dir": "/scratch/a:b", "slurm.container": {"image": "docker://x"}}
    )
    with pytest.raises(ConfigError, match=r"sync.delta_dir '/scratch/a:b' has a ',' or ':'.*without them"):
        render_script(cfg, "runs/t", base_dir="/b")


@pytest.mark.parametrize(
    ("container", "names"),
    [
        ({"image": "images/missing.sif"}, "apptainer build"),
        ({"image": "/nowhere/hpcrl.sif", "runtime": "singularity"}, "singularity build"),
        ({"image": "./hpcrl.sqsh", "runtime": "pyxis"}, "enroot import"),
    ],
)
def test_a_container_image_that_does_not_exist_is_refused_at_render_time(
    container: dict[str, str], names: str, tmp_path: Path
) -> None:
    cfg = make_config({"slurm.container": container})
    with pytest.raises(ConfigError, match=rf"slurm.container.image .* does not exist .*{names}"):
        render_script(cfg, "runs/t", base_dir=str(tmp_path))
    # A registry reference is the nodes' to pull: not checked here.
    pulled = "docker://ghcr.io/org/hpcrl:0.1" if container.get("runtime") != "pyxis" else "nvcr.io#org/hpcrl:0.1"
    render_script(make_config({"slurm.container": {**container, "image": pulled}}), "runs/t", base_dir=str(tmp_path))


def test_doctor_checks_the_extras_of_a_configs_features_and_gives_one_pip_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What an environment without wandb and datasets looks like to the import system.
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    config = str(REPO / "experiments" / "quickstart.yaml")
    args = ["doctor", config, "data.source=train.parquet", "logging.wandb.project=p", "logging.tensorboard=true"]
    assert main([*args, "--run-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^  FAIL  logging\.wandb +wandb not installed\n +fix: pip install 'hpcrl\[wandb\]'$", out, re.M)
    assert re.search(r"^  FAIL  data\.source \(a \.parquet file\) +datasets not installed$", out, re.M)
    assert re.search(r"^  ok    logging\.tensorboard +tensorboard$", out, re.M)
    assert "the missing extras install with: pip install 'hpcrl[data,wandb]'" in out
    assert "cannot run hpcrl here: data.source (a .parquet file), logging.wandb" in out
    # Without a config: the commands' extras only, and they are optional.
    assert main(["doctor", "--run-dir", str(tmp_path)]) == 0
    assert re.search(r"^  ok    hpcrl report \(plots\) +matplotlib, pandas$", capsys.readouterr().out, re.M)
