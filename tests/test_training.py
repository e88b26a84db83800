"""DFlash drafter training recipe: the attention mask, the loss, resumable checkpoints."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import char_tokenizer, make_target, make_windowed_drafter

from hf_blockpilot import BlockDiffusionDrafter
from hf_blockpilot.data import PromptRecord
from hf_blockpilot.training.data import (
    TrainingSequence,
    cache_hidden_states,
    chat_prompt_ids,
    load_hidden_states,
    unseen_prompts,
)
from hf_blockpilot.training.drafter import (
    DrafterTrainer,
    DrafterTrainingConfig,
    block_attention_mask,
    build_draft_vocab,
    init_drafter_from_target,
    is_validation_sequence,
    loss_weights,
)


def test_block_attention_mask_is_exactly_the_specified_one():
    anchors = torch.tensor([2, 5, 9])
    b, ctx = 4, 12
    mask = block_attention_mask(anchors, b, ctx)
    assert mask.shape == (3 * b, ctx + 3 * b)
    for q in range(3 * b):
        j = q // b
        for key in range(ctx):  # context: strictly before the block's anchor
            assert mask[q, key] == (key < anchors[j]), (q, key)
        for key in range(3 * b):  # blocks: only its own, bidirectionally
            assert mask[q, ctx + key] == (key // b == j), (q, key)


@pytest.mark.parametrize("is_causal", [None, False])
def test_training_a_sliding_window_drafter_is_refused(is_causal):
    """Its block mask would train full attention into layers that draft within a window."""
    drafter = make_windowed_drafter(make_target("qwen3", vocab_size=48, hidden_size=64), 4, is_causal=is_causal)
    with pytest.raises(ValueError, match="causal or sliding-window layers"):
        DrafterTrainer(drafter, None, [], None, "unused", DrafterTrainingConfig())


def test_loss_weights_decay_like_dflash():
    w = loss_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    torch.testing.assert_close(w[1] / w[0], torch.exp(torch.tensor(-1 / 7.0)))
    assert DrafterTrainingConfig(block_size=16).loss_gamma() == 7.0
    assert DrafterTrainingConfig(block_size=8).loss_gamma() == 4.0


def _periodic_sequences(vocab: int, count: int, length: int) -> list[TrainingSequence]:
    """Easy-to-learn data: each sequence counts upward modulo the vocabulary from a random start."""
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(count):
        start = int(torch.randint(3, vocab, (1,), generator=g))
        ids = [(start + t) % (vocab - 3) + 3 for t in range(length)]
        seqs.append(TrainingSequence(id=f"seq/{i}", input_ids=ids, response_start=4))
    return seqs


def test_training_step_lowers_loss_and_resumes(tmp_path):
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    seqs = _periodic_sequences(48, count=6, length=40)
    vocab = build_draft_vocab(seqs, size=40)
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4, draft_vocab=vocab)
    init_drafter_from_target(drafter, target)
    hidden_dir = cache_hidden_states(target, seqs, drafter.target_layer_ids, tmp_path / "hidden")
    cfg = DrafterTrainingConfig(
        block_size=4,
        anchors_per_sequence=8,
        sequences_per_step=2,
        max_steps=150,
        learning_rate=1e-2,
        warmup_steps=5,
        save_every=50,
        log_every=10,
        bf16=False,
        validation_fraction=0.0,
    )
    trainer = DrafterTrainer(drafter, target, seqs, hidden_dir, tmp_path / "run", cfg)
    torch.manual_seed(0)
    before = sum(trainer.sequence_loss(s, load_hidden_states(hidden_dir, s))[0].item() for s in seqs)
    summary = trainer.train()
    after = sum(trainer.sequence_loss(s, load_hidden_states(hidden_dir, s))[0].item() for s in seqs)
    assert after < 0.5 * before, (before, after)
    assert summary["step"] == 150 and summary["tau_estimate"] > 1.0

    # resuming picks up the saved step, weights and optimizer state
    fresh = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4, draft_vocab=vocab)
    resumed = DrafterTrainer(fresh, target, seqs, hidden_dir, tmp_path / "run", cfg)
    assert resumed.step == 150
    for (name, p), q in zip(drafter.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)
    reloaded = BlockDiffusionDrafter.from_pretrained(tmp_path / "run" / "checkpoint")
    assert reloaded.d2t.tolist() == vocab


def test_validation_split_is_held_out_and_tracks_generalisation(tmp_path, caplog):
    caplog.set_level("INFO", logger="hf_blockpilot")
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    seqs = _periodic_sequences(48, count=12, length=40)
    held = [s.id for s in seqs if is_validation_sequence(s.id, 0.3)]
    assert 0 < len(held) < len(seqs)
    assert held == [s.id for s in seqs if is_validation_sequence(s.id, 0.3)]  # deterministic
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4)
    init_drafter_from_target(drafter, target)
    hidden_dir = cache_hidden_states(target, seqs, drafter.target_layer_ids, tmp_path / "hidden")
    cfg = DrafterTrainingConfig(
        block_size=4,
        anchors_per_sequence=8,
        sequences_per_step=2,
        max_steps=120,
        learning_rate=1e-2,
        warmup_steps=5,
        save_every=1000,
        log_every=10,
        eval_every=60,
        bf16=False,
        validation_fraction=0.3,
    )
    trainer = DrafterTrainer(drafter, target, seqs, hidden_dir, tmp_path / "run", cfg)
    assert sorted(s.id for s in trainer.validation) == sorted(held)
    assert not {s.id for s in trainer.sequences} & set(held)
    before = trainer.evaluate()
    assert before == trainer.evaluate()  # fixed anchors: comparable across steps
    summary = trainer.train()
    assert summary["step"] == 120 and summary["val_sequences"] == len(held)
    assert summary["val_loss"] < 0.7 * before["val_loss"]  # the counting rule generalises to unseen starts
    assert summary["val_tau_estimate"] > before["val_tau_estimate"]
    assert 1.0 <= summary["val_tau_replay"] <= cfg.block_size  # chained rounds, as real decoding runs them
    assert f"step 120: held-out loss {summary['val_loss']:.3f}" in caplog.text  # shown while training runs
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").open()]
    assert [r["step"] for r in log if "val_loss" in r] == [60, 120]


def test_init_from_target_reads_the_targets_own_past():
    """With the first copied layer's input in the context, the drafter starts as that target layer."""
    target = make_target("llama", vocab_size=48, hidden_size=64, layers=4, seed=0)
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4, target_layer_ids=[0, 2])
    init_drafter_from_target(drafter, target)
    source = target.model.layers[3]
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, source.self_attn.q_proj.weight)
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, source.mlp.down_proj.weight)
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    hidden = torch.randn(1, 5, 2 * 64)
    # the context is exactly the target layer's normed input: the layer-2 half of the features
    torch.testing.assert_close(drafter.project_context(hidden), source.input_layernorm(hidden[..., 64:]))


def _cpu_bf16(monkeypatch, native: bool) -> None:
    """Make this CPU report native bf16 support (AMX / AVX-512 BF16) or not."""
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: native, raising=False)


@pytest.mark.parametrize("native", [False, True])
def test_generate_responses_resumes_and_uses_bf16_only_where_native(tmp_path, monkeypatch, native):
    from conftest import char_tokenizer

    from hf_blockpilot._compat import runs_bf16_natively
    from hf_blockpilot.data import PromptRecord
    from hf_blockpilot.training.data import generate_responses, read_sequences

    _cpu_bf16(monkeypatch, native)
    assert runs_bf16_natively("cpu") is native
    target = make_target("llama", vocab_size=48, hidden_size=64, seed=0)
    target.generation_config.eos_token_id = 5
    seen = set()
    target.register_forward_pre_hook(lambda module, args: seen.add(module.lm_head.weight.dtype))
    tokenizer = char_tokenizer(48)
    prompts = [PromptRecord(f"p{i}", "test", "abc" * (i + 1)) for i in range(5)]
    written = generate_responses(target, tokenizer, prompts[:3], tmp_path, batch_size=2, max_new_tokens=6)
    assert seen == {torch.bfloat16 if native else torch.float32}  # bf16 is emulated, and slow, without support
    assert target.dtype == torch.float32  # the caller's model is back to its own dtype
    assert written > 0
    generate_responses(target, tokenizer, prompts, tmp_path, batch_size=2, max_new_tokens=6)  # resumes
    seqs = read_sequences(tmp_path)
    assert sorted(s.id for s in seqs) == [f"p{i}" for i in range(5)]
    for seq in seqs:
        response = seq.input_ids[seq.response_start :]
        assert 1 <= len(response) <= 6
        assert 5 not in response[:-1]  # cut right after the first EOS


def test_unseen_prompts_leave_out_training_prompts_by_id_and_by_tokens(tmp_path):
    tokenizer = char_tokenizer(48)
    prompts = [PromptRecord(f"x/{i}", "x", text) for i, text in enumerate(["abc", "def", "ghi", "jkl", "mno"])]
    responses = tmp_path / "responses.jsonl"
    rows = [
        {"id": "x/0", "prompt_ids": [9], "response_ids": [1]},  # same id
        {
            "id": "other-seed/7",
            "prompt_ids": chat_prompt_ids(tokenizer, PromptRecord("y", "y", "ghi")),
            "response_ids": [1],
        },  # same text
    ]
    responses.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.id for p in unseen_prompts(prompts, tokenizer, responses, limit=2)] == ["x/1", "x/3"]
    assert [p.id for p in unseen_prompts(prompts, tokenizer, None, limit=10)] == [p.id for p in prompts]


def test_refreshed_draft_vocab_keeps_weights_and_covers_new_data(tmp_path, caplog):
    """Data of a new kind after a run: the vocabulary is rebuilt on resume, trained weights are kept."""
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    low = [TrainingSequence(f"low/{i}", [3 + (i + t) % 10 for t in range(30)], 4) for i in range(4)]
    high = [TrainingSequence(f"high/{i}", [30 + (i + t) % 10 for t in range(30)], 4) for i in range(4)]
    drafter = BlockDiffusionDrafter.from_target(
        target, num_hidden_layers=1, block_size=4, draft_vocab=build_draft_vocab(low, size=20, vocab_size=48)
    )
    hidden_dir = cache_hidden_states(target, low + high, drafter.target_layer_ids, tmp_path / "hidden")
    cfg = DrafterTrainingConfig(
        block_size=4,
        anchors_per_sequence=4,
        sequences_per_step=2,
        max_steps=5,
        warmup_steps=1,
        bf16=False,
        validation_fraction=0.0,
    )
    trainer = DrafterTrainer(drafter, target, low + high, hidden_dir, tmp_path / "run", cfg)
    assert trainer.vocab_coverage() < 0.6  # the "high" tokens cannot be drafted
    trainer.train()
    weights = {k: v.clone() for k, v in drafter.state_dict().items() if k != "d2t"}

    resumed = BlockDiffusionDrafter.from_pretrained(tmp_path / "run" / "checkpoint")
    trainer = DrafterTrainer(resumed, target, low + high, hidden_dir, tmp_path / "run", cfg)
    new_vocab = build_draft_vocab(low + high, size=20, vocab_size=48)
    trainer.set_draft_vocab(new_vocab)
    assert resumed.d2t.tolist() == new_vocab and trainer.vocab_coverage() > 0.99
    for name, value in weights.items():
        assert torch.equal(resumed.state_dict()[name], value), name
    head = target.get_output_embeddings().weight
    assert torch.equal(trainer.head_weight, head[torch.tensor(new_vocab)])
    assert trainer.target_to_draft[new_vocab[5]] == 5
    loss, _ = trainer.sequence_loss(high[0], load_hidden_states(hidden_dir, high[0]))
    assert torch.isfinite(loss)  # labels of the new kind are now in the vocabulary
    with pytest.raises(ValueError, match="20 ids"):
        trainer.set_draft_vocab(new_vocab[:8])


def test_batched_loss_pads_without_leaking_and_matches_per_sequence_losses(tmp_path):
    """One forward over sequences of different lengths gives each sequence's blocks exactly what a
    forward of that sequence alone gives: padding is never attended and padded anchor slots carry no loss."""
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    seqs = [
        TrainingSequence("long", [3 + (7 * t) % 40 for t in range(36)], 5),
        TrainingSequence("short", [4 + (3 * t) % 40 for t in range(12)], 6),  # 6 anchor candidates < 8 anchors
    ]
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=2, block_size=4)
    hidden_dir = cache_hidden_states(target, seqs, drafter.target_layer_ids, tmp_path / "hidden")
    cfg = DrafterTrainingConfig(block_size=4, anchors_per_sequence=8, bf16=False, validation_fraction=0.0)
    trainer = DrafterTrainer(drafter, target, seqs, hidden_dir, tmp_path / "run", cfg)
    hidden = trainer.hidden_states(seqs)
    assert hidden.shape[:2] == (2, 36)
    loss, acc = trainer.batch_loss(seqs, hidden, random.Random(3))
    rng = random.Random(3)  # the same anchors, one sequence at a time
    singles = [trainer.sequence_loss(s, load_hidden_states(hidden_dir, s), rng) for s in seqs]
    assert acc["valid"].shape == (8 + 6, 3)  # the short sequence's two padding blocks are dropped
    assert torch.equal(acc["correct"], torch.cat([a["correct"] for _, a in singles]))
    weights = loss_weights(4, cfg.loss_gamma())
    totals = [(a["valid"] * weights).sum() for _, a in singles]
    expected = sum(single_loss * w for (single_loss, _), w in zip(singles, totals)) / sum(totals)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_training_precision_follows_the_device(tmp_path, monkeypatch):
    """bf16 autocast (training step, target hidden states) only where bf16 is native; float32 elsewhere."""
    from hf_blockpilot.training.data import target_hidden_states

    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    seqs = _periodic_sequences(48, count=2, length=20)
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4)
    ids = drafter.target_layer_ids
    with torch.no_grad():
        out = target(input_ids=torch.tensor([s.input_ids for s in seqs]), output_hidden_states=True)
    fp32_states = torch.cat([out.hidden_states[i + 1] for i in ids], dim=-1).to(torch.bfloat16)
    for native in (False, True):
        _cpu_bf16(monkeypatch, native)
        cfg = DrafterTrainingConfig(block_size=4, validation_fraction=0.0)
        assert DrafterTrainer(drafter, target, seqs, None, tmp_path / "run", cfg).bf16 is native
        forced = DrafterTrainingConfig(block_size=4, validation_fraction=0.0, bf16=False)
        assert DrafterTrainer(drafter, target, seqs, None, tmp_path / "run", forced).bf16 is False
        states = target_hidden_states(target, seqs, ids)  # stored in bf16 either way
        assert states.dtype == torch.bfloat16
        assert torch.equal(states, fp32_states) is not native  # computed in fp32 unless bf16 is native


def test_live_hidden_states_match_the_disk_cache(tmp_path):
    """Without a cache the trainer has the target compute the same states in each step, and trains on them."""
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    seqs = _periodic_sequences(48, count=4, length=30)
    seqs[1].input_ids = seqs[1].input_ids[:17]
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4)
    hidden_dir = cache_hidden_states(target, seqs, drafter.target_layer_ids, tmp_path / "hidden")
    cfg = DrafterTrainingConfig(
        block_size=4,
        anchors_per_sequence=4,
        sequences_per_step=4,
        max_steps=3,
        warmup_steps=1,
        log_every=1,
        bf16=False,
        validation_fraction=0.0,
    )
    cached = DrafterTrainer(drafter, target, seqs, hidden_dir, tmp_path / "cached", cfg)
    live = DrafterTrainer(drafter, target, seqs, None, tmp_path / "live", cfg)
    cached_states, live_states = cached.hidden_states(seqs), live.hidden_states(seqs)
    for row, seq in enumerate(seqs):
        n = len(seq.input_ids)
        torch.testing.assert_close(live_states[row, :n], cached_states[row, :n], rtol=2e-2, atol=2e-2)
        assert not cached_states[row, n:].any()  # the cache pads with zeros
    assert live.train()["step"] == 3 and not (tmp_path / "live" / "hidden").exists()


def own_responses_trainer(tmp_path, target=None, steps: int = 80, dflash2=None, **config):
    """A tiny target (`target`, else a qwen3 one), its greedy responses to 6 prompts, and the trainer of a drafter
    (a DFlash 2 one with `dflash2` sizes) on them, set for `steps` steps (not yet run); `config` overrides."""
    target = target or make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, target.config.vocab_size, (1, 6), generator=g) for _ in range(6)]
    responses = [
        target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=30, do_sample=False) for p in prompts
    ]
    seqs = [TrainingSequence(f"r/{i}", r[0].tolist(), 6) for i, r in enumerate(responses)]
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4, dflash2=dflash2)
    init_drafter_from_target(drafter, target)
    settings = dict(block_size=4, anchors_per_sequence=16, sequences_per_step=3, max_steps=steps, learning_rate=1e-2)
    settings |= dict(warmup_steps=5, save_every=1000, bf16=False, validation_fraction=0.0)
    cfg = DrafterTrainingConfig(**settings | config)
    return target, prompts, responses, seqs, DrafterTrainer(drafter, target, seqs, None, tmp_path / "run", cfg)


#: DFlash 2 sizes for the tests' tiny targets (hidden size 64).
DFLASH2_SIZES = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5}


def _trained_on_own_responses(tmp_path, steps: int = 80, dflash2=None):
    """`own_responses_trainer`'s drafter, trained (so rounds accept drafts)."""
    target, prompts, responses, seqs, trainer = own_responses_trainer(tmp_path, steps=steps, dflash2=dflash2)
    trainer.train()
    trainer.drafter.eval()
    return target, prompts, responses, seqs, trainer


@pytest.mark.parametrize("dflash2", [None, DFLASH2_SIZES], ids=["dflash", "dflash2"])
def test_replay_acceptance_equals_real_greedy_decoding(tmp_path, dflash2):
    """Chained teacher-forced rounds on the target's own greedy response == `generate` with the drafter (DFlash 2:
    the candidate selector's teacher-forced choices, what its training scores, chain into the same rounds)."""
    target, prompts, responses, seqs, trainer = _trained_on_own_responses(tmp_path, dflash2=dflash2)
    drafter = trainer.drafter
    accepted_any = False
    for prompt, response, seq in zip(prompts, responses, seqs):
        replay = trainer.replay_acceptance(seq, trainer.hidden_states([seq])[0], chunk=5)
        out = target.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            assistant_model=drafter,
            max_new_tokens=30,
            do_sample=False,
            draft_controller=drafter.block_size,  # every draft verified, as the replay
        )
        assert torch.equal(out, response)
        real = [a + 1 for a in drafter.last_stats.accepted_per_round[1:]]  # per target forward after the prefill
        assert replay[:-1] == real[:-1]  # the last round: generate shortens the block to the tokens left
        assert sum(replay) == sum(real) == len(seq.input_ids) - 7  # every token but the prefill's
        accepted_any |= max(real) > 1
    assert accepted_any


def test_decoding_anchors_are_where_real_rounds_start_and_are_trained_on(tmp_path):
    target, prompts, responses, seqs, trainer = _trained_on_own_responses(tmp_path, steps=40)
    drafter = trainer.drafter
    for prompt, seq in zip(prompts, seqs):
        decoding = trainer.decoding_anchors(seq, trainer.hidden_states([seq])[0])
        target.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            assistant_model=drafter,
            max_new_tokens=30,
            do_sample=False,
            draft_controller=drafter.block_size,  # every draft verified, as the replay
        )
        committed = [a + 1 for a in drafter.last_stats.accepted_per_round[1:]]
        real = [6 + sum(committed[:i]) for i in range(len(committed))]  # each round anchors at its last token
        assert decoding == real

        seq_hidden = trainer.hidden_states([seq])[0]
        window = trainer.decoding_anchors(seq, seq_hidden, window=10)  # rounds chained from a random start
        assert len(window) >= 1 and window[0] + 10 <= len(seq.input_ids) - 1 and window[-1] < window[0] + 10
        full = trainer.replay_acceptance(seq, seq_hidden)
        assert trainer.replay_acceptance(seq, seq_hidden, start=6, stop=len(seq.input_ids) - 1) == full

    trainer.config.decoding_anchor_fraction = 0.5
    batch = seqs[:3]
    hidden = trainer.hidden_states(batch)
    original = trainer.decoding_anchors
    trainer.decoding_anchors = lambda seq, hidden, window, rng: [
        seq.response_start + 2 * i for i in range(window // 2 + 3)
    ]
    rngs = [random.Random(i) for i in range(3)]
    for seq, anchors in zip(batch, trainer.training_anchors(batch, hidden, rngs), strict=True):
        assert anchors == sorted(set(anchors)) and len(anchors) == 16  # distinct, sorted, anchors_per_sequence
        assert all(seq.response_start - 1 <= a < len(seq.input_ids) - 1 for a in anchors)
        assert {seq.response_start + 2 * i for i in range(8)} <= set(anchors)  # half of them: the first 8 rounds
    trainer.decoding_anchors = original

    def loss_at_decoding_anchors() -> float:
        anchors = [trainer.decoding_anchors(s, trainer.hidden_states([s])[0]) for s in seqs]
        with torch.no_grad():
            return trainer.batch_loss(seqs, trainer.hidden_states(seqs), anchors=anchors)[0].item()

    before = loss_at_decoding_anchors()
    calls = []
    original = trainer.training_anchors
    trainer.training_anchors = lambda *args: calls.append(1) or original(*args)
    trainer.config.max_steps = 70
    drafter.train()
    trainer.train()
    assert len(calls) == 30  # every step drew its anchors this way
    assert loss_at_decoding_anchors() < before

    with pytest.raises(ValueError, match="decoding_anchor_fraction"):
        DrafterTrainingConfig(decoding_anchor_fraction=1.5)


def test_generate_responses_stops_starting_batches_after_max_seconds(tmp_path, monkeypatch):
    """A time-boxed run keeps the batches answered so far; a rerun goes on with the rest."""
    from hf_blockpilot.training import data as training_data

    target = make_target("llama", vocab_size=48, hidden_size=64, seed=0)
    tokenizer = char_tokenizer(48)
    prompts = [PromptRecord(f"p{i}", "test", "abc" * (i + 1)) for i in range(6)]
    clock = iter(range(0, 1000, 10))  # each reading of the module's clock is 10 s later
    monkeypatch.setattr(training_data, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    generate_responses = training_data.generate_responses
    generate_responses(target, tokenizer, prompts, tmp_path, batch_size=2, max_new_tokens=4, max_seconds=25)
    assert len(training_data.read_sequences(tmp_path)) == 4  # batches started at 10 s and 20 s; not at 30 s
    generate_responses(target, tokenizer, prompts, tmp_path, batch_size=2, max_new_tokens=4)
    assert sorted(s.id for s in training_data.read_sequences(tmp_path)) == [f"p{i}" for i in range(6)]


def test_checkpoints_every_few_minutes_and_calls_on_save(tmp_path, monkeypatch):
    from hf_blockpilot.training import drafter as training_drafter

    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    seqs = _periodic_sequences(48, count=4, length=24)
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4)
    cfg = DrafterTrainingConfig(
        block_size=4,
        anchors_per_sequence=4,
        sequences_per_step=2,
        max_steps=6,
        warmup_steps=1,
        save_every=1000,
        save_every_minutes=1.0,
        log_every=2,
        bf16=False,
        validation_fraction=0.0,
    )
    trainer = DrafterTrainer(drafter, target, seqs, None, tmp_path / "run", cfg)
    clock = iter(range(0, 100_000, 25))  # 25 s per reading: a minute passes every few steps
    monkeypatch.setattr(training_drafter, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    saved = []
    trainer.train(on_save=lambda t: saved.append(t.step))
    assert saved[-1] == 6 and len(saved) >= 3 and saved == sorted(saved)  # by time, and once at the end
    assert BlockDiffusionDrafter.from_pretrained(tmp_path / "run" / "checkpoint") is not None
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").open()]
    assert [r["step"] for r in log if "tokens_per_second" in r] == [2, 4, 6]
    assert all(r["seconds"] > 0 and r["tokens_per_second"] > 0 for r in log if "seconds" in r)
