"""The bad-input and fault campaign, as a repeatable, bounded script.

    PYTHONPATH=. python tools/fuzz/campaign.py [--jobs 2] [--only SUBSTRING] [--markdown] [--keep DIR]

Each case runs `hpcrl` as a user would (a subprocess, a tiny model, 2 prompts x 2 samples) over bad
configs, data, rewards, model dirs, checkpoints and run dirs, and Slurm rendering, then checks what
the user is left with. A case is **bad** when the command crashes (a traceback, a signal exit such as
139) or exits with another code than expected, when a refused command leaves files behind or changes
any, or when data is lost (a metric row, checkpoint or exported model that existed before is gone).
It is **weak** when it holds but the message does not name what the case expects it to. The table
(case -> exit -> message -> leftovers -> data lost -> verdict) is printed at the end; the exit status
is 1 when any row is bad. The engine's own HTTP cases live with the engine's tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "num_steps=2",
    "sft.num_steps=0",
    "data.prompts_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_new_tokens=6",
    "checkpoint.every_steps=1",
]


@dataclass
class Case:
    name: str
    argv: list[str]
    """The hpcrl command (without `hpcrl`)."""
    expect_rc: tuple[int, ...] = (2,)
    says: tuple[str, ...] = ()
    """Text the message must hold (the problem and the fix)."""
    setup: Callable[[Path], None] | None = None
    """Prepares the case's directory (a copy of the base one) before the command."""
    base_run: bool = False
    """Start from a copy of a finished 2-step run in run dir `r`."""
    may_change: tuple[str, ...] = ()
    """Path prefixes the command may create or change (a successful run's own files)."""
    keeps_files: bool | None = None
    """Every checkpoint and exported model must survive byte for byte (default: for refused commands);
    a run that goes on may prune old checkpoints and re-export the model, as configured."""
    preexec: Callable[[], None] | None = None


@dataclass
class Outcome:
    case: Case
    rc: int
    message: str
    leftovers: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    crashed: bool = False
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        if self.crashed or self.rc not in self.case.expect_rc or self.leftovers or self.lost:
            return "bad"
        if any(s not in self.message for s in self.case.says):
            return "weak"
        return "clean"


# ----- the cases -------------------------------------------------------------------------------------


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(textwrap.dedent(text))


def _truncate(rel: str, keep: float) -> Callable[[Path], None]:
    def go(d: Path) -> None:
        path = d / rel
        path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])

    return go


def _each_checkpoint(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda d: [fn(p) for p in sorted((d / "r" / "checkpoints").glob("step_*.h5"))]  # type: ignore[func-returns-value]


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _model_copy(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    def go(d: Path) -> None:
        shutil.copytree(d / "tiny", d / "m")
        edit(d / "m")

    return go


def _edit_config(**changes: object) -> Callable[[Path], None]:
    def go(m: Path) -> None:
        data = json.loads((m / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        (m / "config.json").write_text(json.dumps(data))

    return go


def _nan_checkpoint(d: Path) -> None:
    from hpcrl.store.checkpoint import load_checkpoint, save_checkpoint

    path = d / "r" / "checkpoints" / "step_00000002.h5"
    ckpt = load_checkpoint(path)
    name = next(k for k in ckpt.tensors if k.startswith("model/") and k.endswith("down_proj.weight"))
    ckpt.tensors[name].view(-1)[0] = float("nan")
    save_checkpoint(path.parent, 1, ckpt.tensors, ckpt.state)


def _file_limit(kib: int) -> Callable[[], None]:
    def go() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (kib * 1024, kib * 1024))

    return go


def run(*overrides: str, run_dir: str = "r") -> list[str]:
    return ["run", "qs.yaml", *TINY, *overrides, "--run-dir", run_dir]


def cases() -> list[Case]:
    c: list[Case] = []
    # Configs: refused at load, nothing written.
    for override, says in [
        ("train.lr=.inf", ("train.lr", "finite")),
        ("train.lr=-1", ("lr must be > 0",)),
        ("train.lr=abc", ("train.lr", "float")),
        ("train.lrr=1", ("train.lrr", "did you mean 'lr'")),
        ("rollout.temperature=.nan", ("rollout.temperature", "finite")),
        ("rollout.top_k=0", ("top_k", "-1")),
        ("rollout.top_p=0", ("top_p",)),
        ("rollout.n_samples_per_prompt=0", ("n_samples_per_prompt",)),
        ("sft.log_every_steps=0", ("log_every_steps",)),
        ("reward.timeout_s=0", ("timeout_s",)),
        ("reward.max_failed_share=2", ("max_failed_share",)),
        ("num_steps=-1", ("num_steps",)),
        ("seed=-3", ("seed",)),
        ("checkpoint.every_steps=0", ("every_steps",)),
        ("checkpoint.keep_last=0", ("keep_last",)),
        ("engine.base_port=99999", ("base_port",)),
        ("sync.bucket_mb=0", ("bucket_mb",)),
        ("guard.hot_c=-.inf", ("guard.hot_c", "finite")),
        ("data.prompt_template='{prompt} {x}'", ("{x}", "only {prompt}")),
        ("data.prompt_template='{prompt'", ("prompt_template", "literal brace")),
        ("data.prompt_template='no placeholder'", ("{prompt}",)),
        ("train.dtype=float64", ("train.dtype", "float32")),
        ("num_steps", ("has no '='",)),
    ]:
        c.append(Case(f"config {override}", run(override), says=says))
    c.append(Case("config: train.device=cuda on CPU torch", run("train.device=cuda"), (1,), ("train.device", "cpu")))
    bad_yaml = _write("bad.yaml", "a: [1\n")
    c.append(Case("config: malformed YAML", ["run", "bad.yaml"], says=("bad.yaml", "line"), setup=bad_yaml))
    c.append(Case("config: file missing", ["run", "nope.yaml"], says=("nope.yaml", "not found")))
    # Data.
    c.append(Case("data: file missing", run("data.source=none.jsonl"), says=("none.jsonl",)))
    c.append(Case("data: empty file", run("data.source=e.jsonl"), says=("e.jsonl",), setup=_write("e.jsonl", "")))
    c.append(
        Case(
            "data: a row without the prompt key",
            run("data.source=rows.jsonl"),
            says=("rows.jsonl:2", "prompt"),
            setup=_write("rows.jsonl", '{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2="}\n'),
        )
    )
    c.append(
        Case(
            "data: a character outside the tokenizer",
            run("data.source=oov.jsonl"),
            says=("'é'", "unknown token"),
            setup=_write("oov.jsonl", '{"prompt": "caf\\u00e9 1+1=", "answer": "2"}\n'),
        )
    )
    # Rewards.
    c.append(Case("reward: unknown module", run("reward.fn=nomod:f"), says=("nomod",)))
    c.append(
        Case(
            "reward: wrong signature",
            run("reward.fn=rw:one"),
            says=("signature",),
            setup=_write("rw.py", "def one(x):\n    return 0.0\n"),
        )
    )
    c.append(
        Case(
            "reward: returns a str (stops at step 1)",
            run("reward.fn=rw:text"),
            says=("str", "stops"),
            setup=_write("rw.py", "def text(response, answer):\n    return 'yes'\n"),
            may_change=("r/",),
        )
    )
    c.append(
        Case(
            "reward: hangs (reward.timeout_s=0.5)",
            run("reward.fn=rw:hang", "reward.timeout_s=0.5"),
            says=("timed out after 0.5 s",),
            setup=_write("rw.py", "import time\n\ndef hang(response, answer):\n    time.sleep(1000)\n"),
            may_change=("r/",),
        )
    )
    # Model dirs: named before the run dir is touched.
    no_model = run("model.path=nowhere", "model.init_tiny=null")
    c.append(Case("model: path missing", no_model, (1,), ("nowhere", "init_tiny")))
    c.append(
        Case(
            "model: truncated model.safetensors",
            run("model.path=m"),
            says=("safetensors", "truncated"),
            setup=_model_copy(lambda m: _truncate("model.safetensors", 0.5)(m)),
        )
    )
    c.append(
        Case(
            "model: config.json without hidden_size",
            run("model.path=m"),
            says=("hidden_size",),
            setup=_model_copy(_edit_config(hidden_size=None)),
        )
    )
    c.append(
        Case(
            "model: model_type llama on Qwen3 weights",
            run("model.path=m"),
            says=("QK-norm", "qwen3"),
            setup=_model_copy(_edit_config(model_type="llama")),
        )
    )
    c.append(
        Case(
            "model: config.json not JSON",
            run("model.path=m"),
            says=("JSON",),
            setup=_model_copy(lambda m: (m / "config.json").write_text("{")),
        )
    )
    c.append(
        Case(
            "model init-tiny onto an existing file",
            ["model", "init-tiny", "notes.txt", "--overwrite"],
            says=("is a file",),
            setup=_write("notes.txt", "mine\n"),
        )
    )
    # Run dirs and checkpoints (a copy of a finished 2-step run in r/).
    c.append(
        Case(
            "run dir: checkpoints removed",
            run(),
            says=("2 metric rows", "--restart"),
            base_run=True,
            setup=lambda d: [p.unlink() for p in (d / "r" / "checkpoints").iterdir()],  # type: ignore[func-returns-value]
        )
    )
    c.append(
        Case(
            "run dir: every checkpoint truncated",
            run(),
            says=("unreadable checkpoint", "--restart"),
            base_run=True,
            setup=_each_checkpoint(lambda p: _truncate(p.name, 0.5)(p.parent)),
        )
    )
    c.append(
        Case(
            "run dir: newest checkpoint bit-flipped (resumes from the older)",
            run("num_steps=3"),
            (0,),
            base_run=True,
            setup=lambda d: _flip_bytes(d / "r" / "checkpoints" / "step_00000002.h5"),
            may_change=("r/",),
        )
    )
    c.append(
        Case(
            "run dir: config.yaml removed, train.lr changed",
            run("train.lr=1e-3"),
            says=("train.lr: 0.0005 -> 0.001", "metrics.h5"),
            base_run=True,
            setup=lambda d: (d / "r" / "config.yaml").unlink(),
        )
    )
    fewer = run("num_steps=1")
    c.append(Case("run dir: num_steps below the steps done", fewer, says=("num_steps >= 2",), base_run=True))
    c.append(
        Case("run dir: --restart", [*run(), "--restart"], (0,), base_run=True, may_change=("r/",), keeps_files=True),
    )
    c.append(
        Case(
            "run dir: checkpoint holds NaN weights",
            run("num_steps=3"),
            (1,),
            ("NonFiniteWeightsError", "neither pushed nor checkpointed"),
            base_run=True,
            setup=_nan_checkpoint,
            may_change=("r/metrics.h5", "r/logs/", "r/engines/", "r/config.yaml", "r/.hpcrl.lock"),
        )
    )
    c.append(
        Case(
            "run dir: checkpoint write fails (ulimit -f 700)",
            run("num_steps=3"),
            (1,),
            ("File too large", "previous checkpoint"),
            base_run=True,
            preexec=_file_limit(700),
            may_change=("r/metrics.h5", "r/logs/", "r/engines/", "r/config.yaml", "r/.hpcrl.lock"),
        )
    )
    # Slurm rendering.
    c.append(
        Case(
            "sbatch -o DIR",
            ["sbatch", "qs.yaml", "-o", "scripts"],
            says=("is a directory",),
            setup=lambda d: (d / "scripts").mkdir(),
        )
    )
    c.append(
        Case(
            "sbatch: shell in the job name (dry run)",
            ["sbatch", "qs.yaml", 'name=x"; touch pwned; echo "$(id)`id`', "--dry-run"],
            (0,),
        )
    )
    c.append(Case("sbatch: unknown slurm key", ["sbatch", "qs.yaml", "slurm.partitionn=a"], says=("slurm.partitionn",)))
    return c


# ----- running one case ------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def recorded(root: Path) -> tuple[set[int], set[str]]:
    """Metric steps (of every metrics.h5 under root) and digests of checkpoints and exported models."""
    from hpcrl.store import load_metrics

    steps: set[int] = set()
    for metrics in root.rglob("metrics.h5"):
        try:
            steps |= {int(s) for s in load_metrics(metrics)["step"]}
        except Exception:  # noqa: BLE001 - a damaged file records nothing readable
            pass
    digests = {v for k, v in snapshot(root).items() if "/checkpoints/" in f"/{k}" or k.endswith("model.safetensors")}
    return steps, digests


def run_case(case: Case, base: Path, work: Path) -> Outcome:
    d = work / case.name.replace(" ", "_").replace("/", "_")[:60]
    shutil.copytree(base, d, symlinks=True, ignore=None if case.base_run else shutil.ignore_patterns("r"))
    if case.setup:
        case.setup(d)
    before = snapshot(d)
    steps_before, digests_before = recorded(d / "r") if case.base_run else (set(), set())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "hpcrl.cli", *case.argv],
            cwd=d, env=env, capture_output=True, text=True, timeout=240, preexec_fn=case.preexec,
        )  # fmt: skip
        rc, stdout, stderr = out.returncode, out.stdout, out.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = 124, str(exc.stdout or ""), "timed out after 240 s"
    seconds = time.monotonic() - t0
    errors = [line for line in stderr.splitlines() if line.startswith("hpcrl: error:")]
    message = errors[-1] if errors else (stdout.strip().splitlines() or [""])[-1]
    after = snapshot(d)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    leftovers = [k for k in changed if not k.startswith(case.may_change or ("\0",))]
    lost: list[str] = []
    if case.base_run:
        steps_after, digests_after = recorded(d / "r")
        if missing_steps := steps_before - steps_after:
            lost.append(f"metric rows of steps {sorted(missing_steps)}")
        keeps = case.keeps_files if case.keeps_files is not None else 0 not in case.expect_rc
        if keeps and (gone := digests_before - digests_after):
            lost.append(f"{len(gone)} checkpoint/model file(s)")
    crashed = "Traceback" in stderr or rc < 0 or rc >= 128
    return Outcome(case, rc, message, leftovers, lost, crashed, seconds)


def make_base(root: Path) -> Path:
    """A directory with qs.yaml (the quickstart on a tiny model) and r/, a finished 2-step run."""
    base = root / "base"
    base.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "hpcrl.cli", "model", "init-tiny", str(base / "tiny")], env=env, check=True,
                   capture_output=True)  # fmt: skip
    text = (REPO / "experiments" / "quickstart.yaml").read_text()
    lines = [line for line in text.splitlines() if not line.strip().startswith("#")]
    (base / "qs.yaml").write_text("\n".join(lines).replace("path: runs/models/tiny-qwen3", "path: tiny") + "\n")
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", *run()], cwd=base, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the base run failed:\n{out.stdout}\n{out.stderr}")
    return base


def table(outcomes: list[Outcome], *, markdown: bool) -> str:
    rows = [
        (
            o.case.name,
            str(o.rc),
            o.message.removeprefix("hpcrl: error: ")[:150],
            ", ".join(o.leftovers)[:60] or "-",
            ", ".join(o.lost) or "-",
            o.verdict,
        )
        for o in outcomes
    ]
    head = ("case", "exit", "message", "leftovers", "data lost", "verdict")
    if markdown:
        esc = [[cell.replace("|", "\\|") for cell in row] for row in [head, *rows]]
        lines = ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in esc[1:]])
    width = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    width[2] = min(width[2], 90)
    return "\n".join("  ".join(cell[: width[i]].ljust(width[i]) for i, cell in enumerate(r)) for r in [head, *rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2: one per core)")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--keep", default=None, help="keep the cases' directories here instead of a temp dir")
    ns = parser.parse_args()
    t0 = time.monotonic()
    root = Path(ns.keep) if ns.keep else Path(tempfile.mkdtemp(prefix="hpcrl-campaign-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        base = make_base(root)
        chosen = [c for c in cases() if ns.only is None or ns.only in c.name]
        with ThreadPoolExecutor(max_workers=ns.jobs) as pool:
            outcomes = list(pool.map(lambda c: run_case(c, base, root / "cases"), chosen))
    finally:
        if not ns.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(table(outcomes, markdown=ns.markdown))
    counts = {v: sum(o.verdict == v for o in outcomes) for v in ("clean", "weak", "bad")}
    print(
        f"\n{len(outcomes)} cases: {counts['clean']} clean, {counts['weak']} weak, {counts['bad']} bad "
        f"in {time.monotonic() - t0:.0f} s with {ns.jobs} job(s)"
    )
    return 1 if counts["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
