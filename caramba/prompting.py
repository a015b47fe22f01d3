"""Turning user prompts into token ids and generated ids back into text.

Shared by the CLI and the runners so that `caramba generate` and a manifest run build the
same prompt from the same settings.
"""

from __future__ import annotations

from caramba.tokenizer import Tokenizer


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool = False, system_prompt: str | None = None) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": prompt}]
    # The template already writes the special tokens, so none are added on top.
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


def completion_text(tokenizer: Tokenizer, output_ids: list[int], stop_sequences: list[str] = ()) -> str:
    """Generated text without special tokens, cut before the first stop sequence.

    The ids keep the token that completed a stop sequence (as HF does); the text, like an
    OpenAI-style completion, ends just before it.
    """
    text = tokenizer.decode(output_ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop_sequences if s and s in text]
    return text[: min(cuts)] if cuts else text
