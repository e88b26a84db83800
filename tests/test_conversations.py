"""ShareGPT / SpecForge-style conversations as training data: the loss falls on the assistant turns only."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import char_tokenizer, make_target

from hf_blockpilot import BlockDiffusionDrafter
from hf_blockpilot.training.data import read_conversations, read_sequences, write_conversations
from hf_blockpilot.training.drafter import DrafterTrainer, DrafterTrainingConfig

# user turns "U<text>", assistant turns "A<text>B", the generation prompt "A": each turn extends the ones before
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}A{{ m['content'] }}B{% else %}U{{ m['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}A{% endif %}"
)


@pytest.fixture
def tokenizer():
    tokenizer = char_tokenizer(48)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _conversation(*turns: str, **extra) -> dict:
    """A role/content conversation whose turns alternate user, assistant, user, ..."""
    roles = ("user", "assistant")
    return {**extra, "conversations": [{"role": roles[i % 2], "content": turn} for i, turn in enumerate(turns)]}


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_assistant_turns_are_the_supervised_spans_in_either_layout(tmp_path, tokenizer):
    path = _write(
        tmp_path / "chat.jsonl",
        [
            _conversation("abc", "defg", "hi", "jklmn", id="two-turns"),
            {"conversations": [{"from": "human", "value": "xy"}, {"from": "gpt", "value": "zz"}]},
            _conversation("abc", id="no-answer"),
        ],
    )
    first, second = read_conversations(path, tokenizer)  # a conversation without an assistant turn is left out
    text = tokenizer.decode(first.input_ids)
    assert text == "UabcAdefgBUhiAjklmnB"
    assert [tokenizer.decode(first.input_ids[s:e]) for s, e in first.spans] == ["defgB", "jklmnB"]
    assert tokenizer.decode(first.supervised_tokens()) == "defgBjklmnB"
    assert all(tokenizer.decode(first.input_ids[p + 1]) in "defgBjklmnB" for p in first.anchor_candidates())
    assert second.id == "chat/2" and tokenizer.decode(second.input_ids[slice(*second.spans[0])]) == "zzB"
    write_conversations([first, second], tmp_path / "data")
    assert read_sequences(tmp_path / "data") == [first, second]


def test_a_template_that_does_not_extend_earlier_turns_is_a_clear_error(tmp_path, tokenizer):
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}Q{% endif %}"
    )
    path = _write(tmp_path / "chat.jsonl", [_conversation("ab", "cd")])
    with pytest.raises(ValueError, match=r"chat.jsonl:1: the chat template does not extend"):
        read_conversations(path, tokenizer)


def test_blocks_reaching_into_a_user_turn_carry_no_loss_there(tmp_path, tokenizer):
    path = _write(tmp_path / "chat.jsonl", [_conversation("abcdef", "ghijkl", "mnopqr", "stuvwx", id="c")])
    (seq,) = read_conversations(path, tokenizer)
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4)
    config = DrafterTrainingConfig(block_size=4, sequences_per_step=1, bf16=False, validation_fraction=0.0)
    trainer = DrafterTrainer(drafter, target, [seq], None, tmp_path / "run", config)
    end = seq.spans[0][1]  # the first assistant turn ends here ("B" at end - 1)
    _, counts = trainer.batch_loss([seq], trainer.hidden_states([seq]), anchors=[[end - 2]])
    assert counts["valid"].tolist() == [[True, False, False]]  # slot 1 = "B"; slots 2-3 = "Um": the user's turn
    anchors = trainer.random_anchors([seq], [random.Random(0)])[0]
    assert all(seq.input_ids[a + 1] in seq.supervised_tokens() for a in anchors)
    assert all(any(s - 1 <= a < e - 1 for s, e in seq.spans) for a in anchors)
    assert torch.is_tensor(counts["weight"]) and counts["weight"] > 0


def test_train_drafter_trains_on_conversations_alone(tmp_path, tokenizer):
    from conftest import save_tiny_pair

    from hf_blockpilot.cli import main

    target_dir, _ = save_tiny_pair(tmp_path)
    tokenizer.save_pretrained(target_dir)  # the turn-by-turn template
    rows = [_conversation("abcd"[i:], "efghijk", id=f"c{i}") for i in range(3)]
    path = _write(tmp_path / "chat.jsonl", rows)
    run = tmp_path / "run"
    command = ["train-drafter", "--target", str(target_dir), "--output-dir", str(run), "--conversations", str(path)]
    command += ["--num-prompts", "0", "--chat-prompts", "0", "--max-steps", "2", "--sequences-per-step", "2"]
    command += ["--num-layers", "1", "--block-size", "4", "--anchors", "3", "--draft-vocab-size", "0"]
    assert main(command) == 0
    assert [s.id for s in read_sequences(run / "data")] == ["c0", "c1", "c2"]
    assert BlockDiffusionDrafter.from_pretrained(run / "checkpoint").config.block_size == 4
