"""Parity with the DFlash authors' own implementation (PyPI `dflash==0.1.0`, a test-only dependency installed
with `--no-deps`; the library never imports it): checkpoints built and saved by the reference classes load
unchanged and draft exactly what the reference drafts, round for round."""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch
from conftest import greedy_generate, make_target
from transformers import DynamicCache, Qwen3Config

from hf_blockpilot import BlockDiffusionDrafter
from hf_blockpilot.modeling_block_diffusion import DraftContextCache

reference = pytest.importorskip("dflash.model", reason="the reference package: pip install --no-deps dflash==0.1.0")

VOCAB, HIDDEN = 24, 64  # prompts avoid id 0: `generate` takes it for padding (pad_token_id=0) and masks it


def reference_config(
    target, num_layers: int, block_size: int, layer_ids, architecture: str = "DFlashDraftModel", **dflash_fields
) -> Qwen3Config:
    """A drafter config in z-lab's layout, as the reference's classes read it, sized for `target`."""
    text = target.config.get_text_config()
    config = Qwen3Config(
        hidden_size=text.hidden_size,
        intermediate_size=2 * text.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=text.vocab_size,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    config.num_target_layers = text.num_hidden_layers
    config.block_size = block_size
    config.dflash_config = {"mask_token_id": text.vocab_size - 1, "target_layer_ids": list(layer_ids), **dflash_fields}
    config.architectures = [architecture]
    return config


def reference_drafter(target, directory, num_layers=2, block_size=4, layer_ids=(0, 2), seed=0, sharpen=6.0):
    """A random drafter built and saved by the reference's `DFlashDraftModel` (z-lab's layout)."""
    config = reference_config(target, num_layers, block_size, layer_ids)
    torch.manual_seed(seed)
    model = reference.DFlashDraftModel(config).eval()
    with torch.no_grad():  # a random init drafts nearly uniformly: sharpen it so drafts are often accepted
        model.norm.weight.mul_(sharpen)
    model.save_pretrained(directory)
    return model


def _target(family: str, seed: int):
    target = make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN, seed=seed)
    with torch.no_grad():  # peaked next-token distributions: greedy runs that a drafter can follow
        target.model.norm.weight.mul_(4.0)
    return target


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_draft_hidden_states_equal_the_reference_fresh_and_cached(tmp_path, family):
    target = _target(family, seed=0)
    ref = reference_drafter(target, tmp_path / "d")
    ours = BlockDiffusionDrafter.from_pretrained(tmp_path / "d").eval()
    assert ours.block_size == 4 and ours.mask_token_id == VOCAB - 1 and ours.target_layer_ids == [0, 2]
    assert_cached_drafts_equal(ref, ours, target, spans=((0, 9), (9, 13)), width=4, tolerance=1e-5)


def assert_cached_drafts_equal(ref, ours, target, spans, width: int, tolerance: float) -> None:
    """Blocks of `width` drafted after a fresh context (the first span), then after each further span on the
    cached one (the reference's own cache, cropped as its loop does): equal draft hidden states and equal draft
    distributions at T = 1."""
    ids = torch.randint(1, VOCAB - 1, (1, spans[-1][1] + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        context = torch.cat([hidden[i + 1] for i in ours.target_layer_ids], dim=-1)
        embed = target.get_input_embeddings()
        ref_cache, our_cache = reference._make_cache(ref.config), DraftContextCache()
        for start, stop in spans:
            block = torch.full((1, width), ours.mask_token_id)
            block[0, 0] = ids[0, stop]
            positions = torch.arange(start, stop + width)[None]
            expected = ref(
                target_hidden=context[:, start:stop],
                noise_embedding=embed(block),
                position_ids=positions,
                past_key_values=ref_cache,
                use_cache=True,
            )[:, -width:]
            reference._crop_to(ref_cache, stop)  # keep the context only, as the reference loop does
            got = ours(
                block_embeds=embed(block),
                block_position_ids=positions[:, -width:],
                target_hidden=context[:, start:stop],
                context_position_ids=positions[:, :-width],
                cache=our_cache,
            ).last_hidden_state
            torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(
                ours.finish_logits(target.lm_head(got)).softmax(-1),
                ref.compute_logits(expected, target.lm_head).softmax(-1),
            )


#: The newer z-lab drafters' draft-layer attention (gpt-oss family, larger DFlash 2 drafters), each field where the
#: reference reads it, with the (is_causal, sliding_window) each of the two layers gets. Windows of 2-4 tokens:
#: contexts and blocks longer than them.
ATTENTION_EDITS = {
    "sliding layer (causal by default), full layer": (
        lambda c: c.update(
            layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=3
        ),
        [(True, 3), (False, None)],
    ),
    "sliding layers, is_causal=false": (
        lambda c: c.update(
            layer_types=["sliding_attention"] * 2, use_sliding_window=True, sliding_window=2, is_causal=False
        ),
        [(False, 2), (False, 2)],
    ),
    "full and sliding layer, is_causal=true": (
        lambda c: c.update(
            layer_types=["full_attention", "sliding_attention"],
            use_sliding_window=True,
            sliding_window=4,
            is_causal=True,
        ),
        [(True, None), (True, 4)],
    ),
    "full layers, is_causal=true": (lambda c: c.update(is_causal=True), [(True, None), (True, None)]),
    "use_sliding_window=true over max_window_layers": (
        lambda c: (c.pop("layer_types"), c.update(use_sliding_window=True, sliding_window=3, max_window_layers=1)),
        [(False, None), (True, 3)],
    ),
    "sliding layers, use_sliding_window=false (no window: causal)": (
        lambda c: c.update(layer_types=["sliding_attention"] * 2, use_sliding_window=False, sliding_window=4),
        [(True, None), (True, None)],
    ),
    "use_sliding_window=false (window off)": (
        lambda c: (c.pop("layer_types"), c.update(use_sliding_window=False, sliding_window=2, max_window_layers=0)),
        [(False, None), (False, None)],
    ),
}


@pytest.mark.parametrize("version", ["v1", "dflash2"])
@pytest.mark.parametrize("attention", sorted(ATTENTION_EDITS))
def test_draft_attention_kinds_draft_as_the_reference(tmp_path, monkeypatch, version, attention):
    """Sliding-window and causal draft layers, v1 and DFlash 2: each layer attends as the reference's, with equal
    draft hidden states and T = 1 distributions (fresh, then cached over a context longer than the window) and
    greedy rounds equal to `dflash_generate`'s."""
    from test_dflash2 import reference_dflash2  # that module imports this one

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    edit, layers = ATTENTION_EDITS[attention]
    target = _target("qwen3", seed=1).double()
    (reference_drafter if version == "v1" else reference_dflash2)(target, tmp_path / "d", block_size=6, seed=3)
    _edit_config(tmp_path / "d", edit)
    model_class = reference.DFlashDraftModel if version == "v1" else reference.DFlash2DraftModel
    ref = model_class.from_pretrained(tmp_path / "d", dtype=torch.float64).eval()
    ours = BlockDiffusionDrafter.from_pretrained(tmp_path / "d", dtype=torch.float64).eval()
    for model in (ref, ours):
        assert [(layer.self_attn.is_causal, layer.self_attn.sliding_window) for layer in model.layers] == layers
    if "sliding_attention" in (ref.config.layer_types or []) and ref.config.sliding_window is None:
        # the reference's cache builder asks Transformers for window layers of no window, which fails; its
        # causal layers keep the whole context, as a plain cache does
        monkeypatch.setattr(reference, "_make_cache", lambda config: DynamicCache())
    assert_cached_drafts_equal(ref, ours, target, spans=((0, 9), (9, 13), (13, 14), (14, 20)), width=6, tolerance=1e-9)
    full = partial = 0
    for case in range(4):
        counts = assert_rounds_equal_the_reference(ref, ours, target, random.Random(case), case)
        full, partial = full + counts[0], partial + counts[1]
    assert full + partial > 0, "no draft was ever accepted: the rounds compared nothing"


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 3, 20])
def test_draft_attention_mask_is_the_references(is_causal, window):
    from hf_blockpilot.attention import draft_attention_mask

    for q_len, k_len in ((1, 1), (4, 4), (4, 11), (6, 9)):
        query, key = torch.zeros(1, 1, q_len, 2), torch.zeros(1, 1, k_len, 2)
        expected = reference._attention_mask(query, key, is_causal=is_causal, sliding_window=window)
        got = draft_attention_mask(q_len, k_len, is_causal, window, query.device)
        assert expected.all() if got is None else torch.equal(got, expected), (q_len, k_len)


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """A tiny drafter trained briefly (by this package) on a tiny target's own greedy answers, saved in the
    z-lab layout: often right, so rounds accept whole blocks as well as parts of them."""
    from hf_blockpilot.training.data import TrainingSequence, cache_hidden_states
    from hf_blockpilot.training.drafter import (
        DrafterTrainer,
        DrafterTrainingConfig,
        init_drafter_from_target,
    )

    root = tmp_path_factory.mktemp("trained")
    target = _target("qwen3", seed=0)
    g = torch.Generator().manual_seed(0)
    sequences = []
    for i in range(24):
        prompt = torch.randint(1, VOCAB - 1, (1, 2 + i % 12), generator=g)
        answer = greedy_generate(target, prompt, 40, None)
        sequences.append(TrainingSequence(id=f"s{i}", input_ids=answer[0].tolist(), response_start=prompt.shape[1]))
    torch.manual_seed(0)
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4, target_layer_ids=[1, 3])
    init_drafter_from_target(drafter, target)
    hidden = cache_hidden_states(target, sequences, drafter.target_layer_ids, root / "hidden", dtype=torch.float32)
    config = DrafterTrainingConfig(
        block_size=4,
        anchors_per_sequence=8,
        sequences_per_step=4,
        max_steps=120,
        learning_rate=1e-2,
        warmup_steps=5,
        save_every=1000,
        log_every=1000,
        bf16=False,
        validation_fraction=0.0,
    )
    DrafterTrainer(drafter, target, sequences, hidden, root / "run", config).train()
    drafter.eval().save_pretrained(root / "drafter")
    return target, root / "drafter"


def _random_case(rng: random.Random, targets: dict, directory, case: int):
    target = targets[rng.choice(sorted(targets))]
    block_size = rng.choice([2, 3, 4, 6, 8])
    reference_drafter(
        target,
        directory,
        num_layers=rng.choice([1, 2]),
        block_size=block_size,
        layer_ids=rng.choice([(1,), (0, 2), (1, 2, 3)]),
        seed=case,
    )
    return target, directory, block_size


def test_per_round_acceptance_equals_the_reference_loop(tmp_path, monkeypatch, trained_checkpoint):
    """>= 20 randomized greedy cases, random drafters built by the reference and a briefly trained one saved by
    us: the rounds (tokens committed per verify forward) equal `dflash_generate`'s, and the output equals plain
    `generate`; full and partial acceptance both occur."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # its statistics time with CUDA syncs
    full = partial = 0
    targets = {(family, seed): _target(family, seed) for family in ("qwen3", "llama") for seed in (0, 1)}
    for case in range(32):
        rng = random.Random(case)
        if case % 2:
            target, directory, block_size = _random_case(rng, targets, tmp_path / f"d{case}", case)
        else:  # the trained drafter, at several block sizes
            (target, directory), block_size = trained_checkpoint, rng.choice([2, 3, 4, 6, 8])
        # float64 throughout: the two loops batch their forwards differently, and in float32 the rounding can flip
        # a near-tied argmax of a barely trained drafter, which would compare rounding, not behaviour
        target = target.double()
        ref = reference.DFlashDraftModel.from_pretrained(directory, dtype=torch.float64).eval()
        ours = BlockDiffusionDrafter.from_pretrained(directory, dtype=torch.float64).eval()
        ref.block_size = ours.block_size = block_size
        counts = assert_rounds_equal_the_reference(ref, ours, target, rng, case)
        full, partial = full + counts[0], partial + counts[1]
    assert full >= 5 and partial >= 5, (full, partial)


def assert_rounds_equal_the_reference(ref, ours, target, rng: random.Random, case: int) -> tuple[int, int]:
    """One random prompt and length decoded greedily by `dflash_generate` and by ours: both equal plain
    `generate`, round for round the same; returns the counts of fully and partly accepted rounds."""
    prompt = torch.randint(1, VOCAB - 1, (1, rng.randint(2, 16)), generator=torch.Generator().manual_seed(case))
    max_new = rng.randint(4, 40)
    expected = reference.dflash_generate(ref, target, prompt, max_new, stop_token_ids=None, return_stats=True)
    got = greedy_generate(target, prompt, max_new, None, assistant_model=ours, draft_controller=ours.block_size)
    plain = greedy_generate(target, prompt, max_new, None)
    assert torch.equal(got, plain) and torch.equal(expected.output_ids, plain), case
    committed = [a + 1 for a in ours.last_stats.accepted_per_round[1:]]  # round 0 is the prefill
    assert committed == expected.acceptance_lengths, (case, committed, expected.acceptance_lengths)
    return sum(c == ref.block_size for c in committed), sum(1 < c < ref.block_size for c in committed)


def _edit_config(directory, edit) -> None:
    import json

    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


FIELD_EDITS = {
    # each field the reference reads, where the reference reads it
    "dflash_config.block_size": lambda c: c["dflash_config"].update(block_size=5),
    "top-level mask_token_id and target_layer_ids": lambda c: c.update(
        mask_token_id=c["dflash_config"].pop("mask_token_id"),
        target_layer_ids=c["dflash_config"].pop("target_layer_ids"),
    ),
    "input_embedding_scale": lambda c: c["dflash_config"].update(input_embedding_scale=2.5),
    "output_multiplier": lambda c: c.update(output_multiplier=0.4),
    "final_logit_softcapping": lambda c: c["dflash_config"].update(final_logit_softcapping=2.0),
}


@pytest.mark.parametrize("field", sorted(FIELD_EDITS))
def test_config_fields_the_reference_reads_are_honoured(tmp_path, monkeypatch, field):
    """Each field changes the drafts the same way in both implementations: equal draft distributions (T = 1,
    where a multiplier or softcap matters even when the argmax does not) and equal greedy rounds."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    target = _target("qwen3", seed=1).double()
    reference_drafter(target, tmp_path / "d", block_size=4, seed=3, sharpen=3.0)
    _edit_config(tmp_path / "d", FIELD_EDITS[field])
    ref = reference.DFlashDraftModel.from_pretrained(tmp_path / "d", dtype=torch.float64).eval()
    ours = BlockDiffusionDrafter.from_pretrained(tmp_path / "d", dtype=torch.float64).eval()
    assert ours.block_size == ref.block_size and ours.mask_token_id == ref.mask_token_id
    assert ours.target_layer_ids == list(ref.target_layer_ids)
    ids = torch.randint(1, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        context = torch.cat([hidden[i + 1] for i in ours.target_layer_ids], dim=-1)
        block = torch.full((1, ours.block_size), ours.mask_token_id)
        block[0, 0] = ids[0, -1]
        positions = torch.arange(12 + ours.block_size)[None]
        scale = float(reference._draft_value(ref.config, "input_embedding_scale", 1.0))
        expected = ref.compute_logits(
            ref(
                target_hidden=context,
                noise_embedding=reference._raw_input_embeddings(target, block, scale),
                position_ids=positions,
            )[:, 1:],
            target.lm_head,
        )
        got = ours.finish_logits(
            target.lm_head(
                ours(
                    block_embeds=ours.embed_block(target.get_input_embeddings(), block),
                    block_position_ids=positions[:, 12:],
                    target_hidden=context,
                    context_position_ids=positions[:, :12],
                ).last_hidden_state[:, 1:]
            )
        )
    torch.testing.assert_close(got.softmax(-1), expected.softmax(-1))
    for seed in range(4):
        prompt = torch.randint(1, VOCAB - 1, (1, 3 + seed), generator=torch.Generator().manual_seed(seed))
        expected_run = reference.dflash_generate(ref, target, prompt, 24, stop_token_ids=None, return_stats=True)
        got_run = greedy_generate(target, prompt, 24, None, assistant_model=ours, draft_controller=ours.block_size)
        assert torch.equal(got_run, expected_run.output_ids)
        assert [a + 1 for a in ours.last_stats.accepted_per_round[1:]] == expected_run.acceptance_lengths


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(is_causal="yes"), "is_causal must be true, false or absent"),
        (
            lambda c: c.update(
                layer_types=["sliding_attention"] * c["num_hidden_layers"], use_sliding_window=True, sliding_window=0
            ),
            "sliding_window must be an int >= 1",
        ),
        (
            lambda c: c.update(layer_types=["chunked_attention"] * c["num_hidden_layers"]),
            r"lists \['chunked_attention'\], which hf-blockpilot does not implement",
        ),
        # weights under the other architecture name: never load as the other family and draft something else
        (lambda c: c.update(architectures=["DFlash2DraftModel"]), "lacks DFlash 2 fields"),
        (lambda c: c["dflash_config"].update(noise_schedule="cosine"), r"does not know: \['noise_schedule'\]"),
    ],
)
def test_fields_the_package_cannot_honour_are_errors(tmp_path, edit, message):
    target = _target("qwen3", seed=0)
    reference_drafter(target, tmp_path / "d")
    _edit_config(tmp_path / "d", edit)
    with pytest.raises(ValueError, match=message):
        BlockDiffusionDrafter.from_pretrained(tmp_path / "d")


def test_speed_comparison_runs_both_loops_on_the_same_drafter(trained_checkpoint):
    """`bench --reference`: ours through `generate` and `dflash_generate`, same weights and b; both lossless,
    round for round the same (equal τ), each with a per-round drafter / target / loop breakdown."""
    from conftest import char_tokenizer

    from hf_blockpilot.data import PromptRecord
    from hf_blockpilot.tools.reference_peer import (
        ReferencePeer,
        peer_markdown,
        summarize_peers,
    )

    target, directory = trained_checkpoint
    drafter = BlockDiffusionDrafter.from_pretrained(
        directory, dtype=target.dtype
    ).eval()  # an earlier test made it fp64
    tokenizer = char_tokenizer(VOCAB)
    tokenizer.chat_template = None
    prompts = [PromptRecord(f"p{i}", "tiny", text) for i, text in enumerate(["abcab", "fedcbafe", "ghij"])]
    runs = ReferencePeer(drafter).compare(target, tokenizer, prompts, [2, 4], max_new_tokens=20, repeats=2)
    assert len(runs) == 3 * 2 * 2
    for prompt in prompts:
        for b in (2, 4):
            ours, theirs = (
                next(r for r in runs if (r.prompt_id, r.block_size, r.method) == (prompt.id, b, side))
                for side in ("hf-blockpilot", "dflash-reference")
            )
            assert ours.identical_to_plain and theirs.identical_to_plain
            assert ours.new_tokens == theirs.new_tokens == 20
            assert ours.target_forwards == theirs.target_forwards  # the same rounds
            assert ours.drafter_seconds > 0 and theirs.drafter_seconds > 0
            assert 0 < ours.target_seconds < ours.seconds
    rows = summarize_peers(runs)
    assert {(r["block_size"], r["method"]) for r in rows} == {
        (b, s) for b in (2, 4) for s in ("hf-blockpilot", "dflash-reference")
    }
    for b in (2, 4):
        ours, theirs = (r for r in rows if r["block_size"] == b)
        assert ours["tau"] == theirs["tau"] > 1.0 and ours["mismatches"] == theirs["mismatches"] == 0
        assert ours["ours_over_reference"] == pytest.approx(ours["tokens_per_second"] / theirs["tokens_per_second"])
    assert "| 4 | dflash-reference |" in peer_markdown(rows)


def test_the_speed_comparison_drafts_with_the_full_vocabulary_the_reference_loads():
    from hf_blockpilot.tools.reference_peer import (
        full_vocabulary_variant,
        load_reference_drafter,
    )

    target = _target("qwen3", seed=0)
    reduced = BlockDiffusionDrafter.from_target(target, block_size=4, draft_vocab=list(range(2, 12)))
    with pytest.raises(ValueError, match="full_vocabulary_variant"):
        load_reference_drafter(reduced)
    variant = full_vocabulary_variant(reduced)
    assert variant.d2t is None and variant.config.draft_vocab_size is None
    for name, tensor in variant.state_dict().items():
        assert torch.equal(tensor, reduced.state_dict()[name])
    reference_model = load_reference_drafter(variant)
    for name, tensor in reference_model.state_dict().items():
        assert torch.equal(tensor, variant.state_dict()[name]), name


@pytest.mark.parametrize("scale", [None, 8.0])  # absent (the reference: 1.0), and sqrt(hidden) as Gemma targets use
def test_gemma_style_target_drafts_as_the_reference(tmp_path, monkeypatch, scale):
    """A Gemma 3 target scales its embeddings by sqrt(hidden) inside the embedding module and softcaps its
    logits; the reference embeds the block from the *raw* table times `input_embedding_scale`. Ours drafts the
    same distributions and the same greedy rounds, and stays lossless."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    target = make_target("gemma3", vocab_size=VOCAB, hidden_size=HIDDEN, seed=2)
    with torch.no_grad():
        target.model.norm.weight.add_(3.0)  # Gemma norms scale by (1 + weight): peaked next-token distributions
    target = target.double()
    assert not torch.equal(target.get_input_embeddings()(torch.tensor([1])), target.get_input_embeddings().weight[1:2])
    reference_drafter(target, tmp_path / "d", block_size=4, seed=5, sharpen=3.0)
    if scale is not None:
        _edit_config(tmp_path / "d", lambda c: c["dflash_config"].update(input_embedding_scale=scale))
    ref = reference.DFlashDraftModel.from_pretrained(tmp_path / "d", dtype=torch.float64).eval()
    ours = BlockDiffusionDrafter.from_pretrained(tmp_path / "d", dtype=torch.float64).eval()
    ids = torch.randint(1, VOCAB - 1, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        context = torch.cat([hidden[i + 1] for i in ours.target_layer_ids], dim=-1)
        block = torch.full((1, 4), ours.mask_token_id)
        block[0, 0] = ids[0, -1]
        positions = torch.arange(14)[None]
        expected = ref.compute_logits(
            ref(
                target_hidden=context,
                noise_embedding=reference._raw_input_embeddings(target, block, scale or 1.0),
                position_ids=positions,
            )[:, 1:],
            reference._output_head(target),
        )
        got = ours.finish_logits(
            target.lm_head(
                ours(
                    block_embeds=ours.embed_block(target.get_input_embeddings(), block),
                    block_position_ids=positions[:, 10:],
                    target_hidden=context,
                    context_position_ids=positions[:, :10],
                ).last_hidden_state[:, 1:]
            )
        )
    torch.testing.assert_close(got.softmax(-1), expected.softmax(-1))
    full = partial = 0
    for seed in range(6):
        prompt = torch.randint(1, VOCAB - 1, (1, 3 + seed), generator=torch.Generator().manual_seed(seed))
        expected_run = reference.dflash_generate(ref, target, prompt, 24, stop_token_ids=None, return_stats=True)
        got_run = greedy_generate(target, prompt, 24, None, assistant_model=ours, draft_controller=ours.block_size)
        assert torch.equal(got_run, expected_run.output_ids)
        assert torch.equal(got_run, greedy_generate(target, prompt, 24, None))
        committed = [a + 1 for a in ours.last_stats.accepted_per_round[1:]]
        assert committed == expected_run.acceptance_lengths
        full += sum(c == 4 for c in committed)
        partial += sum(1 < c < 4 for c in committed)
    assert full + partial > 0, "no draft was ever accepted: the rounds compared nothing"


def test_tau_by_replay_equals_tau_by_decoding(trained_checkpoint, tmp_path):
    """`eval-drafter --replay`: the target's answers replayed give the τ of real greedy decoding
    (float64, so no near-tie can flip), and the answers are kept for a second call."""
    from conftest import char_tokenizer

    from hf_blockpilot.data import PromptRecord
    from hf_blockpilot.tools.evaluation import measure_tau, replay_tau

    target, directory = trained_checkpoint
    target = copy.deepcopy(target).double()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    drafter = BlockDiffusionDrafter.from_pretrained(directory, dtype=torch.float64).eval()
    tokenizer = char_tokenizer(VOCAB)
    prompts = [PromptRecord(f"p{i}", "toy", text) for i, text in enumerate(["abcab", "cbbac", "bca"])]
    decoded = measure_tau(target, tokenizer, drafter, prompts, block_sizes=(2, 4), max_new_tokens=30)
    replayed = replay_tau(target, tokenizer, drafter, prompts, (2, 4), 30, responses_dir=tmp_path / "answers")
    assert decoded.mismatches == {2: 0, 4: 0} and replayed.mismatches == replayed.acceptance_length == {}
    assert (replayed.prompts, replayed.new_tokens) == (decoded.prompts, decoded.new_tokens) == (3, 90)
    assert replayed.tau == decoded.tau
    assert decoded.tau[4] > decoded.tau[2] > 1.2  # the drafter is often right: the comparison is not trivial
    again = replay_tau(target, tokenizer, drafter, prompts[:2], (4,), 30, responses_dir=tmp_path / "answers")
    assert again.prompts == 2 and (tmp_path / "answers" / "responses.jsonl").read_text().count("\n") == 3
