"""A prompt as the target sees it in a chat: one prompt's ids, or a left-padded batch of prompts."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase


def chat_text(
    tokenizer: PreTrainedTokenizerBase, prompt: str, history: Sequence[tuple[str, str]] = (), system: str = ""
) -> str:
    """The prompt as text, after the `system` message (if any) and the earlier `(user, assistant)` exchanges of
    `history`, with the tokenizer's chat template applied when it has one (else the turns joined by blank lines)."""
    if tokenizer.chat_template:
        messages = [{"role": "system", "content": system}] if system else []
        messages += [
            {"role": role, "content": text} for turn in history for role, text in zip(("user", "assistant"), turn)
        ]
        return tokenizer.apply_chat_template(
            [*messages, {"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return "\n\n".join([*([system] if system else []), *(text for turn in history for text in turn), prompt])


def chat_inputs(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    device: torch.device | str,
    history: Sequence[tuple[str, str]] = (),
) -> torch.Tensor:
    """Prompt ids (1, n) as `chat_text` formats them."""
    text = chat_text(tokenizer, prompt, history)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)


def chat_batch(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    device: torch.device | str,
    pad_token_id: int | None = None,
) -> dict[str, torch.Tensor]:
    """`input_ids` and `attention_mask` (B, n) of `prompts`, each formatted as `chat_inputs` formats it, left
    padded (the tokenizer's `padding_side="left"`) as batched `generate` expects. A tokenizer without a pad
    token pads with `pad_token_id` instead (the padding is masked out, so its value never reaches the model)."""
    if not prompts:
        raise ValueError("chat_batch needs at least one prompt")
    texts = [chat_text(tokenizer, prompt) for prompt in prompts]
    if tokenizer.pad_token_id is not None:
        batch = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
        return {"input_ids": batch["input_ids"].to(device), "attention_mask": batch["attention_mask"].to(device)}
    if pad_token_id is None:
        raise ValueError("the tokenizer has no pad token: pass pad_token_id to pad the batch with")
    rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, width - len(row) :] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
