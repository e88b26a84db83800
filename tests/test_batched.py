"""Batched speculative decoding: `generate(**batch, assistant_model=drafter)` with batch size > 1 is lossless per
row (greedy rows equal the same batch's plain `generate`; sampled rows follow the target's law), rows stop on
their own, finished rows leave the batch, and what a batch cannot serve is a clear error."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import BatchScriptedDrafter, char_tokenizer, make_drafter, make_sharp_target, make_target
from test_policy import _tau_policy, make_policy
from test_sampling import VOCAB as SAMPLING_VOCAB
from test_sampling import chi2_critical, chi_square, exact_joint
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_blockpilot.batched as batched_module
from hf_blockpilot import (
    AdaptiveVerify,
    CostModel,
    DraftController,
    PolicyBlockSize,
    SpeculationGuard,
)
from hf_blockpilot.controllers import TauEvidence, fastest_width, geometric_tau
from hf_blockpilot.stats import BatchSpeculationStats, SpeculationStats
from hf_blockpilot.tools.baselines import AcceptanceEMA, EntropyStop, HeuristicSchedule

VOCAB, HIDDEN, LAYERS = 48, 64, 4


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), left padded with id 0."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return ids, mask


def generate(target, ids, mask, max_new, eos=None, **kwargs):
    return target.generate(
        ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0, **kwargs
    )


def real_tokens(row: torch.Tensor, mask_row: torch.Tensor, eos: int | None) -> list[int]:
    """A row's prompt without its padding, then its output up to its end (its EOS, or the padding after)."""
    prompt_len = mask_row.shape[0]
    out = row[prompt_len:].tolist()
    if eos is not None and eos in out:
        out = out[: out.index(eos) + 1]
    return row[:prompt_len][mask_row.bool()].tolist() + out


CONTROLLERS = {
    "default": lambda: None,
    "fixed": lambda: DraftController(5),
    "heuristic": lambda: HeuristicSchedule(start_block_size=3, max_block_size=8),
    "ema": lambda: AcceptanceEMA(max_block_size=8),
    "entropy": lambda: EntropyStop(max_block_size=8, threshold=0.1),
    "adaptive": lambda: AdaptiveVerify(6),
    "guarded": lambda: SpeculationGuard(DraftController(6), timing="modeled"),
    "policy": lambda: PolicyBlockSize(make_policy(None)),
    "adaptive+policy": lambda: AdaptiveVerify(policy=make_policy(None, candidates=(2, 4, 8))),
}


def test_greedy_rows_identical_to_plain_batched_generate_over_randomized_cases():
    """200 randomized batches: mixed prompt lengths, EOS in some rows, every controller, prompt lookup on and off,
    drafters from always wrong to often right; every row equals the same batch's plain `generate`."""
    targets = {
        fam: make_target(fam, vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=1) for fam in ("llama", "qwen3")
    }
    seen = {"ragged": False, "eos_row": False, "early_finish": False, "lookup": False, "multi_accept": False}
    names = sorted(CONTROLLERS)
    for case in range(200):
        rng = random.Random(case)
        target = targets[rng.choice(sorted(targets))]
        batch = rng.randint(2, 6)
        prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 24))] for _ in range(batch)]
        if rng.random() < 0.3:  # repetitive prompts give prompt lookup something to copy
            prompts = [p + p[: rng.randint(1, len(p))] for p in prompts]
        ids, mask = left_padded(prompts)
        max_new = rng.randint(1, 40)
        eos = None
        free = generate(target, ids, mask, max_new)
        if rng.random() < 0.5:  # a token one row produces: that row stops early, others may not
            row = free[rng.randrange(batch), ids.shape[1] :]
            eos = int(row[rng.randrange(row.numel())])
        expected = generate(target, ids, mask, max_new, eos)
        scripts = [real_tokens(expected[i], mask[i], eos) for i in range(batch)]
        torch.manual_seed(case)
        drafter = BatchScriptedDrafter.from_target(target, block_size=rng.randint(2, 8)).eval()
        drafter.rig(target, scripts, error_rate=rng.choice([0.0, 0.1, 0.3, 1.0]), seed=case)
        drafter.prompt_lookup = rng.random() < 0.4
        name = names[case % len(names)]
        got = generate(target, ids, mask, max_new, eos, assistant_model=drafter, draft_controller=CONTROLLERS[name]())
        msg = f"case {case}: batch={batch} max_new={max_new} eos={eos} controller={name} lookup={drafter.prompt_lookup}"
        assert torch.equal(got, expected), msg

        stats = drafter.last_stats
        assert isinstance(stats, BatchSpeculationStats) and stats.batch_size == batch, msg
        lengths = []
        for i, row in enumerate(stats.rows):
            new = len(scripts[i]) - len(prompts[i])
            lengths.append(new)
            assert row.new_tokens == new, msg
            assert row.new_tokens == sum(a + 1 for a in row.accepted_per_round), msg
            assert len(row.drafted_per_round) == len(row.accepted_per_round) == row.target_forwards, msg
            assert all(0 <= a <= d for a, d in zip(row.accepted_per_round, row.drafted_per_round)), msg
            seen["multi_accept"] |= max(row.accepted_per_round) >= 2
            seen["lookup"] |= row.lookup_rounds > 0
        # a row that finished early took part in fewer forwards: finished rows leave the batch
        forwards = [row.target_forwards for row in stats.rows]
        assert max(forwards) == stats.target_forwards, msg
        seen["early_finish"] |= min(forwards) < max(forwards)
        seen["eos_row"] |= eos is not None and any(n < max_new for n in lengths)
        seen["ragged"] |= any(
            len({row.accepted_per_round[k] for row in stats.rows if len(row.accepted_per_round) > k}) > 1
            for k in range(1, max(forwards))
        )
        assert stats.new_tokens == sum(lengths) and stats.padded_slots <= stats.verify_slots, msg
    assert all(seen.values()), seen


def test_rows_stop_on_their_own_stop_strings():
    """A row that meets a stop string ends there and is padded after, as plain batched `generate` does when an EOS
    token is set (without one, plain `generate` keeps decoding stopped rows until every row stops; we pad them)."""
    tokenizer = char_tokenizer(VOCAB)
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=4)
    drafter = make_drafter(target, block_size=4)
    ids, mask = left_padded([[5, 6, 7, 8], [9, 10], [11, 12, 13]])
    free = generate(target, ids, mask, 24)
    stop = tokenizer.decode(free[1, ids.shape[1] + 1 : ids.shape[1] + 3])  # two characters row 1 produces
    eos = next(t for t in range(1, VOCAB) if t not in free.tolist()[0] + free.tolist()[1] + free.tolist()[2])
    kwargs = dict(stop_strings=[stop], tokenizer=tokenizer)
    expected = generate(target, ids, mask, 24, eos, **kwargs)
    got = generate(target, ids, mask, 24, eos, assistant_model=drafter, **kwargs)
    assert torch.equal(got, expected)
    rows = drafter.last_stats.rows
    assert rows[1].new_tokens <= 3 and max(row.new_tokens for row in rows) > 3  # row 1 stopped on its own
    unpadded = generate(target, ids, mask, 24, None, assistant_model=drafter, **kwargs)
    assert torch.equal(
        unpadded[:, : ids.shape[1] + rows[1].new_tokens], expected[:, : ids.shape[1] + rows[1].new_tokens]
    )


def test_output_dict_per_row_stats_and_one_host_sync_per_round():
    target = make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=2)
    drafter = make_drafter(target, block_size=4)
    ids, mask = left_padded([[3, 4, 5], [6, 7, 8, 9, 10, 11], [12]])
    out = generate(target, ids, mask, 12, assistant_model=drafter, draft_controller=4, return_dict_in_generate=True)
    stats = out.speculation_stats
    assert stats is drafter.last_stats and torch.equal(out.sequences, generate(target, ids, mask, 12))
    assert [row.prompt_tokens for row in stats.rows] == [3, 6, 1]
    assert stats.to_dict()["rows"][1]["new_tokens"] == 12
    # fixed widths read no confidences: one transfer for the prompt's first token, then one per round
    assert stats.host_syncs == 1 + stats.target_forwards
    out = generate(target, ids, mask, 12, assistant_model=drafter, draft_controller=AdaptiveVerify(4))
    stats = drafter.last_stats
    drafter_rounds = stats.drafter_forwards
    assert stats.host_syncs <= 1 + stats.target_forwards + drafter_rounds


def test_finished_rows_cost_no_compute():
    """A row that ends at once leaves the batch: later forwards run over the other rows only."""
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=3)
    drafter = make_drafter(target, block_size=3)
    ids, mask = left_padded([[3, 4, 5, 6], [7, 8, 9]])
    free = generate(target, ids, mask, 16)
    eos = int(free[0, ids.shape[1]])  # row 0's first token
    if eos in free[1, ids.shape[1] :].tolist():
        pytest.skip("both rows produce the token")
    seen_rows = []
    forward = target.forward

    def spy(*args, **kwargs):
        seen_rows.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    target.forward = spy
    try:
        got = generate(target, ids, mask, 16, eos, assistant_model=drafter, draft_controller=3)
    finally:
        del target.forward
    assert torch.equal(got, generate(target, ids, mask, 16, eos))
    assert seen_rows[0] == 2 and set(seen_rows[1:]) == {1}
    assert drafter.last_stats.rows[0].target_forwards == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(streamer="streamer"), "a streamer for several rows"),
        (dict(output_scores=True, return_dict_in_generate=True), "output_scores for several rows"),
    ],
)
def test_unsupported_combinations_are_clear_errors(kwargs, message):
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=0)
    drafter = make_drafter(target)
    ids, mask = left_padded([[3, 4], [5, 6, 7]])
    if kwargs.get("streamer") == "streamer":  # one that takes batches (TextStreamer refuses them itself)
        kwargs = dict(streamer=type("Batches", (BaseStreamer,), {"put": lambda *a: None, "end": lambda *a: None})())
    with pytest.raises(ValueError, match=f"does not support {message}"):
        generate(target, ids, mask, 4, assistant_model=drafter, **kwargs)


class StopAfter(StoppingCriteria):
    """A custom criterion: stop a row once its last token is `token`."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_stop_each_row_where_plain_batched_generate_does():
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=0)
    ids, mask = left_padded([[3, 4], [5, 6, 7], [8, 9, 10, 11]])
    free = generate(target, ids, mask, 24)
    token = int(free[1, -12])  # a token row 1 produces mid-way
    criteria = StoppingCriteriaList([StopAfter(token)])
    # an EOS no row produces: with one, plain batched generate pads the rows a criterion stopped
    eos = next(t for t in range(3, VOCAB) if t not in free)
    expected = generate(target, ids, mask, 24, eos, stopping_criteria=criteria)
    assert not torch.equal(expected, free)  # the criterion did stop a row
    scripts = [real_tokens(free[i], mask[i], None) for i in range(3)]
    drafter = BatchScriptedDrafter.from_target(target, block_size=5).eval().rig(target, scripts, error_rate=0.0)
    got = generate(target, ids, mask, 24, eos, assistant_model=drafter, stopping_criteria=criteria)
    assert torch.equal(got, expected)
    assert max(max(row.accepted_per_round) for row in drafter.last_stats.rows) > 1  # stops landed inside blocks


def test_beam_search_is_a_clear_error():
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=0)
    ids, mask = left_padded([[3, 4], [5, 6, 7]])
    with pytest.raises(ValueError, match=r"does not support beam search \(num_beams > 1"):
        generate(target, ids, mask, 4, assistant_model=make_drafter(target), num_beams=2)


def test_sliding_window_models_are_a_clear_error():
    from conftest import make_windowed_drafter

    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=0)
    ids, mask = left_padded([[3, 4], [5, 6, 7]])
    drafter = make_windowed_drafter(target, sliding_window=3)
    with pytest.raises(ValueError, match="causal or sliding-window layers"):
        generate(target, ids, mask, 4, assistant_model=drafter)


def test_batch_of_one_reports_one_request(built_decoders):
    """One row runs the same loop and reports a single request's statistics."""
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=0)
    drafter = make_drafter(target)
    ids, mask = left_padded([[3, 4, 5]])
    generate(target, ids, mask, 6, assistant_model=drafter)
    assert len(built_decoders) == 1 and not isinstance(drafter.last_stats, BatchSpeculationStats)


# ------------------------------------------------------------------------------------------- sampling
ROWS_PER_PROMPT = 400
DRAWS = 6
SAMPLING_PROMPTS = [[1, 2, 3, 1, 2], [3, 3, 1]]


def sample_rows(target, drafter):
    """Joint counts of each prompt's first 3 sampled tokens, from batches that hold both prompts many times."""
    prompts = [p for p in SAMPLING_PROMPTS for _ in range(ROWS_PER_PROMPT)]
    ids, mask = left_padded(prompts)
    counts = [torch.zeros(SAMPLING_VOCAB**3, dtype=torch.long) for _ in SAMPLING_PROMPTS]
    weights = torch.tensor([SAMPLING_VOCAB**2, SAMPLING_VOCAB, 1])
    drafted = accepted = 0
    torch.manual_seed(1234)
    for _ in range(DRAWS):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=drafter,
            draft_controller=4,  # the default turns drafting off for 800 rows on the fallback costs
            do_sample=True,
            max_new_tokens=4,
            eos_token_id=None,
            pad_token_id=0,
        )
        cells = (out[:, ids.shape[1] : ids.shape[1] + 3] * weights).sum(-1)
        for k in range(len(SAMPLING_PROMPTS)):
            counts[k] += torch.bincount(
                cells[k * ROWS_PER_PROMPT : (k + 1) * ROWS_PER_PROMPT], minlength=SAMPLING_VOCAB**3
            )
        drafted += sum(sum(r.drafted_per_round) for r in drafter.last_stats.rows)
        accepted += sum(sum(r.accepted_per_round) for r in drafter.last_stats.rows)
    return counts, drafted, accepted


@pytest.fixture(scope="module")
def sampling_target():
    return make_sharp_target(SAMPLING_VOCAB)


def test_sampled_rows_follow_the_target_law(sampling_target):
    drafter = make_drafter(sampling_target, seed=3, block_size=4, scale=8.0)
    counts, drafted, accepted = sample_rows(sampling_target, drafter)
    assert 0.1 * drafted < accepted < drafted, (drafted, accepted)
    for k, prompt in enumerate(SAMPLING_PROMPTS):
        stat, df = chi_square(
            counts[k], exact_joint(sampling_target, torch.tensor([prompt]), temperature=1.0, top_k=None)
        )
        assert df >= 10 and stat < chi2_critical(df), f"row {k}: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f}"


def test_chi_square_rejects_batched_drafts_not_drawn_from_their_logits(sampling_target, monkeypatch):
    """Negative control: drafts taken as the argmax of the logits handed to the verifier break exactness."""
    select = batched_module.BatchedSpeculativeDecoder._select

    def argmax_drafts(self, logits, width):
        drafts, processed = select(self, logits, width)
        return processed.argmax(-1), processed

    monkeypatch.setattr(batched_module.BatchedSpeculativeDecoder, "_select", argmax_drafts)
    drafter = make_drafter(sampling_target, seed=3, block_size=4, scale=8.0)
    counts, _, accepted = sample_rows(sampling_target, drafter)
    assert accepted > 0
    stats = [
        chi_square(counts[k], exact_joint(sampling_target, torch.tensor([p]), temperature=1.0, top_k=None))
        for k, p in enumerate(SAMPLING_PROMPTS)
    ]
    assert any(stat > chi2_critical(df) for stat, df in stats), stats


# -------------------------------------------------------------------------------------- the batch axis
def steep_cost() -> CostModel:
    """A device where verifying more tokens costs in proportion (a compute-bound batch)."""
    return CostModel(target_ms={1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0}, drafter_ms={2: 2.0, 4: 2.5, 8: 3.0})


def test_batch_view_charges_the_batch_total_tokens_unless_timed():
    cost = steep_cost()
    assert cost.for_batch(1) is cost
    view = cost.for_batch(4)
    assert view.verify_ms(1) == pytest.approx(cost.verify_ms(4)) and view.verify_ms(2) == pytest.approx(
        cost.verify_ms(8)
    )
    cost.batch_target_ms[4] = {1: 12.0, 2: 20.0, 4: 40.0, 8: 80.0}
    cost.batch_drafter_ms[4] = {2: 3.0, 4: 4.0, 8: 6.0}
    assert cost.for_batch(4).verify_ms(2) == 20.0 and "timed" in cost.for_batch(4).source
    # between timed sizes (1 and 4): linear in the batch size
    assert cost.for_batch(2).verify_ms(2) == pytest.approx(11.0 + (20.0 - 11.0) / 3)
    cost.batch_steps[4] = "view"
    again = CostModel.from_dict(cost.to_dict())
    assert again.batch_target_ms == cost.batch_target_ms and again.batch_drafter_ms == cost.batch_drafter_ms
    assert again.batch_steps == {4: "view"}
    again.one_row_steps = "kernel"  # what runs a step of B rows, as the calibration timed it
    assert [again.step_way(b) for b in (1, 2, 4)] == ["kernel", "stock", "view"]
    with pytest.raises(ValueError, match="batch_size"):
        cost.for_batch(0)


def test_the_guard_turns_speculation_off_as_the_batch_grows():
    cost = steep_cost()
    cost.batch_target_ms[16] = {1: 20.0, 2: 40.0, 4: 80.0, 8: 160.0}  # verify cost grows with the batch's tokens
    cost.batch_drafter_ms[16] = {2: 6.0, 4: 10.0, 8: 18.0}
    pays = []
    for batch in (1, 16):
        guard = SpeculationGuard(DraftController(4))
        guard.use_cost_model(cost.for_batch(batch))
        pays.append(guard.speculation_can_pay(4))
    assert pays == [True, False]


def test_a_batch_under_a_slowdown_bound_opens_plain_and_stays_exact():
    """The batch's one guard bounds the shared rounds: with a verify of 4 slots at 1.5 plain steps the first rounds
    are plain steps (the budget one losing round needs), later rounds draft; rows equal plain batched generate."""
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=8)
    drafter = make_drafter(target, block_size=4)
    guard = SpeculationGuard(DraftController(4), timing="modeled", max_slowdown=0.05)
    guard.use_cost_model(CostModel(target_ms={1: 20.0, 4: 28.0}, drafter_ms={2: 2.0, 4: 2.0}))
    ids, mask = left_padded([[5, 9, 11, 3, 7], [4, 8]])
    got = generate(target, ids, mask, 40, assistant_model=drafter, draft_controller=guard)
    assert torch.equal(got, generate(target, ids, mask, 40))
    widths = drafter.last_stats.rows[0].widths_per_round[1:]
    assert widths[:4] == [1, 1, 1, 1] and 4 in widths


def test_a_tau_policy_batch_drafts_one_width_at_a_time():
    """Rows whose controllers predict τ per width draft one shared width per round (the widest row sets a round's
    cost, the slowest row the batch's length: `fastest_width`), corrected by the rows' rounds; rows stay exact."""
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=8)
    drafter = make_drafter(target, block_size=8)
    controller = PolicyBlockSize(_tau_policy(target, drafter))
    controller.use_cost_model(CostModel(target_ms={1: 30.0, 2: 33.0, 8: 45.0}, drafter_ms={2: 2.0, 8: 2.5}))
    ids, mask = left_padded([[5, 9, 11, 3, 7], [4, 8], [12, 13, 14, 15, 16, 17, 18]])
    got = generate(target, ids, mask, 24, assistant_model=drafter, draft_controller=controller)
    assert torch.equal(got, generate(target, ids, mask, 24))
    rows = drafter.last_stats.rows
    rounds = list(zip(*(row.widths_per_round[1:12] for row in rows), strict=False))
    assert all(len(set(widths)) == 1 for widths in rounds), rounds
    assert rounds[0][0] == 8 and rounds[-1][0] < 8  # this random drafter's rejections narrow the batch's width


class _GeometricTauPolicy:
    """A τ policy predicting τ(b) of a per-slot acceptance `accept` (geometric) for every prompt."""

    candidates = [1, 2, 4, 8]
    weighs_costs = True

    def __init__(self, accept: float):
        self.predicted = {b: geometric_tau(accept, b) for b in self.candidates}

    def choose_block_size(self, prefill_outputs, lm_head, temperature, cost_model=None):
        return 2, dict(self.predicted)

    def check_compatible(self, target, drafter=None):
        pass


def test_a_batch_shared_width_grows_at_most_width_growth_a_round():
    """A batch's shared width follows its rows' corrected τ but widens a step at a time, as a single request's: here
    one fully accepted round at b = 2 makes b = 8 the fastest under the costs, yet the next round drafts b = 4."""
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=8)
    steps = {1: 30.0, 2: 31.0, 4: 34.0, 8: 36.0}  # a batch of 2 rounds as one row here
    cost = CostModel(target_ms=steps, drafter_ms={2: 1.0, 8: 1.2}, batch_target_ms={2: steps})
    evidence = TauEvidence(_GeometricTauPolicy(0.3).predicted)
    assert fastest_width([evidence.current()], cost, 0.0)[0] == 2
    evidence.observe(1, 1)
    assert fastest_width([evidence.current()], cost, 0.0)[0] == 8  # uncapped, one round would jump to 8
    ids, mask = left_padded([[5, 9, 11, 3, 7], [4, 8, 6, 10, 12]])
    expected = generate(target, ids, mask, 24)
    drafter = BatchScriptedDrafter.from_target(target, block_size=8).eval()
    drafter.rig(target, [real_tokens(expected[i], mask[i], None) for i in range(2)], error_rate=0.0)
    controller = PolicyBlockSize(_GeometricTauPolicy(0.3))
    controller.use_cost_model(cost)
    got = generate(target, ids, mask, 24, assistant_model=drafter, draft_controller=controller)
    assert torch.equal(got, expected)
    widths = [w for w in drafter.last_stats.rows[0].widths_per_round[1:] if w > 1]
    assert widths[:3] == [2, 4, 8], widths


def test_batched_call_measures_and_caches_the_batch_axis(monkeypatch, tmp_path):
    from hf_blockpilot import device_calibration

    monkeypatch.setenv("HF_BLOCKPILOT_CALIBRATE", "1")
    monkeypatch.setenv("HF_BLOCKPILOT_CACHE", str(tmp_path))
    device_calibration.forget_resolved()
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=0)
    drafter = make_drafter(target, block_size=3)
    ids, mask = left_padded([[3, 4], [5, 6, 7], [8]])
    try:
        generate(target, ids, mask, 6, assistant_model=drafter)
        assert "batch of 3 timed" in drafter.last_stats.cost_model_source
        calibration = device_calibration.load_or_calibrate(target, drafter, 3)
        assert calibration.from_cache and set(calibration.cost_model.batch_target_ms) == {3}
        assert set(calibration.cost_model.batch_target_ms[3]) >= {1, 2, 3}
        assert set(calibration.cost_model.prefill_ms) == {1, 3}  # the prefill timed alone and at the batch size
        assert calibration.cost_model.batch_steps[3] in ("stock", "view")  # what runs its lockstep steps
    finally:
        device_calibration.forget_resolved()


@pytest.mark.parametrize(("view_ms", "way"), [(9.0, "view"), (9.8, "stock"), (11.0, "stock")])
def test_a_batchs_lockstep_steps_take_the_view_only_where_it_is_timed_clearly_faster(monkeypatch, view_ms, way):
    """The calibration times a batch's one-token step on the exact view and on the stock model; the view runs the
    lockstep steps only where it beats the stock step by `ONE_ROW_STEP_GAIN`, and the table's step is the one taken."""
    from hf_blockpilot import device_calibration

    timed = {("target", 1): view_ms, ("target", 2): 15.0, ("drafter", 2): 2.0, "stock step": 10.0, "prefill": 50.0}
    monkeypatch.setattr(device_calibration, "_forward_ms", lambda *args, **kwargs: timed)
    steps, drafts, prefill, chosen = device_calibration.calibrate_batch(None, None, 4, widths=(1, 2))
    assert chosen == way and steps == {1: view_ms if way == "view" else 10.0, 2: 15.0}
    assert drafts == {2: 2.0} and prefill == 50.0


class Alternating(DraftController):
    """Drafts its block size on even rounds, nothing on odd ones."""

    def reset(self) -> None:
        super().reset()
        self.rounds = 0

    def width(self) -> int:
        self.rounds += 1
        return self.block_size if self.rounds % 2 else 1


def test_bfloat16_rows_bit_identical_to_plain_batched_generate():
    """In half precision a several-token verify rounds differently from plain one-token steps; the batch verifies
    each row's slots as plain decoding computes them, so bfloat16 rows stay token-identical too."""
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=5).to(torch.bfloat16)
    for case in range(12):
        rng = random.Random(100 + case)
        batch = rng.randint(2, 5)
        prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(batch)]
        if case % 3 == 0:  # unpadded: plain decoding passes no mask
            prompts = [p[:1] + [rng.randrange(3, VOCAB) for _ in range(19)] for p in prompts]
        ids, mask = left_padded(prompts)
        expected = generate(target, ids, mask, 32)
        scripts = [real_tokens(expected[i], mask[i], None) for i in range(batch)]
        drafter = BatchScriptedDrafter.from_target(target, block_size=rng.randint(3, 6)).eval()
        drafter.rig(target, scripts, error_rate=0.2, seed=case)
        # every other case pauses all rows on alternate rounds: one-token steps of rows of different lengths
        controller = Alternating(drafter.block_size) if case % 2 else drafter.block_size
        got = generate(target, ids, mask, 32, assistant_model=drafter, draft_controller=controller)
        assert torch.equal(got, expected), f"case {case}"
        assert max(max(row.accepted_per_round) for row in drafter.last_stats.rows) >= 2


def test_the_default_drafts_in_a_small_batch_and_decodes_a_large_one_plain():
    """On the CPU fallback costs (a batch charged by its total tokens) the batch's guard lets 2 rows draft and
    keeps 48 plain: the verify of 48 rows x 8 slots costs far more than a plain batched step."""
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=6)
    drafter = make_drafter(target, block_size=8)
    drafted = {}
    for batch in (2, 48):
        ids, mask = left_padded([[3 + (i * 7 + j) % 40 for j in range(5 + i % 3)] for i in range(batch)])
        got = generate(target, ids, mask, 8, assistant_model=drafter)
        assert torch.equal(got, generate(target, ids, mask, 8))
        stats = drafter.last_stats
        assert "batch of" in stats.cost_model_source
        drafted[batch] = sum(sum(row.drafted_per_round) for row in stats.rows)
    assert drafted[2] > 0 and drafted[48] == 0, drafted


def _rounds_by_row_count(real, step_rows: int):
    """`F.linear` as a CPU whose GEMM rounds by row count class (MKL's float32: 2-3, 5-7, 9-11 rows unlike 4, 8
    and 12+): here every product of more than one row but `step_rows` comes out visibly off."""

    def linear(x, weight, bias=None):
        out = real(x, weight, bias)
        rows = x.numel() // x.shape[-1]
        return out * (1 + 1e-2) if rows not in (1, step_rows) else out

    return linear


def _rows_match_plain(target, cases: int, seed: int, decode) -> list[bool]:
    """Per random left-padded batch of 4 with an EOS that ends one row (at least) early: whether
    `decode(ids, mask, eos, expected)` gives plain batched `generate`'s rows."""
    same = []
    for case in range(cases):
        rng = random.Random(seed + case)
        prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 20))] for _ in range(4)]
        ids, mask = left_padded(prompts)
        free = generate(target, ids, mask, 24)
        eos = int(free[case % 4, ids.shape[1] + 2 + case % 2])
        expected = generate(target, ids, mask, 24, eos)
        same.append(torch.equal(decode(ids, mask, eos, expected), expected))
    return same


def test_batched_rows_identical_where_the_gemm_rounds_by_row_count(monkeypatch):
    """CPU-independent: with a simulated kernel whose rounding depends on the row count of a product, plain
    batched decoding computes every step over exactly B rows; the batch's exact path computes each verify slot as
    such a product (zero rows standing in for rows that left the batch), so rows stay token-identical. The stock
    path (one product over every slot) does not: the negative control."""
    from torch.nn import functional

    from hf_blockpilot import exact_verify

    batch = 4
    monkeypatch.setattr(functional, "linear", _rounds_by_row_count(functional.linear, batch))
    monkeypatch.setattr(exact_verify, "_row_exact_rows", {})
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=7)
    assert exact_verify.row_exact_rows(target.model.layers[0].mlp.down_proj.weight) == 1

    def speculative(ids, mask, eos, expected):
        drafter = BatchScriptedDrafter.from_target(target, block_size=4).eval()
        drafter.rig(target, [real_tokens(expected[i], mask[i], eos) for i in range(batch)], error_rate=0.2, seed=eos)
        return generate(target, ids, mask, 24, eos, assistant_model=drafter, draft_controller=4)

    def run_cases(cases: int) -> list[bool]:
        return _rows_match_plain(target, cases, 300, speculative)

    assert all(run_cases(6))
    monkeypatch.setattr(exact_verify, "needs_exact_verify", lambda model: False)
    assert not all(run_cases(6))  # the stock path: the simulated rounding shows


def test_plain_steps_of_a_batch_take_the_stock_model_only_in_lockstep(monkeypatch):
    """CPU-independent: a batch that decodes plain (width 1) runs its one-token steps on the stock model while every
    row is still in it (one product of all B rows, as plain batched decoding), then on the exact view, whose
    products keep B rows after rows leave; under a kernel that rounds by row count, rows stay plain batched
    `generate`'s. Negative control: the stock model after a row has left computes smaller products."""
    from torch.nn import functional

    from hf_blockpilot import exact_verify

    batch = 4
    monkeypatch.setattr(functional, "linear", _rounds_by_row_count(functional.linear, batch))
    monkeypatch.setattr(exact_verify, "_row_exact_rows", {})
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=8)
    drafter = make_drafter(target, block_size=4)

    def plain_decoding() -> SpeculationGuard:  # costs where drafting cannot pay: the batch decodes plain
        guard = SpeculationGuard(DraftController(4))
        guard.use_cost_model(CostModel(target_ms={1: 1.0, 4: 100.0}, drafter_ms={4: 50.0}))
        return guard

    def plain_steps(ids, mask, eos, expected):
        out = generate(target, ids, mask, 24, eos, assistant_model=drafter, draft_controller=plain_decoding())
        assert all(row.drafter_forwards == 0 for row in drafter.last_stats.rows)  # plain steps only
        return out

    def run_cases(cases: int) -> list[bool]:
        return _rows_match_plain(target, cases, 400, plain_steps)

    assert all(run_cases(8))
    monkeypatch.setattr(batched_module.BatchedSpeculativeDecoder, "_in_lockstep", lambda self: True)
    assert not all(run_cases(8))


@pytest.mark.parametrize("way", ["stock", "view"])
def test_a_batchs_lockstep_steps_run_where_its_calibration_timed_them_faster(monkeypatch, way):
    """CPU-independent: `CostModel.batch_steps[B]` says what runs a batch's one-token steps while its rows are in
    lockstep, the stock model or the call's exact view (where the calibration timed it faster); under a kernel that
    rounds by row count, rows equal plain batched `generate`'s either way."""
    from torch.nn import functional

    from hf_blockpilot import exact_verify

    batch = 4
    monkeypatch.setattr(functional, "linear", _rounds_by_row_count(functional.linear, batch))
    monkeypatch.setattr(exact_verify, "_row_exact_rows", {})
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=8)
    drafter = make_drafter(target, block_size=4)
    on_view = []
    init = batched_module.BatchedSpeculativeDecoder.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        on_view.append(self.plain_target is self.target)

    monkeypatch.setattr(batched_module.BatchedSpeculativeDecoder, "__init__", recording)

    def plain_steps(ids, mask, eos, expected):  # costs where drafting cannot pay: the batch decodes plain
        guard = SpeculationGuard(DraftController(4))
        costs = {1: 1.0, 4: 100.0}
        guard.use_cost_model(
            CostModel(target_ms=costs, drafter_ms={4: 50.0}, batch_target_ms={batch: costs}, batch_steps={batch: way})
        )
        return generate(target, ids, mask, 24, eos, assistant_model=drafter, draft_controller=guard)

    assert all(_rows_match_plain(target, 8, 400, plain_steps))
    assert on_view and all(on_view) == (way == "view") and any(on_view) == (way == "view")


@pytest.fixture
def nothing_patched(monkeypatch):
    """Transformers' own `GenerationMixin` methods, as before `import hf_blockpilot` routed them."""
    from transformers.generation import GenerationMixin

    from hf_blockpilot import routing

    monkeypatch.setattr(GenerationMixin, "generate", routing._stock_generate)


def test_custom_generate_is_lossless_with_nothing_patched(nothing_patched):
    """`generate(custom_generate=hf_blockpilot.generate, drafter=...)` through Transformers' own seam: batch 1
    and ragged batches, several controllers, every row equal to plain greedy `generate`; the call's statistics
    travel with its output; the drafter must come as `drafter=`."""
    import hf_blockpilot

    target = make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=1)
    names = sorted(CONTROLLERS)
    for case in range(12):
        rng = random.Random(case)
        batch = 1 if case % 3 == 0 else rng.randint(2, 4)
        prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 16))] for _ in range(batch)]
        ids, mask = left_padded(prompts)
        max_new = rng.randint(4, 24)
        expected = generate(target, ids, mask, max_new)
        scripts = [real_tokens(expected[i], mask[i], None) for i in range(batch)]
        drafter = BatchScriptedDrafter.from_target(target, block_size=rng.randint(2, 6)).eval()
        drafter.rig(target, scripts, error_rate=rng.choice([0.0, 0.2, 1.0]), seed=case)
        name = names[case % len(names)]
        out = generate(
            target,
            ids,
            mask,
            max_new,
            custom_generate=hf_blockpilot.generate,
            drafter=drafter,
            draft_controller=CONTROLLERS[name](),
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, expected), f"case {case}: batch={batch} controller={name}"
        assert isinstance(out.speculation_stats, BatchSpeculationStats if batch > 1 else SpeculationStats)
    with pytest.raises(TypeError, match="drafter=<BlockDiffusionDrafter>"):
        generate(target, ids, mask, 4, custom_generate=hf_blockpilot.generate)


def test_the_hub_custom_generate_folder_decodes_like_plain(nothing_patched):
    """`custom_generate="hub/hf-blockpilot-generate"` (a Hub-style repo in this one, loaded as Transformers loads
    one): the drafter as `assistant_model`, rows equal to plain greedy `generate`."""
    from pathlib import Path

    folder = Path(__file__).parent.parent / "hub" / "hf-blockpilot-generate"
    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=1)
    ids, mask = left_padded([[5, 6, 7, 8, 5, 6], [9, 10, 11]])
    expected = generate(target, ids, mask, 12)
    drafter = BatchScriptedDrafter.from_target(target, block_size=4).eval()
    drafter.rig(target, [real_tokens(expected[i], mask[i], None) for i in range(2)], error_rate=0.2, seed=0)
    got = generate(target, ids, mask, 12, custom_generate=str(folder), trust_remote_code=True, assistant_model=drafter)
    assert torch.equal(got, expected)
    # one row streams through the folder too
    chunks = []
    streamer = type(
        "Collect", (BaseStreamer,), {"put": lambda s, v: chunks.append(v.reshape(-1)), "end": lambda s: None}
    )
    one = torch.tensor([[9, 10, 11, 12]])
    expected = generate(target, one, torch.ones_like(one), 12)
    got = generate(
        target,
        one,
        torch.ones_like(one),
        12,
        custom_generate=str(folder),
        trust_remote_code=True,
        assistant_model=drafter,
        streamer=streamer(),
    )
    assert torch.equal(got, expected) and torch.equal(torch.cat(chunks), expected[0])


def test_a_pre_cached_batch_or_a_non_finite_temperature_is_a_clear_error():
    """The checks a single request gets, a batch gets too: one function each serves both paths."""
    from transformers import DynamicCache

    from hf_blockpilot._compat import cache_argument

    target = make_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, layers=LAYERS, seed=0)
    drafter = make_drafter(target)
    ids, mask = left_padded([[3, 4, 8], [5, 6, 7]])
    cache = DynamicCache()
    with torch.no_grad():
        target(ids[:, :2], attention_mask=mask[:, :2], **{cache_argument(target): cache})
    with pytest.raises(ValueError, match=r"cannot come pre-cached \(2 tokens"):
        generate(target, ids, mask, 4, assistant_model=drafter, **{cache_argument(target): cache})
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        target.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=True,
            temperature=float("inf"),
            pad_token_id=0,
            assistant_model=drafter,
        )


def test_rows_alike_long_append_as_plain_decoding_and_ragged_rows_write_at_their_own_length():
    """A batch whose rows hold as many keys as each other (its plain rounds) appends as plain decoding's cache
    does; once rows commit different counts, each row's next slots are written right after its own keys."""
    from transformers import DynamicCache

    cache = DynamicCache()
    prompt_keys = torch.randn(2, 1, 3, 4)
    cache.update(prompt_keys, prompt_keys.clone(), 0)
    prompt = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    plan = batched_module.RaggedCache.convert(cache, prompt, padded=True, single=False)
    layer = cache.layers[0]
    mask = plan.prepare(3)
    assert plan.appends and mask.shape == (2, 1, 3, 6)
    block = torch.randn(2, 1, 3, 4)
    keys, _ = layer.update(block, block.clone())
    assert torch.equal(keys, torch.cat([prompt_keys, block], dim=-2))  # one append, as `DynamicLayer` does
    plan.advance(torch.tensor([1, 3]), [1, 3])  # row 0 keeps one slot, row 1 all three
    mask = plan.prepare(2)
    assert not plan.appends
    assert mask[0, 0, 0].tolist() == [False, True, True, True, True, False, False, False]
    new = torch.randn(2, 1, 2, 4)
    keys, _ = layer.update(new, new.clone())
    assert keys.shape[-2] == 8
    assert torch.equal(keys[0, :, :4], torch.cat([prompt_keys[0], block[0, :, :1]], dim=-2))
    assert torch.equal(keys[0, :, 4:6], new[0]) and torch.equal(keys[1, :, 6:8], new[1])
    assert torch.equal(keys[1, :, :6], torch.cat([prompt_keys[1], block[1]], dim=-2))
    plan.advance(torch.tensor([2, 0]), [2, 0])  # alike long again (6 keys each): the next forward appends
    plan.prepare(1)
    assert plan.appends
    last = torch.randn(2, 1, 1, 4)
    keys, _ = layer.update(last, last.clone())
    assert keys.shape[-2] == 7 and torch.equal(keys[:, :, 6:], last)
    assert torch.equal(keys[0, :, 4:6], new[0]) and torch.equal(
        keys[1, :, :6], torch.cat([prompt_keys[1], block[1]], -2)
    )
