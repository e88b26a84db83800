"""Per-device calibration: measured once per fingerprint, cached, re-measured when stale; kernels by measurement."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from conftest import greedy_generate, make_drafter, make_target

from hf_blockpilot import device_calibration, exact_verify
from hf_blockpilot.controllers import AdaptiveVerify, DraftController
from hf_blockpilot.costs import PRIOR_ACCEPTANCE, CostModel
from hf_blockpilot.device_calibration import (
    calibrate,
    calibration_path,
    cpu_description,
    device_fingerprint,
    forget_resolved,
    resolve_cost_model,
)

VOCAB = 48


@pytest.fixture
def calibrating(monkeypatch, tmp_path):
    """Calibration on, into a fresh cache; counts the measurements (each a real, tiny `calibrate`)."""
    monkeypatch.setenv("HF_BLOCKPILOT_CALIBRATE", "1")
    monkeypatch.setenv("HF_BLOCKPILOT_CACHE", str(tmp_path))
    forget_resolved()
    measured = []

    def quick(target, drafter, widths, *args, **kwargs):
        measured.append(sorted(widths))
        return calibrate(target, drafter, widths, context_tokens=8, repeats=1)

    monkeypatch.setattr(device_calibration, "calibrate", quick)
    yield measured
    forget_resolved()


@pytest.fixture
def steady_host(monkeypatch):
    """The tables under test compare as given: the host ran at one speed for all of them."""
    monkeypatch.setattr(device_calibration, "host_factors", lambda pairs, costs, batch_size: dict.fromkeys(costs, 1.0))


def pair(seed: int = 0):
    target = make_target("llama", vocab_size=VOCAB, hidden_size=64, seed=seed)
    return target, make_drafter(target, block_size=4, seed=seed)


def test_calibrate_times_every_width_and_sampling():
    target, drafter = pair()
    calibration = calibrate(target, drafter, [1, 2, 4], context_tokens=16, repeats=2)
    cost = calibration.cost_model
    assert set(cost.target_ms) == {1, 2, 4}
    assert set(cost.drafter_ms) == {2, 4} and cost.inexact_rows == []  # the exact path, probed
    assert all(v > 0 for v in [*cost.target_ms.values(), *cost.drafter_ms.values()])
    assert cost.sampling_process_ms > 0 and cost.sampling_draw_ms > 0
    assert cost.source.startswith("calibrated on ") and "float32" in cost.source
    assert set(cost.prefill_ms) == {1} and cost.prefill_ms[1] > 0 and cost.context_tokens == 16
    assert CostModel.from_dict(cost.to_dict()).prefill_ms == cost.prefill_ms
    sampled = 7 * cost.sampling_process_ms + 4 * cost.sampling_draw_ms
    assert cost.round_ms(4, temperature=1.0) == pytest.approx(cost.round_ms(4) + sampled)
    assert "plain steps" in calibration.table() and len(calibration.table().splitlines()) == 6


@pytest.mark.parametrize(
    ("split_ms", "kernel_ms", "taken"), [(7.0, 8.0, "split"), (9.9, 6.0, "kernel"), (9.9, 9.8, "stock")]
)
def test_calibration_takes_the_fastest_one_row_steps_only_where_timed_faster(monkeypatch, split_ms, kernel_ms, taken):
    """The one-token step is timed stock, with split and with kernel one-row products; the fastest is taken (and
    its time is the plain step's), a different path only where it was timed below `ONE_ROW_STEP_GAIN` of the
    stock step; it survives the cache's round trip, and files that recorded `split_one_row` still read."""
    target, drafter = pair()
    timed = {("target", 1): 10.0, ("target", 2): 12.0, ("drafter", 2): 1.0}
    timed |= {"split step": split_ms, "kernel step": kernel_ms, "sampling_process": 0.1, "sampling_draw": 0.2}

    def forward_ms(target, drafter, widths, context_tokens, repeats, batch_size=1):
        return timed | {"prefill": 30.0}

    monkeypatch.setattr(device_calibration, "_forward_ms", forward_ms)
    cost = calibrate(target, drafter, [1, 2], context_tokens=8, repeats=1).cost_model
    step = {"stock": 10.0, "split": split_ms, "kernel": kernel_ms}[taken]
    assert cost.one_row_steps == taken and cost.target_ms == {1: step, 2: 12.0}
    assert CostModel.from_dict(cost.to_dict()).one_row_steps == taken
    assert cost.for_batch(4).one_row_steps == "stock"  # a batch's steps are products of several rows
    old = {k: v for k, v in cost.to_dict().items() if k != "one_row_steps"}
    assert CostModel.from_dict(old | {"split_one_row": True}).one_row_steps == "split"


def test_calibration_times_the_split_and_kernel_steps_some_linear_takes(monkeypatch):
    """On CPU the calibration's timings include the one-token step with split and with kernel one-row products,
    each only where some linear computes its one-row products that way (else the step is the stock one)."""
    target, drafter = pair()
    ways = {how for how in ("split", "kernel") if exact_verify.takes_one_row_products(target, how)}
    ms = device_calibration._forward_ms(target, drafter, [1, 2], context_tokens=8, repeats=1)
    assert {key.removesuffix(" step") for key in ms if str(key).endswith(" step")} == ways
    assert all(ms[f"{how} step"] > 0 for how in ways)
    monkeypatch.setattr(exact_verify, "one_row_product", lambda module, how: None)  # no linear takes either way
    ms = device_calibration._forward_ms(target, drafter, [1, 2], context_tokens=8, repeats=1)
    assert not any(str(key).endswith(" step") for key in ms)


def test_first_use_measures_and_caches_later_uses_read_it(calibrating):
    target, drafter = pair()
    cost = resolve_cost_model(target, drafter)
    assert len(calibrating) == 1 and max(cost.target_ms) == 16
    path = calibration_path(device_fingerprint(target, drafter))
    assert json.loads(path.read_text())["fingerprint"] == device_fingerprint(target, drafter)
    assert resolve_cost_model(target, drafter) is cost  # this process: no file read
    forget_resolved()
    again = resolve_cost_model(target, drafter)  # a new process: from the cache, not measured
    assert len(calibrating) == 1 and again.target_ms == cost.target_ms
    with pytest.warns(UserWarning, match="does not reach width 24"):  # wider than cached: re-measured
        resolve_cost_model(target, drafter, max_width=24)
    assert len(calibrating) == 2 and max(calibrating[-1]) == 24


def test_threads_share_one_measurement_and_no_lock_is_held_while_it_runs(calibrating, monkeypatch):
    """Two threads asking for one pair measure it once; a third asking for another pair meanwhile is not held
    up by that measurement (the resolution lock only guards the bookkeeping, never a forward)."""
    import threading

    measuring, release = threading.Event(), threading.Event()
    quick = device_calibration.calibrate

    def slow(target, drafter, widths, *args, **kwargs):
        if next(target.parameters()).shape[-1] == 64:  # the first pair: held until released
            measuring.set()
            assert release.wait(30)
        return quick(target, drafter, widths, *args, **kwargs)

    monkeypatch.setattr(device_calibration, "calibrate", slow)
    slow_pair = pair()
    other_target = make_target("llama", vocab_size=VOCAB, hidden_size=32, seed=1)
    other_pair = (other_target, make_drafter(other_target, block_size=4, seed=1))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(resolve_cost_model(*slow_pair))) for _ in range(2)]
    for thread in threads:
        thread.start()
    assert measuring.wait(30)
    other = resolve_cost_model(*other_pair)  # returns while the first pair is still being measured
    assert not release.is_set() and other.target_ms
    release.set()
    for thread in threads:
        thread.join(30)
    assert len(results) == 2 and results[0] is results[1]
    assert len(calibrating) == 2  # the slow pair once, the other pair once


def test_the_calibration_cache_stays_bounded(calibrating, monkeypatch, tmp_path):
    """One entry per pair (temporary model folders included) would grow without end: the oldest go."""
    monkeypatch.setattr(device_calibration, "CACHE_ENTRIES", 2)
    paths = []
    for seed in range(3):
        target, drafter = pair(seed)
        target.config._name_or_path = f"/tmp/model-{seed}"  # a new fingerprint each time
        resolve_cost_model(target, drafter)
        paths.append(device_calibration.calibration_path(device_calibration.device_fingerprint(target, drafter)))
    assert [path.is_file() for path in paths] == [False, True, True]
    assert len(list(paths[0].parent.glob("*.json"))) == 2


def test_a_cached_calibration_brings_back_the_row_exactness_probe(calibrating, monkeypatch):
    """The per-weight row probe is a property of the machine: cached with the calibration, later processes take
    it from there instead of probing again in their first `generate`."""
    target, drafter = pair()
    monkeypatch.setattr(exact_verify, "_row_exact_rows", {})  # nothing probed in this process yet
    resolve_cost_model(target, drafter)
    probed = dict(exact_verify._row_exact_rows)
    saved = json.loads(calibration_path(device_fingerprint(target, drafter)).read_text())["row_exact"]
    assert saved and saved == exact_verify.row_exact_table(target)
    monkeypatch.setattr(exact_verify, "_row_exact_rows", {})
    forget_resolved()  # a new process: reads the cache
    resolve_cost_model(target, drafter)
    assert len(calibrating) == 1 and exact_verify._row_exact_rows == probed


def test_a_changed_fingerprint_recalibrates(calibrating, monkeypatch):
    target, drafter = pair()
    resolve_cost_model(target, drafter)
    other_cpu = {"device": "cpu", "name": "Another CPU", "flags": ["avx2"]}
    monkeypatch.setattr(device_calibration, "describe_device", lambda device: other_cpu)
    forget_resolved()
    cost = resolve_cost_model(target, drafter)
    assert len(calibrating) == 2 and "Another CPU" in cost.source
    # a stale entry at the same path (another fingerprint) is re-measured with a warning
    path = calibration_path(device_fingerprint(target, drafter))
    raw = json.loads(path.read_text())
    raw["fingerprint"]["torch"] = "0.0"
    path.write_text(json.dumps(raw))
    forget_resolved()
    with pytest.warns(UserWarning, match="another device, dtype or model"):
        resolve_cost_model(target, drafter)
    assert len(calibrating) == 3


def test_cpus_a_virtual_machine_names_alike_are_told_apart_by_family_and_model():
    """Cloud VMs name a Zen 1 and a Zen 3 EPYC both "AMD EPYC", with the same matmul flags; their kernels and
    costs differ, so a calibration cached on one must not serve the other."""
    zen = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {}\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
    flags = "flags\t\t: fpu sse2 avx fma avx2\n"
    zen1, zen3 = (cpu_description(zen.format(family) + flags) for family in (23, 25))
    assert zen1 == ("AMD EPYC (family 23, model 1)", ["avx2"])
    assert zen3 == ("AMD EPYC (family 25, model 1)", ["avx2"])
    arm = cpu_description("processor\t: 0\nFeatures\t: fp asimd\n")  # no model name or numbers: the platform's
    assert arm[1] == [] and arm[0]


def test_a_model_loaded_in_a_dtype_shares_the_calibration_of_one_cast_to_it():
    """The fingerprint keys on the weights' dtype, not on the dtype the config recorded at loading: `--dtype
    bfloat16` and `--dtype auto` (a float32 copy cast to bfloat16) reuse one calibration; the rest of the config
    still tells models apart."""
    target, drafter = pair()
    cast = copy.deepcopy(target).to(torch.bfloat16)
    loaded = copy.deepcopy(cast)
    loaded.config.dtype = torch.bfloat16
    assert device_fingerprint(loaded, drafter) == device_fingerprint(cast, drafter)
    assert device_fingerprint(cast, drafter) != device_fingerprint(target, drafter)  # the weights' dtype differs
    loaded.config.rms_norm_eps *= 2
    assert device_fingerprint(loaded, drafter) != device_fingerprint(cast, drafter)


@pytest.mark.parametrize("damage", ["{not json", '{"fingerprint": {}}', "[]"])
def test_a_damaged_cache_entry_is_re_measured_with_one_warning(calibrating, damage):
    target, drafter = pair()
    path = calibration_path(device_fingerprint(target, drafter))
    path.parent.mkdir(parents=True)
    path.write_text(damage)
    with pytest.warns(UserWarning, match="damaged|another device") as caught:
        cost = resolve_cost_model(target, drafter)
    assert len([w for w in caught if "hf-blockpilot" in str(w.message)]) == 1
    assert len(calibrating) == 1 and cost.target_ms
    assert json.loads(path.read_text())["cost_model"]["target_ms"]  # replaced by a good entry


def test_opting_out_or_passing_costs_skips_calibration(calibrating, monkeypatch):
    target, drafter = pair()
    given = CostModel(target_ms={1: 1.0}, drafter_ms={}, source="mine")
    assert resolve_cost_model(target, drafter, given) is given
    monkeypatch.setenv("HF_BLOCKPILOT_CALIBRATE", "0")
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    greedy_generate(target, prompt, 6, None, assistant_model=drafter)
    assert drafter.last_stats.cost_model_source.startswith("shipped fallback")
    greedy_generate(
        target, prompt, 6, None, assistant_model=drafter, draft_controller=AdaptiveVerify(4, cost_model=given)
    )
    assert drafter.last_stats.cost_model_source == "mine" and calibrating == []


def test_generate_calibrates_on_first_use_and_verifies_on_the_exact_path(calibrating, monkeypatch):
    target, drafter = pair()
    views = []
    real = exact_verify.call_view
    monkeypatch.setattr(exact_verify, "call_view", lambda model: views.append(real(model)) or views[-1])
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    plain = greedy_generate(target, prompt, 12, None)
    out = greedy_generate(target, prompt, 12, None, assistant_model=drafter, draft_controller=DraftController(4))
    assert torch.equal(out, plain) and len(calibrating) == 1
    assert drafter.last_stats.cost_model_source.startswith("calibrated on")
    assert views and views[-1].config._attn_implementation == exact_verify.SLOTWISE_EXACT_ATTENTION
    assert target.config._attn_implementation == "sdpa"  # switched back after the call


@pytest.mark.parametrize(
    "bf16_ms, bf16_inexact, float32_inexact, expected",
    [
        (11.0, [], [], torch.bfloat16),
        (60.0, [], [], torch.float32),
        (11.0, [4], [], torch.float32),
        (60.0, [], [4], torch.bfloat16),  # the only exact one, though slower
        (11.0, [4], [4], torch.float32),  # neither exact (CUDA): the one whose near-ties flip least
        # an AVX2-only Zen 3: bf16 products emulated, verifies dear, yet its plain step is the fastest decoding
        ((6.0, 80.0), [], [], torch.bfloat16),
    ],
)
def test_auto_dtype_takes_bfloat16_only_where_its_calibration_expects_faster_lossless_decoding(
    calibrating, steady_host, monkeypatch, bf16_ms, bf16_inexact, float32_inexact, expected
):
    """On every CPU, whatever its flags, a bf16 copy is calibrated; bfloat16 when it expects more tokens per ms
    (speculative or plain) among the dtypes whose verify was probed exact."""
    plain_ms, verify_ms = bf16_ms if isinstance(bf16_ms, tuple) else (10.0, bf16_ms)
    costs = {
        torch.float32: CostModel(
            target_ms={1: 10.0, 16: 30.0}, drafter_ms={2: 1.0, 16: 1.0}, inexact_rows=float32_inexact
        ),
        torch.bfloat16: CostModel(
            target_ms={1: plain_ms, 16: verify_ms}, drafter_ms={2: 1.0, 16: 1.0}, inexact_rows=bf16_inexact
        ),
    }
    monkeypatch.setattr(
        device_calibration,
        "resolve_cost_model",
        lambda target, drafter, *args, **kwargs: costs[next(target.parameters()).dtype],
    )
    target, drafter = pair()
    assert device_calibration.preferred_dtype(target, drafter) == expected
    assert next(target.parameters()).dtype == torch.float32  # the copy was calibrated, not the model


def test_auto_dtype_is_chosen_per_batch_size(calibrating, steady_host, monkeypatch):
    """As on an AVX2-only Zen 3: bfloat16 decodes one row fastest, but its emulated products pay for every row, so
    float32 decodes a batch of eight fastest; each batch size gets its own dtype, from its own timed batch axis."""
    batch_costs = {torch.float32: {1: 20.0, 16: 200.0}, torch.bfloat16: {1: 60.0, 16: 600.0}}
    plain_ms = {torch.float32: 10.0, torch.bfloat16: 6.0}
    asked = []

    def resolve(target, drafter, *args, batch_size=1, **kwargs):
        dtype = next(target.parameters()).dtype
        asked.append(batch_size)
        return CostModel(
            target_ms={1: plain_ms[dtype], 16: 20 * plain_ms[dtype]},
            drafter_ms={2: 1.0, 16: 1.0},
            batch_target_ms={8: batch_costs[dtype]},
            batch_drafter_ms={8: {2: 1.0, 16: 1.0}},
        )

    monkeypatch.setattr(device_calibration, "resolve_cost_model", resolve)
    target, drafter = pair()
    assert device_calibration.preferred_dtype(target, drafter) == torch.bfloat16
    assert device_calibration.preferred_dtype(target, drafter, batch_size=8) == torch.float32
    assert set(asked) == {1, 8}  # the batch axis is timed at the size asked for


def test_auto_dtype_prices_a_request_at_the_acceptance_its_policy_predicts_at_its_temperature(
    calibrating, steady_host, monkeypatch
):
    """As on an AMX Xeon: bfloat16 verifies are cheap but its plain steps and drafter slower than float32's, whose
    verifies are dear. A greedy request its τ policy expects accepted at 0.6 a slot decodes fastest drafting in
    bfloat16; the same prompt sampled at T = 1, which the policy expects accepted at ~0.17 (sampling work counted),
    fastest as plain float32 steps; priced at one fixed prior both went to bfloat16."""
    from hf_blockpilot.policy import PrefillMLPPolicy

    xeon = {  # docs/calibrations/intel-xeon-amx-2core-*.json, rounded
        torch.float32: CostModel(target_ms={1: 73.0, 2: 116.0, 4: 166.0, 8: 237.0}, drafter_ms={2: 9.6, 8: 16.5}),
        torch.bfloat16: CostModel(target_ms={1: 96.0, 2: 91.0, 4: 108.0, 8: 128.0}, drafter_ms={2: 21.0, 8: 23.0}),
    }
    for cost in xeon.values():
        cost.sampling_process_ms, cost.sampling_draw_ms = 1.0, 2.5
    monkeypatch.setattr(
        device_calibration,
        "resolve_cost_model",
        lambda target, drafter, *args, **kwargs: xeon[next(target.parameters()).dtype],
    )
    target, drafter = pair()
    policy = PrefillMLPPolicy(
        candidates=[1, 2, 4, 8],
        feature_layers=[0, 1],
        target_hidden_size=64,
        target_vocab_size=VOCAB,
        target_num_layers=target.config.num_hidden_layers,
        width=8,
        objective="tau",
        tau_head="per_slot",
    ).eval()
    with torch.no_grad():  # every slot accepted at sigmoid(logit(0.6) - 2 T): 0.6 greedy, ~0.17 at T = 1
        for linear in (policy.net[-1], policy.scalar_head):
            linear.weight.zero_()
            linear.bias.fill_(0.0)
        policy.scalar_head.bias.fill_(float(torch.logit(torch.tensor(0.6))))
        policy.scalar_head.weight[:, -1] = -2.0
    input_ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    assert device_calibration.request_acceptance(target, drafter, input_ids) == PRIOR_ACCEPTANCE  # no policy
    drafter.set_policy(policy)
    greedy = device_calibration.request_acceptance(target, drafter, input_ids, temperature=0.0)
    sampled = device_calibration.request_acceptance(target, drafter, input_ids, temperature=1.0)
    assert greedy == pytest.approx(0.6, abs=0.01) and sampled == pytest.approx(0.17, abs=0.01)
    ask = functools.partial(device_calibration.preferred_dtype, target, drafter, prompt_tokens=64, new_tokens=256)
    assert ask(temperature=0.0, acceptance=greedy) == torch.bfloat16
    assert ask(temperature=1.0, acceptance=sampled) == torch.float32
    assert ask(temperature=1.0) == torch.bfloat16  # the fixed prior (0.5 a slot) would have taken bfloat16


def test_a_prefill_is_estimated_from_the_batch_total_tokens():
    """Timed prefills (B rows of the calibration's context) and the one-token step anchor a line in the batch's
    total tokens; without a timed prefill, the verify forwards' slope stands in."""
    cost = CostModel(target_ms={1: 10.0, 16: 40.0}, drafter_ms={}, context_tokens=100, prefill_ms={1: 109.0})
    assert cost.prefill_estimate_ms(1) == pytest.approx(10.0)
    assert cost.prefill_estimate_ms(50) == pytest.approx(10.0 + 49 * 1.0)
    assert cost.prefill_estimate_ms(50, batch_size=4) == pytest.approx(10.0 + 199 * 1.0)  # past the timed one
    cost.prefill_ms[4] = 1000.0  # B = 4 timed: 400 tokens
    assert cost.prefill_estimate_ms(50, batch_size=4) == pytest.approx(109.0 + 100 * (1000.0 - 109.0) / 300)
    untimed = CostModel(target_ms={1: 10.0, 16: 40.0}, drafter_ms={}, context_tokens=100)
    assert untimed.prefill_estimate_ms(31) == pytest.approx(10.0 + 30 * 2.0)
    # a whole request: the prefill, then plain steps (acceptance 0)
    assert cost.request_ms(50, 20) == pytest.approx(cost.prefill_estimate_ms(50) + 20 * 10.0)


@pytest.mark.parametrize(
    "prompt_tokens, new_tokens, batch_size, expected",
    [
        (32, 256, 1, torch.bfloat16),  # a short prompt, a long answer: the cheaper steps win
        (256, 16, 1, torch.float32),  # a long prompt, a short answer: the cheaper prefill wins
        (64, 48, 8, torch.float32),  # a batch's prefill over every row's tokens
    ],
)
def test_auto_dtype_weighs_the_prefill_against_the_steps(
    calibrating, steady_host, monkeypatch, prompt_tokens, new_tokens, batch_size, expected
):
    """As measured on an AVX2-only Zen 3: a bfloat16 step costs 0.6 of a float32 one, a bfloat16 prefill 5x."""
    costs = {
        dtype: CostModel(
            target_ms={1: step, 16: 20 * step},
            drafter_ms={2: 50.0, 16: 50.0},
            context_tokens=256,
            prefill_ms={1: prefill, 8: 8 * prefill},
            batch_target_ms={8: {1: 2.3 * step, 16: 40 * step}},
            batch_drafter_ms={8: {2: 100.0, 16: 100.0}},
        )
        for dtype, step, prefill in ((torch.float32, 100.0, 700.0), (torch.bfloat16, 60.0, 3600.0))
    }
    monkeypatch.setattr(
        device_calibration,
        "resolve_cost_model",
        lambda target, drafter, *args, **kwargs: costs[next(target.parameters()).dtype],
    )
    target, drafter = pair()
    chosen = device_calibration.preferred_dtype(target, drafter, batch_size, prompt_tokens, new_tokens)
    assert chosen == expected


def test_auto_dtype_compares_the_calibrations_at_one_host_speed(calibrating, monkeypatch):
    """As on a KVM Zen 1, where a bfloat16 calibration timed every width 25 % slower than one 20 min later and auto
    then chose float32 wrongly: the dtypes' one-token steps timed side by side bring both tables to one host speed;
    that timing is cached until a table changes."""
    tables = {torch.float32: 10.0, torch.bfloat16: 11.7}  # bf16 calibrated while the host ran 1.3x slower
    now = {"float32": 10.0, "bfloat16": 9.0}  # the steps timed side by side
    timings = []

    def side_by_side(targets, batch_size, context_tokens, ways):
        timings.append((sorted(targets), batch_size, context_tokens))
        assert ways == {"float32": "stock", "bfloat16": "stock"}  # the steps timed as the tables timed them
        return now

    monkeypatch.setattr(device_calibration, "steps_side_by_side", side_by_side)
    monkeypatch.setattr(
        device_calibration,
        "resolve_cost_model",
        lambda target, drafter, *args, **kwargs: CostModel(
            target_ms={1: (step := tables[next(target.parameters()).dtype]), 16: 20 * step},
            drafter_ms={2: 5.0, 16: 5.0},
            context_tokens=64,
            prefill_ms={1: 64 * step},
        ),
    )
    target, drafter = pair()
    assert device_calibration.preferred_dtype(target, drafter) == torch.bfloat16  # as timed: float32
    assert timings == [(["bfloat16", "float32"], 1, 64)]
    assert device_calibration.preferred_dtype(target, drafter, prompt_tokens=8) == torch.bfloat16
    assert len(timings) == 1  # read from the cache
    tables[torch.bfloat16] = 9.0  # re-calibrated: the cached side-by-side timing no longer matches the table
    now["bfloat16"] = 8.1
    assert device_calibration.preferred_dtype(target, drafter) == torch.bfloat16 and len(timings) == 2


def test_steps_side_by_side_times_each_target_as_a_calibration_times_its_step():
    target, _ = pair()
    targets = {"float32": target, "bfloat16": copy.deepcopy(target).to(torch.bfloat16)}
    for batch_size in (1, 2):
        steps = device_calibration.steps_side_by_side(targets, batch_size, context_tokens=8, repeats=2)
        assert set(steps) == set(targets) and all(ms > 0 for ms in steps.values())
