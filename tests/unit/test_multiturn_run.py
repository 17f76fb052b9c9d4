"""rollout.kind=multi_turn: its config keys, the SFT tool traces, and `hpcrl run` end to end on the tiny model."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpcrl.config import from_dict
from hpcrl.model.tiny import build_tokenizer
from hpcrl.rollout.data import make_product_task
from hpcrl.run_config import RunConfig
from hpcrl.samples.sample import DataError, Example
from hpcrl.sessions.families import get_family
from hpcrl.sessions.messages import Message, ToolCall
from hpcrl.sessions.traces import ToolTraces
from hpcrl.store import load_metrics
from tests.support import hpcrl

MULTI = {"kind": "multi_turn", "model_family": "tiny"}


def config(**sections: Any) -> RunConfig:
    return from_dict(RunConfig, {"model": {"path": "m"}, "data": {"source": "product"}, **sections})


def refusal(**sections: Any) -> str:
    with pytest.raises(ValueError) as info:
        config(**sections)
    return str(info.value)


# ----- config -----


def test_multi_turn_keys_load_and_fill_the_episode_limits() -> None:
    cfg = config(rollout={**MULTI, "max_turns": 3, "max_episode_tokens": 300})
    limits = cfg.rollout.episode_limits
    assert (limits.max_turns, limits.max_tokens_per_turn, limits.max_episode_tokens) == (3, 256, 300)
    assert config().rollout.kind == "single_turn"


def test_multi_turn_needs_a_named_family_and_knows_the_registered_ones() -> None:
    assert "needs rollout.model_family" in refusal(rollout={"kind": "multi_turn"})
    assert "not a registered family" in refusal(rollout={**MULTI, "model_family": "llama"})


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"rollout": {**MULTI, "mode": "async"}}, "set rollout.mode=sync"),
        ({"rollout": {**MULTI, "max_new_tokens": 32}}, "set rollout.max_tokens_per_turn instead"),
        ({"rollout": MULTI, "engine": {"batch_invariant": True}}, "set engine.batch_invariant=false"),
        ({"rollout": MULTI, "engine": {"logprobs": "recompute"}}, "engine.logprobs=recompute is not built"),
        ({"rollout": MULTI, "reward": {"fn": "exact_match"}}, "the environment gives the reward"),
        ({"rollout": MULTI, "eval": {"every_steps": 5}}, "set eval.every_steps=0"),
        ({"rollout": {**MULTI, "environment": "pkg.mod:Env"}, "sft": {"num_steps": 10}}, "set sft.num_steps=0"),
        ({"rollout": MULTI, "data": {"source": "addition"}, "sft": {"num_steps": 10}}, "set data.source=product"),
    ],
)
def test_what_multi_turn_does_not_do_is_refused_with_the_fix(sections: dict[str, Any], expected: str) -> None:
    assert expected in refusal(**sections)


def test_multi_turn_keys_are_refused_in_a_single_turn_run() -> None:
    assert "apply to rollout.kind=multi_turn only" in refusal(rollout={"model_family": "tiny", "max_turns": 2})
    assert "rollout.kind=multi_turn" in refusal(sft={"trace_no_tool_share": 0.1})
    with pytest.raises(ValueError, match="must be in"):
        config(rollout=MULTI, sft={"trace_wrong_operand_share": 1.5})


# ----- SFT traces -----


def test_product_task_is_three_digits_times_two() -> None:
    for e in make_product_task(50, seed=3):
        a, b = e.prompt.rstrip("=").split("*")
        assert len(a) == 3 and len(b) == 2 and e.answer == str(int(a) * int(b))


def test_a_trace_is_the_family_render_with_loss_on_the_assistant_turns_only() -> None:
    tok = build_tokenizer()
    traces = ToolTraces(make_product_task(5, seed=0), family="tiny", tokenizer=tok, batch_size=4, seed=0)
    trace = traces.trace((123, 45), random.Random(0))
    family = get_family("tiny")
    call = ToolCall(name="calculator", arguments={"expression": "123*45"})
    messages = [
        Message(role="system", content="Use the calculator tool for arithmetic, then answer with the number."),
        Message(role="user", content="123*45="),
        Message(role="assistant", tool_calls=(call,)),
        Message(role="tool", content="5535"),
        Message(role="assistant", content="5535"),
    ]
    tools = traces.env.start({"prompt": "", "answer": ""}).tools
    full = family.render(messages, tuple(tools), add_generation_prompt=False)
    # The session server's ids for this episode are the full render's (up to the final turn's closing newline).
    assert tok.decode(trace.prompt_ids + trace.response_ids) + "\n" == full
    trained = tok.decode([t for t, m in zip(trace.response_ids, trace.loss_mask, strict=True) if m])
    assert (
        trained
        == '<tool_call>{"name":"calculator","arguments":{"expression":"123*45"}}</tool_call><|im_end|>5535<|im_end|>'
    )


def test_traces_hold_the_requested_share_of_wrong_calls_and_direct_answers() -> None:
    tok = build_tokenizer()
    traces = ToolTraces(
        make_product_task(20, seed=0), family="tiny", tokenizer=tok, batch_size=4, seed=0,
        wrong_operand_share=0.3, no_tool_share=0.2,
    )  # fmt: skip
    rng = random.Random(1)
    kinds = {"right": 0, "wrong": 0, "direct": 0}
    for _ in range(400):
        text = tok.decode(traces.trace((123, 45), rng).response_ids)
        kinds["direct" if "tool_call" not in text else "right" if '"123*45"' in text else "wrong"] += 1
        assert "5535" in text or "tool_call" not in text or '"123*45"' not in text
    assert 0.22 < kinds["wrong"] / 400 < 0.38 and 0.13 < kinds["direct"] / 400 < 0.27
    a, b = traces.batch(3), traces.batch(3)
    assert a.input_ids.equal(b.input_ids) and not a.input_ids.equal(traces.batch(4).input_ids)


def test_traces_refuse_a_prompt_that_is_not_a_product() -> None:
    with pytest.raises(DataError, match="data.source=product"):
        ToolTraces(
            [Example(prompt="1+2=", answer="3")], family="tiny", tokenizer=build_tokenizer(), batch_size=1, seed=0
        )


# ----- the rollout -----


def test_a_step_s_episodes_repeat_exactly_and_another_step_draws_new_ones(
    shared_engine: Any, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    from hpcrl.engine.client import EngineClient
    from hpcrl.engine.config import EngineConfig
    from hpcrl.engine.fleet import EngineFleet
    from hpcrl.rollout.config import RolloutConfig
    from hpcrl.rollout.episodes import EpisodeRollout

    cfg = RolloutConfig(kind="multi_turn", model_family="tiny", n_samples_per_prompt=2, max_tokens_per_turn=12)
    examples = [Example(prompt="123*45=", answer="5535"), Example(prompt="321*54=", answer="17334")]
    with EngineClient(shared_engine.url) as client:
        fleet = EngineFleet(EngineConfig(), [client], launcher=None, on_event=lambda kind, detail: None)
        rollout = EpisodeRollout(
            cfg, fleet, model_dir=tiny_model_dir, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), seed=3
        )
        try:
            # A resumed run re-runs an unfinished step: the same seeds give the same episodes, token for token.
            first, again, other = (
                rollout.generate(5, examples),
                rollout.generate(5, examples),
                rollout.generate(6, examples),
            )
            metrics = rollout.pop_metrics()
        finally:
            rollout.close()
            fleet.close()

    def ids(groups: list[Any]) -> list[list[int]]:
        return [s.prompt_ids + s.output_ids for g in groups for s in g.samples]

    assert [len(g.samples) for g in first] == [2, 2]
    assert ids(first) == ids(again) and ids(first) != ids(other)
    assert all(s.loss_mask is not None and len(s.loss_mask) == len(s.output_ids) for g in first for s in g.samples)
    assert {"rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_error_share"} <= set(metrics)
    assert rollout.pop_metrics() == {}


# ----- hpcrl run -----

TOOL_RUN = [
    "num_steps=2",
    "sft.num_steps=120",
    "sft.batch_size=8",  # the warm start is most of the test's time; 120 steps of 8 traces teach the tool call
    "sft.lr=3e-3",
    "sft.log_every_steps=60",
    "data.prompts_per_step=2",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_turns=3",
    "rollout.max_tokens_per_turn=96",
    "checkpoint.every_steps=1",
]


def test_multi_turn_run_writes_episode_metrics_and_trains_only_sampled_tokens(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    text = (Path(__file__).resolve().parents[2] / "experiments" / "tool-quickstart.yaml").read_text()
    lines = [line for line in text.splitlines() if not line.strip().startswith("#")]
    (tmp_path / "tq.yaml").write_text(
        "\n".join(lines).replace("path: runs/models/tiny-qwen3-2l512", f"path: {tiny_model_dir}")
    )
    hpcrl("run", "tq.yaml", *TOOL_RUN, "--run-dir", "r", cwd=tmp_path, timeout_s=600)
    m = load_metrics(tmp_path / "r" / "metrics.h5")
    assert list(m["step"]) == [0, 1]
    for key in (
        "rollout/turns_mean",
        "rollout/tool_calls_mean",
        "rollout/tool_error_share",
        "rollout/episode_tokens_mean",
    ):
        assert key in m and np.isfinite(m[key]).all(), key
    # After SFT on tool traces the model calls the calculator, so an episode has a second turn after the tool's
    # answer, and the tool and template tokens between the turns are kept out of the loss.
    assert m["rollout/tool_calls_mean"].max() > 0 and m["rollout/turns_mean"].max() > 1
    assert (m["rollout/trained_token_share"] < 1).any()
    assert (m["rollout/episode_tokens_mean"] > m["rollout/response_len_mean"]).all()

    # Top-k/top-p: the turns record their supports, the tool tokens carry singletons, and the trainer renormalises
    # over them, so the gap stays float noise (scored over the whole vocabulary it would not).
    # It starts from the first run's policy, which already calls the tool, instead of repeating the warm start.
    replay = ["num_steps=1", "rollout.top_k=8", "rollout.top_p=0.9", f"model.path={tmp_path / 'r' / 'model'}",
              "sft.num_steps=0"]  # fmt: skip
    hpcrl("run", "tq.yaml", *TOOL_RUN, *replay, "--run-dir", "rep", cwd=tmp_path, timeout_s=600)
    m = load_metrics(tmp_path / "rep" / "metrics.h5")
    assert m["train/train_rollout_logprob_max_abs_diff"].max() <= 1e-4
    assert m["train/train_rollout_logprob_abs_diff"].max() <= 1e-6
    assert (m["rollout/support_size_mean"] > 1).all() and (m["rollout/support_size_max"] <= 8).all()


def test_a_multi_turn_run_restarts_a_killed_engine_and_reruns_its_episodes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """As a synchronous single-turn run does: the fleet restarts the dead engine, and the episodes it cut run again
    from their start with the same seeds, so every step trains its full groups."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from hpcrl.store import load_events
    from tests.support import REPO, read_until

    cmd = [
        sys.executable, "-m", "hpcrl.cli", "run", str(REPO / "experiments" / "tool-quickstart.yaml"),
        f"model.path={tiny_model_dir}", "num_steps=4", "sft.num_steps=0", "data.prompts_per_step=2",
        "rollout.n_samples_per_prompt=4", "rollout.max_tokens_per_turn=48", "engine.num_engines=1",
        "checkpoint.every_steps=2", "--run-dir", "r",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        read_until(proc, "step    1/4", lines)  # step 2's episodes start now
        pid = int(json.loads((tmp_path / "r" / "engines" / "engine-0.json").read_text())["pid"])
        os.kill(pid, signal.SIGKILL)
        out = "".join(lines) + proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    kinds = [e["kind"] for e in load_events(tmp_path / "r" / "metrics.h5")]
    assert "engine_dead" in kinds and "engine_restarted" in kinds, kinds
    m = load_metrics(tmp_path / "r" / "metrics.h5")
    assert list(m["step"]) == [0, 1, 2, 3]
    assert (m["rollout/num_samples"] == 8).all()  # every step trained its 2 groups of 4 episodes
    assert m["fleet/reissued_requests"].sum() > 0  # the episodes the dead engine cut ran again
