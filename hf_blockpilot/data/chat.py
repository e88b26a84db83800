"""A prompt as the target sees it in a chat."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase


def chat_inputs(tokenizer: PreTrainedTokenizerBase, prompt: str, device: torch.device | str) -> torch.Tensor:
    """Prompt ids (1, n) with the tokenizer's chat template applied when it has one."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
