"""ShareGPT / SpecForge-style conversations as training data: the loss falls on the assistant turns only."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import char_tokenizer, make_target

from hf_blockpilot import BlockDiffusionDrafter
from hf_blockpilot.training import data as data_module
from hf_blockpilot.training.data import (
    RESPONSES_FILE,
    StoredSequences,
    TrainingSequence,
    chat_prompt_ids,
    conversation_prompts,
    generate_responses,
    read_conversations,
    read_sequences,
    write_conversations,
)
from hf_blockpilot.training.drafter import DrafterTrainer, DrafterTrainingConfig

# system "S<text>", user turns "U<text>", assistant turns "A<text>B", the generation prompt "A": each turn extends
# the ones before
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}A{{ m['content'] }}B{% elif m['role'] == 'system' %}"
    "S{{ m['content'] }}{% else %}U{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}A{% endif %}"
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
    assert list(read_sequences(tmp_path / "data")) == [first, second]


def test_a_template_that_does_not_extend_earlier_turns_is_a_clear_error(tmp_path, tokenizer):
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}Q{% endif %}"
    )
    path = _write(tmp_path / "chat.jsonl", [_conversation("ab", "cd")])
    with pytest.raises(ValueError, match=r"chat.jsonl:1: the chat template does not extend"):
        list(read_conversations(path, tokenizer))


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


def test_conversation_prompts_are_each_user_turn_after_the_turns_before_it(tmp_path, tokenizer):
    system = {"role": "system", "content": "be"}
    rows = [
        {"id": "c", "conversations": [system, *_conversation("ab", "cd", "ef", "gh", "ij")["conversations"]]},
        _conversation("xy", "zz", id="d"),
    ]
    prompts = list(conversation_prompts(_write(tmp_path / "chat.jsonl", rows)))
    assert [p.id for p in prompts] == ["c/1", "c/3", "c/5", "d/1"]  # the last user turn, unanswered, too
    assert prompts[1].system == "be" and prompts[1].history == (("ab", "cd"),) and prompts[1].prompt == "ef"
    assert [tokenizer.decode(chat_prompt_ids(tokenizer, p)) for p in prompts] == [
        "SbeUabA",
        "SbeUabAcdBUefA",
        "SbeUabAcdBUefAghBUijA",
        "UxyA",
    ]
    bad = _write(tmp_path / "bad.jsonl", [{"id": "e", "conversations": [{"role": "user", "content": "a"}] * 2}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: turns \['user', 'user'\] do not alternate"):
        list(conversation_prompts(bad))


def _tiny_answerer():
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    return target


def test_answers_are_sharded_over_ranks_resumed_and_read_as_one_data_set(tmp_path, tokenizer, monkeypatch):
    """Under torchrun each rank answers every world-size-th prompt into its own file; a rerun with another number
    of ranks answers only what no file holds, and a line a killed run left unfinished is answered again."""
    rows = [_conversation("ab"[: 1 + i % 2], "cd", "e" * (1 + i % 3), id=f"c{i}") for i in range(5)]
    path = _write(tmp_path / "chat.jsonl", rows)
    target, data = _tiny_answerer(), tmp_path / "data"
    answer = dict(batch_size=2, max_new_tokens=3, dtype=None)
    for rank in (0, 1):
        monkeypatch.setattr(data_module, "rank_and_world_size", lambda rank=rank: (rank, 2))
        generate_responses(target, tokenizer, conversation_prompts(path), data, **answer)
    expected = [p.id for p in conversation_prompts(path)]  # 10 prompts: two user turns a conversation
    shards = [[json.loads(line)["id"] for line in (data / f"responses.rank{r}.jsonl").open()] for r in (0, 1)]
    assert sorted(shards[0]) == sorted(expected[0::2]) and sorted(shards[1]) == sorted(expected[1::2])
    assert sorted(s.id for s in read_sequences(data)) == sorted(expected)

    rank1 = data / "responses.rank1.jsonl"
    lines = rank1.read_text().splitlines(keepends=True)
    rank1.write_text("".join(lines[:-1]) + lines[-1][:-5])  # killed while writing its last line
    lost = json.loads(lines[-1])["id"]
    assert lost not in {s.id for s in read_sequences(data)}
    monkeypatch.setattr(data_module, "rank_and_world_size", lambda: (0, 1))  # resumed by one process
    assert generate_responses(target, tokenizer, conversation_prompts(path), data, **answer) == 3
    assert [json.loads(line)["id"] for line in (data / RESPONSES_FILE).open()] == [lost]
    monkeypatch.setattr(data_module, "rank_and_world_size", lambda: (1, 2))
    assert generate_responses(target, tokenizer, conversation_prompts(path), data, **answer) == 0
    assert rank1.read_text() == "".join(lines[:-1])  # the unfinished line was cut off, nothing appended
    assert sorted(s.id for s in read_sequences(data)) == sorted(expected)


def test_stored_sequences_hold_one_offset_each_not_the_data(tmp_path):
    """Training reads its sequences from disk as it uses them: opening 20,000 sequences and setting a trainer up
    on them allocates a small fraction of what the sequences themselves take in memory."""
    import tracemalloc

    data = tmp_path / "data"
    data.mkdir()
    with (data / RESPONSES_FILE).open("w") as f:
        for i in range(20_000):
            ids = [3 + (i + t) % 45 for t in range(64)]
            f.write(json.dumps({"id": f"s/{i}", "prompt_ids": ids[:8], "response_ids": ids[8:]}) + "\n")
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4)
    config = DrafterTrainingConfig(block_size=4, bf16=False, validation_fraction=0.01)

    tracemalloc.start()
    stored = read_sequences(data)
    trainer = DrafterTrainer(drafter, target, stored, None, tmp_path / "run", config)
    lazy = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    whole = list(stored)
    materialized = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert isinstance(stored, StoredSequences) and len(stored) == 20_000
    assert len(trainer.sequences) + len(trainer.validation) <= 20_000 and len(trainer.validation) > 0
    assert lazy < materialized / 5, (lazy, materialized)
    assert trainer.sequences[3] == whole[trainer.sequences._indices[3]]
    assert isinstance(whole[0], TrainingSequence) and whole[5].input_ids[8:] == stored[5].input_ids[8:]


def test_train_drafter_self_distills_conversations(tmp_path, tokenizer):
    """`--conversations ... --self-distill`: the target answers every user turn after the turns before it, and the
    drafter trains on those answers (not the conversations' own assistant turns)."""
    from conftest import save_tiny_pair

    from hf_blockpilot.cli import main

    target_dir, _ = save_tiny_pair(tmp_path)
    tokenizer.save_pretrained(target_dir)
    path = _write(tmp_path / "chat.jsonl", [_conversation("abcd"[i:], "efghijk", "lm", id=f"c{i}") for i in range(2)])
    run = tmp_path / "run"
    command = ["train-drafter", "--target", str(target_dir), "--output-dir", str(run), "--conversations", str(path)]
    command += ["--self-distill", "--num-prompts", "0", "--chat-prompts", "0", "--max-new-tokens", "5"]
    command += ["--max-steps", "2", "--sequences-per-step", "2", "--num-layers", "1", "--block-size", "4"]
    command += ["--anchors", "3", "--draft-vocab-size", "0", "--validation-fraction", "0"]
    assert main(command) == 0
    answers = {s.id: s for s in read_sequences(run / "data")}
    assert sorted(answers) == ["c0/1", "c0/3", "c1/1", "c1/3"]
    assert tokenizer.decode(answers["c1/3"].input_ids[: answers["c1/3"].response_start]) == "UbcdAefghijkBUlmA"
    assert not (run / "data" / "conversations.jsonl").exists()
    assert BlockDiffusionDrafter.from_pretrained(run / "checkpoint").config.block_size == 4
    with pytest.raises(SystemExit, match="--self-distill answers the turns of --conversations"):
        main(["train-drafter", "--output-dir", str(run), "--self-distill"])
