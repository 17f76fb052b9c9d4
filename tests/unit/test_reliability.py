"""Nothing lost, nobody in: each hole the fault campaign found, as a user meets it.

Every test drives `hpcrl` as a subprocess on a tiny run and asserts what the user sees: the exit code,
a message naming the problem and the fix, and the files left exactly as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpcrl.config import ConfigError
from hpcrl.rollout.rewards import ScoringInterrupted, score
from hpcrl.run_config import load_run_config
from hpcrl.store import load_events, load_metrics, load_root_attrs
from hpcrl.store.checkpoint import load_checkpoint, save_checkpoint
from tests.conftest import quickstart_dir
from tests.support import signal_at_line

TINY = [
    "num_steps=2",
    "sft.num_steps=0",
    "data.prompts_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_new_tokens=6",
    "checkpoint.every_steps=1",
]


def hpcrl(
    *args: str, cwd: Path, timeout_s: float = 300, preexec_fn: object = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", *args],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout_s, preexec_fn=preexec_fn,  # type: ignore[arg-type]
    )  # fmt: skip


def run(workdir: Path, run_dir: str, *overrides: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return hpcrl("run", "qs.yaml", *TINY, *overrides, "--run-dir", run_dir, cwd=workdir, **kw)  # type: ignore[arg-type]


def ok(out: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert out.returncode == 0, f"exit {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def refused(out: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The one-line `hpcrl: error:` a refused command prints, with no traceback."""
    assert out.returncode == code, f"exit {out.returncode}:\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("hpcrl: error:")]
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A finished TINY run (2 steps, a checkpoint each), made once: tests change copies of it, never it."""
    workdir = quickstart_dir(tmp_path_factory.mktemp("finished"), tiny_model_dir)
    ok(run(workdir, "r"))
    return workdir / "r"


def finished(finished_run: Path, workdir: Path, name: str = "r") -> Path:
    """A copy of the finished run as `workdir/name`: what `ok(run(workdir, name))` leaves there."""
    return Path(shutil.copytree(finished_run, workdir / name, symlinks=True))


def snapshot(path: Path) -> dict[str, str]:
    """Every file under `path` with a digest of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


# ----- item 2: no silent start over; nothing unreadable is deleted -----


def test_a_run_dir_without_checkpoints_is_refused_until_restart_moves_it_aside(
    workdir: Path, finished_run: Path
) -> None:
    for path in (finished(finished_run, workdir) / "checkpoints").iterdir():
        path.unlink()
    before = snapshot(workdir / "r")
    message = refused(run(workdir, "r", "num_steps=3"))
    assert "2 metric rows" in message and "model/" in message and "no checkpoint to resume from" in message
    assert "--restart" in message and "--run-dir" in message
    assert snapshot(workdir / "r") == before

    out = ok(run(workdir, "r", "num_steps=3", "--restart"))
    (old,) = (workdir / "r").glob("superseded-*")
    assert f"moved the previous contents of r to {Path('r') / old.name}" in out.stdout
    assert {
        k.removeprefix(old.name + "/"): v for k, v in snapshot(workdir / "r").items() if k.startswith(old.name)
    } == {k: v for k, v in before.items() if k != ".hpcrl.lock"}
    assert list(load_metrics(workdir / "r" / "metrics.h5")["step"]) == [0, 1, 2]


def test_unreadable_checkpoints_are_kept_never_deleted(workdir: Path, finished_run: Path) -> None:
    finished(finished_run, workdir)
    ckpts = workdir / "r" / "checkpoints"
    for path in ckpts.iterdir():
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated, as by a full disk
    before = snapshot(workdir / "r")
    message = refused(run(workdir, "r"))
    assert "2 unreadable checkpoint(s)" in message and "step_00000002.h5" in message
    assert snapshot(workdir / "r") == before

    # Only the newest is damaged: the run resumes from the older one and rewrites step 2 under a name
    # that would overwrite the damaged file; that file is kept aside instead.
    finished(finished_run, workdir, "s")
    damaged = (workdir / "s" / "checkpoints" / "step_00000002.h5").read_bytes()[:1000]
    (workdir / "s" / "checkpoints" / "step_00000002.h5").write_bytes(damaged)
    out = ok(run(workdir, "s"))
    assert "kept as step_00000002.h5.unreadable" in out.stdout
    assert (workdir / "s" / "checkpoints" / "step_00000002.h5.unreadable").read_bytes() == damaged
    assert sorted(p.name for p in (workdir / "s" / "checkpoints").iterdir()) == [
        "step_00000001.h5",
        "step_00000002.h5",
        "step_00000002.h5.unreadable",
    ]
    assert load_checkpoint(workdir / "s" / "checkpoints" / "step_00000002.h5").step == 1


# ----- item 3: one writer per run dir -----


def test_a_second_run_on_a_live_run_dir_is_refused_and_the_first_is_untouched(workdir: Path) -> None:
    # The first run's rewards wait for a file, so it is surely live while the second one starts.
    (workdir / "gate.py").write_text(
        "import os, time\n\ndef gated(response, answer):\n"
        "    while not os.path.exists('open'):\n        time.sleep(0.05)\n    return 0.0\n"
    )
    args = [*TINY, "num_steps=4", "reward.fn=gate:gated", "reward.timeout_s=300"]
    first = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "run", "qs.yaml", *args, "--run-dir", "r"],
        cwd=workdir, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    assert first.stdout is not None
    lines = []
    for line in first.stdout:
        lines.append(line)
        if line.startswith("starting 1 embedded engine"):  # the run dir is claimed by then
            break
    message = refused(run(workdir, "r", "num_steps=4", "reward.fn=gate:gated", "reward.timeout_s=300"))
    assert f"in use by another hpcrl run (pid {first.pid} on host " in message and "another --run-dir" in message
    (workdir / "open").touch()
    rest = first.communicate(timeout=120)[0]
    assert first.returncode == 0, "".join(lines) + rest
    assert list(load_metrics(workdir / "r" / "metrics.h5")["step"]) == [0, 1, 2, 3]
    assert [e["kind"] for e in load_events(workdir / "r" / "metrics.h5")] == ["finished"]


# ----- items 4, 5: the config check -----


def test_the_config_check_falls_back_to_metrics_h5_and_names_the_keys(workdir: Path, finished_run: Path) -> None:
    finished(finished_run, workdir)
    (workdir / "r" / "config.yaml").unlink()
    before = snapshot(workdir / "r")
    message = refused(run(workdir, "r", "train.lr=1e-3", "rollout.temperature=0.5"))
    assert "holds 2 steps" in message and "metrics.h5 recorded it" in message
    assert "train.lr: 0.0005 -> 0.001" in message and "rollout.temperature: 1.0 -> 0.5" in message
    assert snapshot(workdir / "r") == before
    assert "lr: 0.0005" in load_root_attrs(workdir / "r" / "metrics.h5")["config"]


def test_a_run_that_failed_before_its_first_step_does_not_tie_the_dir_to_its_config(workdir: Path) -> None:
    (workdir / "myreward.py").write_text("def typo(response, answer):\n    return 'yes'\n")
    out = run(workdir, "r", "reward.fn=myreward:typo")
    assert "reward failed on 4 of 4 samples" in refused(out)
    assert [e["kind"] for e in load_events(workdir / "r" / "metrics.h5")] == ["stopped"]
    ok(run(workdir, "r"))  # the fixed config runs in the same dir
    assert list(load_metrics(workdir / "r" / "metrics.h5")["step"]) == [0, 1]


# ----- item 6: non-finite values -----


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lr=.inf", "train.lr: expected a finite number, got inf"),
        ("rollout.temperature=.nan", "rollout.temperature: expected a finite number, got nan"),
        ("guard.hot_c=-.inf", "guard.hot_c: expected a finite number, got -inf"),
        ("rollout.top_k=0", "rollout: top_k must be -1 (no top-k filter) or >= 1, got 0"),
        ("sft.log_every_steps=0", "sft: log_every_steps must be >= 1, got 0"),
        ("reward.timeout_s=0", "reward: timeout_s must be > 0, got 0.0"),
        ("data.prompt_template='{prompt} {x}'", "prompt_template has the placeholder(s) {x}, but only {prompt}"),
    ],
)
def test_bad_values_are_refused_at_config_load(workdir: Path, override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(workdir / "qs.yaml", [override])
    assert expected in str(info.value)


def test_a_non_finite_config_value_stops_hpcrl_run_before_it_writes(workdir: Path) -> None:
    message = refused(run(workdir, "r", "train.lr=.inf"))
    assert message == "hpcrl: error: train.lr: expected a finite number, got inf; set a finite value"
    assert not (workdir / "r").exists()


def test_nan_weights_are_neither_pushed_nor_checkpointed(workdir: Path, finished_run: Path) -> None:
    # A checkpoint written with NaN weights (as train.lr=.inf did before it was refused) is resumed.
    finished(finished_run, workdir)
    path = workdir / "r" / "checkpoints" / "step_00000001.h5"
    ckpt = load_checkpoint(path)
    ckpt.tensors["model/model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_checkpoint(path.parent, 1, ckpt.tensors, ckpt.state)
    before = snapshot(workdir / "r" / "checkpoints")
    message = refused(run(workdir, "r", "num_steps=3"), code=1)
    assert "NonFiniteWeightsError: parameter 'model.layers.1.mlp.down_proj.weight'" in message
    assert "neither pushed nor checkpointed" in message
    events = load_events(workdir / "r" / "metrics.h5")
    assert events[-1]["kind"] == "nan_weights"
    assert events[-1]["detail"]["parameter"] == "model.layers.1.mlp.down_proj.weight"
    assert snapshot(workdir / "r" / "checkpoints") == before
    assert list(load_metrics(workdir / "r" / "metrics.h5")["step"]) == [0, 1]


# ----- item 7: bounded waits on the reward -----


def test_score_times_out_a_hung_call_and_scores_the_rest() -> None:
    def reward(response: str, answer: str) -> float:
        if response == "hang":
            time.sleep(30)
        return float(response == answer)

    result = score(reward, ["a", "hang", "b", "a"], ["a", "a", "b", "x"], timeout_s=0.5)
    assert result.rewards[0] == 1.0 and result.rewards[2:] == [1.0, 0.0]
    assert result.errors == [None, "timed out after 0.5 s (reward.timeout_s)", None, None]
    with pytest.raises(ScoringInterrupted):
        score(reward, ["hang"], ["a"], interrupted=lambda: True)


def test_a_hung_reward_times_out_and_the_stop_is_recorded(workdir: Path) -> None:
    (workdir / "hang.py").write_text("import time\n\ndef hang(response, answer):\n    time.sleep(1000)\n")
    message = refused(run(workdir, "r", "reward.fn=hang:hang", "reward.timeout_s=0.5", timeout_s=120))
    assert "reward failed on 4 of 4 samples" in message and "timed out after 0.5 s (reward.timeout_s)" in message
    (stopped,) = load_events(workdir / "r" / "metrics.h5")
    assert stopped["kind"] == "stopped" and stopped["step"] == 0
    assert stopped["detail"]["reason"] == "reward_failures" and stopped["detail"]["num_failed"] == 4


def test_sigterm_during_a_slow_reward_checkpoints_the_last_finished_step(workdir: Path) -> None:
    (workdir / "slow.py").write_text(
        "import time\n_calls = [0]\n\ndef slow(response, answer):\n"
        "    _calls[0] += 1\n    if _calls[0] > 4:  # every call after step 1\n        time.sleep(1000)\n"
        "    return 0.0\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [*TINY, "num_steps=3", "checkpoint.every_steps=10", "reward.fn=slow:slow", "reward.timeout_s=600"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "run", "qs.yaml", *args, "--run-dir", "r"],
        cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step    1/"):
            break
    time.sleep(0.5)  # into step 2's reward
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, rest
    assert "received SIGTERM: checkpointed step 1; rerun the same command to resume" in rest
    assert [p.name for p in (workdir / "r" / "checkpoints").iterdir()] == ["step_00000001.h5"]
    (event,) = load_events(workdir / "r" / "metrics.h5")
    assert event["kind"] == "preempted" and event["step"] == 0
    assert list(load_metrics(workdir / "r" / "metrics.h5")["step"]) == [0]


def test_sigterm_during_the_sft_warm_start_ends_the_run_at_once(workdir: Path) -> None:
    """A long SFT must not run past Slurm's grace period: the signal stops it within a step."""
    args = [*TINY, "sft.num_steps=100000", "sft.log_every_steps=20"]
    proc = signal_at_line(workdir, args, "r", "sft   20/", signal.SIGTERM)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, rest
    assert "sft stopped after" in rest and "/100000 steps by a preemption signal" in rest, rest
    assert "received SIGTERM" in rest and "step    1/" not in rest, rest
    (event,) = load_events(workdir / "r" / "metrics.h5")
    assert event["kind"] == "preempted" and event["step"] is None


# ----- item 8: a write error during a checkpoint -----


def _file_size_limit() -> None:
    # As `(trap '' XFSZ; ulimit -f 700; hpcrl run ...)`: writes past 700 KiB fail with EFBIG.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (700 * 1024, 700 * 1024))


def test_a_checkpoint_write_error_ends_the_run_cleanly_and_keeps_the_previous(
    workdir: Path, finished_run: Path
) -> None:
    before = snapshot(finished(finished_run, workdir) / "checkpoints")
    assert (workdir / "r" / "checkpoints" / "step_00000002.h5").stat().st_size > 700 * 1024
    message = refused(run(workdir, "r", "num_steps=3", preexec_fn=_file_size_limit), code=1)
    assert "could not write checkpoint r/checkpoints/step_00000003.h5 (File too large)" in message
    assert "free space and rerun to resume" in message
    assert snapshot(workdir / "r" / "checkpoints") == before  # no partial file, the previous ones intact
    ok(run(workdir, "r", "num_steps=3"))
    assert list(load_metrics(workdir / "r" / "metrics.h5")["step"]) == [0, 1, 2]


# ----- items 9, 10: hpcrl: error instead of a traceback -----


def _edit_model(src: Path, dst: Path, *, config: dict[str, object] | None = None, drop: str | None = None) -> Path:
    import shutil

    shutil.copytree(src, dst)
    if config is not None or drop is not None:
        data = json.loads((dst / "config.json").read_text())
        data.update(config or {})
        data.pop(drop or "", None)
        (dst / "config.json").write_text(json.dumps(data))
    return dst


def test_bad_model_dirs_are_named_before_anything_is_written(workdir: Path, tiny_model_dir: Path) -> None:
    truncated = _edit_model(tiny_model_dir, workdir / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases = [
        (truncated, "model.safetensors cannot be read as safetensors", "truncated or corrupt"),
        (_edit_model(tiny_model_dir, workdir / "nohidden", drop="hidden_size"), "lacks the key 'hidden_size'", ""),
        (
            _edit_model(tiny_model_dir, workdir / "llama", config={"model_type": "llama"}),
            "the weights have QK-norm",
            "set model_type to 'qwen3'",
        ),
    ]
    for model, problem, fix in cases:
        message = refused(run(workdir, "r", f"model.path={model}"))
        assert problem in message and fix in message
        assert not (workdir / "r").exists()


def test_user_errors_get_a_message_not_a_traceback(workdir: Path) -> None:
    device = "cuda:99" if torch.cuda.is_available() else "cuda"
    message = refused(run(workdir, "r", f"train.device={device}"), code=1)
    assert f"train.device={device} but this machine shows" in message and "set train.device=cpu" in message

    (workdir / "oov.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "café 2+2=", "answer": "4"}\n')
    message = refused(run(workdir, "r", "data.source=oov.jsonl"))
    assert "example 2 of oov.jsonl holds the character 'é' (U+00E9)" in message and "unknown token" in message
    assert not (workdir / "r").exists()

    (workdir / "scripts").mkdir()
    message = refused(hpcrl("sbatch", "qs.yaml", "-o", "scripts", cwd=workdir))
    assert "-o scripts is a directory" in message and "scripts/qs.sbatch" in message
    assert list((workdir / "scripts").iterdir()) == [] and not list(workdir.glob(".*.tmp"))

    (workdir / "notes.txt").write_text("mine\n")
    for extra in ([], ["--overwrite"]):
        message = refused(hpcrl("model", "init-tiny", "notes.txt", *extra, cwd=workdir))
        assert "notes.txt is a file, not a directory" in message
    assert (workdir / "notes.txt").read_text() == "mine\n"


def test_fewer_num_steps_than_done_is_refused_and_a_resume_supersedes_finished(
    workdir: Path, finished_run: Path
) -> None:
    finished(finished_run, workdir)
    before = snapshot(workdir / "r")
    message = refused(run(workdir, "r", "num_steps=1"))
    assert "holds 2 steps but num_steps=1" in message and "num_steps >= 2" in message
    assert snapshot(workdir / "r") == before
    ok(run(workdir, "r", "num_steps=3"))
    kinds = [e["kind"] for e in load_events(workdir / "r" / "metrics.h5")]
    assert kinds == ["finished_superseded", "resumed", "finished"]
    assert list(load_metrics(workdir / "r" / "metrics.h5")["step"]) == [0, 1, 2]
