"""generate() features keep working, token for token, with the block-diffusion assistant.

A ScriptedDrafter (often right) makes whole blocks get accepted, so EOS, stop strings and length limits land
inside accepted blocks; the output must still equal plain greedy `generate` with the same arguments.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ScriptedDrafter, char_tokenizer, make_drafter, make_target
from transformers.generation.streamers import BaseStreamer

from hf_blockpilot import DraftController
from hf_blockpilot.batched import BatchedSpeculativeDecoder

VOCAB, HIDDEN = 48, 64  # vocab <= hidden lets ScriptedDrafter invert the LM head exactly
BLOCK = 6
PROMPT_LEN = 7


@pytest.fixture
def target(family):
    return make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN, seed=11)


@pytest.fixture
def prompt():
    return torch.randint(3, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def cuts(monkeypatch):
    """Record (a round's tokens, the tokens committed of them) of every `_cut_at_stop` call: cut right after the
    first that ends generation."""
    calls = []
    original = BatchedSpeculativeDecoder._cut_at_stop

    def spy(self, row, tokens, scores):
        kept, stop = original(self, row, tokens, scores)
        calls.append((torch.tensor(tokens), torch.tensor(kept)))
        return kept, stop

    monkeypatch.setattr(BatchedSpeculativeDecoder, "_cut_at_stop", spy)
    return calls


def _gen(target, prompt, max_new_tokens=30, eos=None, **kwargs):
    return target.generate(
        prompt, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0, **kwargs
    )


def scripted(target, script, error_rate=0.0, block_size=BLOCK, seed=0):
    torch.manual_seed(seed)
    drafter = ScriptedDrafter.from_target(target, block_size=block_size).eval()
    return drafter.rig(target, script, error_rate=error_rate, seed=seed)


def _first_index(cont: list[int], token: int) -> int:
    return cont.index(token)


def _pick_eos(cont: list[int], lo: int, hi: int) -> int:
    """A token whose first occurrence in `cont` lies in [lo, hi)."""
    for i in range(lo, hi):
        if _first_index(cont, cont[i]) == i:
            return cont[i]
    raise AssertionError(f"no token first occurs in [{lo}, {hi}) of {cont}: pick other seeds")


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value):
        assert not self.ended, "put() after end()"
        self.chunks.append(value.detach().clone().reshape(-1))

    def end(self):
        self.ended += 1


def test_streamer_receives_exactly_the_continuation(target, prompt):
    plain_streamer = Collect()
    expected = _gen(target, prompt, streamer=plain_streamer)
    drafter = scripted(target, expected, error_rate=0.1)
    streamer = Collect()
    out = _gen(target, prompt, assistant_model=drafter, streamer=streamer)
    assert torch.equal(out, expected)
    assert streamer.ended == 1
    assert torch.equal(streamer.chunks[0], prompt[0])  # the prompt first, as plain generate does
    assert torch.equal(torch.cat(streamer.chunks[1:]), out[0, PROMPT_LEN:])
    assert torch.equal(torch.cat(streamer.chunks), torch.cat(plain_streamer.chunks))
    assert max(c.numel() for c in streamer.chunks[1:]) > 1, "blocks were not streamed as blocks"
    assert len(streamer.chunks) - 1 == drafter.last_stats.target_forwards  # one put per verify round


def test_max_new_tokens_exact(target, prompt):
    script = _gen(target, prompt, max_new_tokens=40)
    drafter = scripted(target, script)
    for max_new in (1, 2, 3, 5, 6, 7, 8, 11, 12, 13, 17, 25):
        out = _gen(target, prompt, max_new_tokens=max_new, assistant_model=drafter)
        assert out.shape[1] == PROMPT_LEN + max_new, max_new
        assert torch.equal(out, script[:, : PROMPT_LEN + max_new]), max_new
        assert drafter.last_stats.new_tokens == max_new
    assert drafter.last_stats.tau > 3  # whole blocks accepted in the long runs


@pytest.mark.parametrize("as_list", [False, True])
def test_eos_inside_accepted_block(target, prompt, cuts, as_list):
    free = _gen(target, prompt, max_new_tokens=40)
    cont = free[0, PROMPT_LEN:].tolist()
    first = _pick_eos(cont, 9, 20)
    if as_list:
        later = _pick_eos(cont, _first_index(cont, first) + 1, 40)
        eos = [later, first]  # stops at whichever comes first in the output: `first`
    else:
        eos = first
    expected = _gen(target, prompt, max_new_tokens=40, eos=eos)
    stop_at = _first_index(cont, first)
    assert expected.shape[1] == PROMPT_LEN + stop_at + 1 and int(expected[0, -1]) == first

    drafter = scripted(target, free)  # drafts run past the EOS: it is drafted inside a block
    out = _gen(target, prompt, max_new_tokens=40, eos=eos, assistant_model=drafter)
    assert torch.equal(out, expected)
    # EOS was accepted after at least one other token of its round, and the round was cut right after it
    eos_ids = torch.tensor(eos if as_list else [eos])
    cut_at_eos = [
        (before, after)
        for before, after in cuts
        if torch.isin(before, eos_ids).any() and after.numel() == int(torch.isin(before, eos_ids).int().argmax()) + 1
    ]
    assert cut_at_eos and any(after.numel() > 1 for _, after in cut_at_eos), cuts
    assert drafter.last_stats.new_tokens == stop_at + 1
    assert drafter.last_stats.tau > 2


def test_eos_with_imperfect_drafter_and_random_drafter(target, prompt):
    free = _gen(target, prompt, max_new_tokens=40)
    cont = free[0, PROMPT_LEN:].tolist()
    eos = _pick_eos(cont, 5, 25)
    expected = _gen(target, prompt, max_new_tokens=40, eos=eos)
    for drafter in (scripted(target, free, error_rate=0.3, seed=1), make_drafter(target, block_size=BLOCK)):
        assert torch.equal(_gen(target, prompt, max_new_tokens=40, eos=eos, assistant_model=drafter), expected)


def test_min_new_tokens(target, prompt):
    free = _gen(target, prompt, max_new_tokens=40)
    cont = free[0, PROMPT_LEN:].tolist()
    eos = cont[1]  # plain greedy would stop after 2 tokens
    min_new = 12
    early = _gen(target, prompt, max_new_tokens=40, eos=eos)
    assert early.shape[1] <= PROMPT_LEN + 2
    expected = _gen(target, prompt, max_new_tokens=40, eos=eos, min_new_tokens=min_new)
    assert expected.shape[1] > PROMPT_LEN + min_new  # min_new_tokens did change the output
    assert not (expected[0, PROMPT_LEN : PROMPT_LEN + min_new] == eos).any()

    # script = the output with min_new_tokens (whole blocks right), or the early-stopping one (drafts EOS too early)
    for script in (expected, early):
        drafter = scripted(target, script)
        out = _gen(target, prompt, max_new_tokens=40, eos=eos, min_new_tokens=min_new, assistant_model=drafter)
        assert torch.equal(out, expected)
    drafter = scripted(target, expected)
    _gen(target, prompt, max_new_tokens=40, eos=eos, min_new_tokens=min_new, assistant_model=drafter)
    assert drafter.last_stats.tau > 2


# ------------------------------------------------------------------------------------------- stop strings
def test_stop_strings_mid_block(target, prompt, cuts):
    tokenizer = char_tokenizer(VOCAB)
    free = _gen(target, prompt, max_new_tokens=40)
    cont = free[0, PROMPT_LEN:].tolist()
    drafter = scripted(target, free)
    cut_mid_block = 0
    tried = 0
    for start in range(8, 30, 3):
        piece = cont[start : start + 3]
        if 0 in piece:
            continue
        stop = tokenizer.decode(piece)
        expected = _gen(target, prompt, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer)
        text = tokenizer.decode(expected[0, PROMPT_LEN:])
        assert expected.shape[1] < free.shape[1] and text.endswith(stop), (stop, text)
        assert torch.equal(expected, free[:, : expected.shape[1]])
        cuts.clear()
        out = _gen(target, prompt, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer, assistant_model=drafter)
        assert torch.equal(out, expected), stop
        tried += 1
        # the accepted drafts ran past the stop string and were cut right after its last character, which came
        # after other tokens of its round
        cut_mid_block += any(1 < after.numel() < before.numel() for before, after in cuts)
    assert tried >= 4
    assert cut_mid_block >= 2, "the stop string never landed inside a drafted block"


def test_stop_strings_need_tokenizer(target, prompt):
    drafter = make_drafter(target, block_size=BLOCK)
    with pytest.raises(ValueError, match="tokenizer"):
        _gen(target, prompt, stop_strings=["ab"], assistant_model=drafter)


@pytest.mark.parametrize("do_sample", [False, True])
def test_prompt_ending_in_eos(target, do_sample):
    """Plain generate continues after a prompt that ends in EOS; so must we (older loops would stop at once)."""
    prompt = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    eos = int(prompt[0, -1])
    kwargs = dict(max_new_tokens=12, eos_token_id=eos, pad_token_id=0, do_sample=do_sample)
    torch.manual_seed(0)
    expected = target.generate(prompt, **kwargs)
    assert expected.shape[1] > prompt.shape[1]
    drafter = make_drafter(target, block_size=4)
    torch.manual_seed(0)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.shape[1] > prompt.shape[1]
    if not do_sample:
        assert torch.equal(out, expected)


def test_user_requested_hidden_states_and_attentions_are_returned_in_full():
    """`return_dict_in_generate` with `output_hidden_states` / `output_attentions` works as with a stock
    assistant: every layer's states come back (the drafter's own selection must not replace the request)."""
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=3)
    target.config._attn_implementation = "eager"
    drafter = make_drafter(target, block_size=4)
    prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(3))
    common = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    plain = target.generate(prompt, output_hidden_states=True, output_attentions=True, **common)
    out = target.generate(prompt, assistant_model=drafter, output_hidden_states=True, output_attentions=True, **common)
    assert torch.equal(out.sequences, plain.sequences)
    layers = target.config.num_hidden_layers + 1
    assert len(out.hidden_states) == out.sequences.shape[1] - prompt.shape[1]
    assert all(len(step) == layers and all(h is not None for h in step) for step in out.hidden_states)
    assert all(len(step) == layers - 1 for step in out.attentions)


def test_each_call_returns_its_own_statistics_also_from_concurrent_threads():
    """`return_dict_in_generate=True` carries the call's `speculation_stats`; calls from several threads on one
    target and drafter each get their own (`drafter.last_stats` is only the latest call's)."""
    import threading

    from hf_blockpilot import SpeculationStats

    target = make_target("llama", vocab_size=48, hidden_size=64, seed=2)
    drafter = make_drafter(target, block_size=4, seed=2)
    prompts = [torch.randint(3, 48, (1, 4 + i), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    lengths = [5 + 3 * i for i in range(6)]

    def run(i: int):
        return target.generate(
            prompts[i],
            max_new_tokens=lengths[i],
            do_sample=False,
            pad_token_id=0,
            assistant_model=drafter,
            return_dict_in_generate=True,
            draft_controller=4,
        )

    sequential = [run(i) for i in range(6)]
    assert drafter.last_stats is sequential[-1].speculation_stats
    results: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(i))) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(6):
        stats = results[i].speculation_stats
        assert isinstance(stats, SpeculationStats)
        assert stats.prompt_tokens == prompts[i].shape[1] and stats.new_tokens == lengths[i]
        assert torch.equal(results[i].sequences, sequential[i].sequences)
        assert stats.accepted_per_round == sequential[i].speculation_stats.accepted_per_round
    plain = target.generate(prompts[0], max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert not hasattr(plain, "speculation_stats")  # plain generate is untouched


def test_settings_travel_with_the_call_and_leave_the_drafter_unchanged(target, monkeypatch):
    """`prompt_lookup` and `calibrate` are this call's: the drafter's attribute and the environment are only their
    defaults."""
    import hf_blockpilot.custom_generate as custom_generate_module
    from hf_blockpilot.costs import CostModel

    prompt = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(5)).repeat(1, 3)
    expected = _gen(target, prompt)
    drafter = make_drafter(target, block_size=4)
    assert not drafter.prompt_lookup
    controller = DraftController(4)
    controller.use_cost_model(CostModel(target_ms={1: 10.0, 4: 11.0}, drafter_ms={4: 1.0}))
    out = _gen(target, prompt, assistant_model=drafter, prompt_lookup=True, draft_controller=controller)
    assert torch.equal(out, expected) and drafter.last_stats.lookup_rounds > 0 and not drafter.prompt_lookup
    assert _gen(target, prompt, assistant_model=drafter).shape == expected.shape
    assert drafter.last_stats.lookup_rounds == 0  # the next call takes the drafter's default again
    monkeypatch.setenv("HF_BLOCKPILOT_CALIBRATE", "1")  # on by default, off for this call: no calibration runs
    monkeypatch.setattr(custom_generate_module, "resolve_cost_model", _refuse_calibration(custom_generate_module))
    assert torch.equal(_gen(target, prompt, assistant_model=drafter, calibrate=False), expected)
    assert "fallback" in drafter.last_stats.cost_model_source


def _refuse_calibration(module):
    resolve = module.resolve_cost_model

    def checked(*args, calibrate=None, **kwargs):
        assert calibrate is False, "the call's calibrate=False did not reach the cost model"
        return resolve(*args, calibrate=calibrate, **kwargs)

    return checked
