"""Multi-turn sequences reach the trainer's batch with their loss masks: tool tokens never train."""

from __future__ import annotations

import pytest

from hpcrl.rollout.episodes import group_from_episodes
from hpcrl.samples.sample import Example
from hpcrl.sessions.environment import EpisodeResult
from hpcrl.trainer.advantage import batch_from_groups


def episode(reward: float) -> EpisodeResult:
    # prompt 3 tokens | sampled 2 | tool result + template 3 | sampled 2
    seq = {
        "token_ids": [1, 2, 3, 10, 11, 20, 21, 22, 12, 13],
        "loss_mask": [0, 0, 0, 1, 1, 0, 0, 0, 1, 1],
        "logprobs": [0.0, 0.0, 0.0, -0.5, -0.6, 0.0, 0.0, 0.0, -0.7, -0.8],
        "weight_versions": [None, None, None, 1, 1, None, None, None, 2, 2],
        "turns": [0, 1],
        "finish_reason": "stop",
    }
    return EpisodeResult(
        reward=reward,
        end_reason="answered",
        num_turns=2,
        num_tool_calls=1,
        num_tool_errors=0,
        sequences=[seq],
        messages=[{"role": "assistant", "content": "6"}],
    )


def test_group_of_episodes_trains_only_sampled_tokens() -> None:
    group = group_from_episodes(Example(prompt="2*3?", answer="6"), [episode(1.0), episode(0.0)])
    assert [s.prompt_ids for s in group.samples] == [[1, 2, 3]] * 2
    assert group.samples[0].loss_mask == [1, 1, 0, 0, 0, 1, 1]
    batch = batch_from_groups([group], normalize_std=True)
    # Target position t predicts token t+1: the response starts at position 2 (predicting token index 3).
    assert batch.loss_mask[0].tolist() == [False, False, True, True, False, False, False, True, True]
    assert batch.num_response_tokens == 8
    assert (
        batch.rollout_logprobs[0, 2:4].tolist() == pytest.approx([-0.5, -0.6])
        and batch.rollout_logprobs[0, 4:7].eq(0).all()
    )
    assert batch.advantages[0] > 0 > batch.advantages[1]


def test_single_turn_batches_are_unchanged_without_masks() -> None:
    from hpcrl.trainer.batch import TrainBatch

    plain = TrainBatch.from_sequences([[1, 2]], [[3, 4, 5]])
    ones = TrainBatch.from_sequences([[1, 2]], [[3, 4, 5]], response_masks=[[1, 1, 1]])
    assert plain.loss_mask.tolist() == ones.loss_mask.tolist() == [[False, True, True, True]]


def test_stale_share_counts_sampled_tokens_only() -> None:
    from hpcrl.rollout.generate import rollout_stats

    group = group_from_episodes(Example(prompt="2*3?", answer="6"), [episode(1.0)])
    # Turn 1 was sampled with version 1, turn 2 with version 2; the tool tokens between them have none.
    assert rollout_stats([group], 1.0, version=2)["rollout/stale_token_share"] == 0.5
