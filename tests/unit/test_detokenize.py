"""The engine's output text, decoded a chunk at a time while a row decodes, is the text of one decode of the whole
row: for the tiny model's character tokenizer, a byte-level BPE whose characters span several tokens, and a
SentencePiece-style tokenizer whose words start with a marker; for sampled text and for random ids alike."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from hpcrl.engine.config import EngineConfig
from hpcrl.engine.embedded.detokenize import CHUNK_TOKENS, RowText, TextDecoder, decode_ids
from hpcrl.engine.embedded.scheduler import Scheduler, SchedulerConfig, SeqRequest
from hpcrl.engine.protocol.answers import GrowingPackedColumn, pack_logprobs
from hpcrl.model.hf import load_model
from hpcrl.model.tiny import build_tokenizer

CORPUS = [
    "Hello world, 你好世界! 😀 emoji test. Grüße aus München — naïve café.",
    "def f(x):\n    return x ** 2  # 平方 🚀🚀",
    "日本語のテキストと한국어 텍스트 and plain ascii words",
]


def _byte_level() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>"], initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def _metaspace() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=["</s>"], unk_token="<unk>")
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize(
    "make", [build_tokenizer, _byte_level, _metaspace], ids=["character", "byte_level", "metaspace"]
)
def test_text_decoded_in_chunks_is_the_whole_decode(make: Any) -> None:
    tok = make()
    decoder = TextDecoder(tok)
    rng = random.Random(0)
    chunked = 0
    for trial in range(200):
        if trial % 2:  # random ids: characters cut between tokens, bytes that never make one, special tokens
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 300))]
        else:
            ids = tok.encode(rng.choice(CORPUS) * 6, add_special_tokens=False)[: rng.randrange(1, 300)]
        row = RowText()
        for end in range(1, len(ids) + 1):  # the scheduler's visits come at any step
            if rng.random() < 0.3:
                decoder.advance(row, ids[:end])
        chunked += bool(row.parts)
        # Text that tokenizer wrote: every chunk's cut works (a character split between tokens waits for its rest).
        assert trial % 2 or not row.whole, (trial, ids)
        assert decoder.text(row, ids) == decode_ids(tok, ids), (trial, ids)
    assert chunked > 100, "most rows' text must have advanced before the end, or this tests only the fallback"


def test_a_chunk_that_does_not_extend_its_context_makes_the_row_decode_whole() -> None:
    class Rewriting:  # a decoder whose text for more tokens rewrites the text for fewer
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return f"{len(ids)}:" + "x" * len(ids)

    decoder = TextDecoder(Rewriting())
    row, ids = RowText(), list(range(3 * CHUNK_TOKENS))
    decoder.advance(row, ids[:CHUNK_TOKENS])
    decoder.advance(row, ids[: 2 * CHUNK_TOKENS])
    assert row.whole
    assert decoder.text(row, ids) == f"{len(ids)}:" + "x" * len(ids)


def test_the_scheduler_advances_texts_while_rows_decode(tiny_model_dir: Path) -> None:
    tok = build_tokenizer()
    model = load_model(tiny_model_dir).eval()
    sched = Scheduler(
        model,
        # decode_overlap on: as on a GPU
        SchedulerConfig(engine=EngineConfig(max_running_requests=8, decode_overlap="on"), context_length=200),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    sched.text_decoder = TextDecoder(tok)
    rng = random.Random(3)
    reqs = [
        SeqRequest(
            rid=f"r{i}",
            prompt_ids=[rng.randrange(3, 99) for _ in range(6)],
            max_new_tokens=150 - 7 * i,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            seed=i,
            stop_token_ids=frozenset(),
            ignore_eos=True,
            return_logprob=True,
            return_sampling_mask=False,
            on_done=lambda r: None,
            packed_column=GrowingPackedColumn() if i % 2 else None,  # the rows that asked for the packed wire
        )
        for i in range(6)
    ]
    sched.submit(reqs)
    with torch.inference_mode():
        while sched.waiting or sched.running:
            sched._step()
        sched._drain()
    for r in reqs:
        assert len(r.output_ids) == r.max_new_tokens
        # All but the last chunk or two were decoded during the run, not after it.
        assert r.text.read >= len(r.output_ids) - 2 * CHUNK_TOKENS, (r.text.read, len(r.output_ids))
        assert sched.text_decoder is not None
        assert sched.text_decoder.text(r.text, r.output_ids) == tok.decode(r.output_ids, skip_special_tokens=True)
        if r.packed_column is not None:  # packed alongside the text, and to the same column as packed at the end
            assert r.packed_column.values_packed >= len(r.output_ids) - 2 * CHUNK_TOKENS
            assert r.packed_column.packed(r.logprobs) == pack_logprobs(r.logprobs)


@pytest.mark.parametrize("overlap", ["on", "off"])  # texts decoded in chunks while rows decode; each whole at the end
def test_the_answer_text_is_the_decode_of_its_ids(engine_factory: Any, overlap: str) -> None:
    url = engine_factory("--decode-overlap", overlap).url
    tok = build_tokenizer()
    body = {
        "input_ids": [[5, 6, 7, 8], [9, 10]],
        "sampling_params": {"max_new_tokens": 120, "ignore_eos": True, "sampling_seed": 11},
    }
    out = httpx.post(url + "/generate", json=body, timeout=120).json()
    for o in out:
        assert len(o["output_ids"]) == 120
        assert o["text"] == tok.decode(o["output_ids"], skip_special_tokens=True)
