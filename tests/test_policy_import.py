"""The BlockPilot authors' predictor (AMAP-ML/BlockPilot `utils/model.pt` layout) converts into our Hub policy
format and then runs under `generate(assistant_model=...)` like any policy."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import default_where_drafting_pays, make_drafter, make_target, save_tiny_pair
from torch import nn

from hf_blockpilot import BlockPilotPolicy
from hf_blockpilot.cli import main
from hf_blockpilot.tools.policy_import import import_authors_policy

VOCAB, WIDTH = 48, 2048


def authors_state_dict(vocab: int = VOCAB, width: int = WIDTH, depth: int = 2, classes: int = 5, seed: int = 0):
    """A randomly initialised predictor in the authors' layout and dtype (bf16 raw state dict)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"layers.0.weight": (width, vocab), "layers.0.bias": (width,)}
    for i in range(1, depth):
        shapes |= {f"layers.{i}.weight": (width, width), f"layers.{i}.bias": (width,)}
    shapes |= {"fc_out.weight": (classes, width), "fc_out.bias": (classes,)}
    return {k: (torch.randn(s, generator=gen) / s[-1] ** 0.5).to(torch.bfloat16) for k, s in shapes.items()}


def authors_forward(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Their `MLP.forward` in eval mode, written from predict.py: ReLU after each layer, residual after the first."""
    depth = len([k for k in state if k.endswith(".weight")]) - 1
    for i in range(depth):
        y = torch.relu(nn.functional.linear(x, state[f"layers.{i}.weight"], state[f"layers.{i}.bias"]))
        x = y + x if i > 0 else y
    return nn.functional.linear(x, state["fc_out.weight"], state["fc_out.bias"])


@pytest.fixture(scope="module")
def target():
    model = make_target("qwen3", vocab_size=VOCAB, hidden_size=64, seed=0)
    model.generation_config.pad_token_id = 0
    return model


def _prefill(target, ids):
    with torch.no_grad():
        return target(ids, output_hidden_states=True)


def test_imported_policy_chooses_as_the_authors_predictor_does(target, tmp_path):
    state = authors_state_dict()
    torch.save(state, tmp_path / "model.pt")
    drafter = make_drafter(target, block_size=16)
    policy = import_authors_policy(tmp_path / "model.pt", target, drafter)
    assert policy.architecture == "last-logits-mlp" and policy.candidates == [14, 15, 16, 17, 18]
    assert next(policy.parameters()).dtype == torch.bfloat16  # their dtype kept
    policy.save_pretrained(tmp_path / "policy")
    loaded = BlockPilotPolicy.from_pretrained(tmp_path / "policy")  # strict
    assert next(loaded.parameters()).dtype == torch.bfloat16
    head = target.get_output_embeddings()
    chosen = set()
    for seed in range(12):
        ids = torch.randint(1, VOCAB, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        outputs = _prefill(target, ids)
        logits = target(ids).logits[:, -1]  # what their benchmark records: the prefill's last-token logits
        expected = authors_forward(state, logits.to(torch.bfloat16))
        block_size, probs = loaded.choose_block_size(outputs, head, temperature=0.0)
        assert block_size == 14 + int(expected.argmax())  # their `pred + 14`
        assert list(probs.values()) == pytest.approx(torch.softmax(expected[0].float(), -1).tolist(), abs=1e-6)
        chosen.add(block_size)
    assert len(chosen) > 1  # the random predictor's choice depends on the prompt


def test_imported_policy_decodes_losslessly_under_generate(target, tmp_path):
    torch.save(authors_state_dict(seed=1), tmp_path / "model.pt")
    drafter = make_drafter(target, block_size=16).eval()
    drafter.set_policy(import_authors_policy(tmp_path / "model.pt", target, drafter))
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    common = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = target.generate(ids, **common)
    got = target.generate(ids, assistant_model=drafter, draft_controller=default_where_drafting_pays(drafter), **common)
    assert torch.equal(got, expected)
    assert drafter.last_stats.block_size in range(14, 19)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda s: s | {"layers.0.weight": torch.zeros(WIDTH, VOCAB + 1, dtype=torch.bfloat16)},
            "trained for another target",
        ),
        (lambda s: {k: v for k, v in s.items() if k != "fc_out.bias"}, "missing ['fc_out.bias']"),
        (lambda s: s | {"head.weight": torch.zeros(1)}, "unexpected ['head.weight']"),
        (
            lambda s: s | {"layers.1.weight": torch.zeros(WIDTH, 3, dtype=torch.bfloat16)},
            "does not fit the predictor layout",
        ),
        (lambda s: s | {"fc_out.weight": torch.zeros(4, WIDTH), "fc_out.bias": torch.zeros(4)}, "4 output classes"),
    ],
)
def test_checkpoints_outside_the_layout_are_clear_errors(target, tmp_path, change, message):
    torch.save(change(authors_state_dict(width=64)), tmp_path / "model.pt")
    with pytest.raises(ValueError) as err:
        import_authors_policy(tmp_path / "model.pt", target)
    assert message in str(err.value)


def test_a_pickle_that_is_not_a_state_dict_is_refused(target, tmp_path):
    torch.save({"model": {"layers.0.weight": torch.zeros(2, 2)}}, tmp_path / "nested.pt")
    with pytest.raises(ValueError, match="state dict of tensors"):
        import_authors_policy(tmp_path / "nested.pt", target)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable torch state dict"):
        import_authors_policy(tmp_path / "junk.pt", target)
    import argparse

    torch.save({"layers.0.weight": argparse.Namespace()}, tmp_path / "code.pt")  # would run code to unpickle
    with pytest.raises(ValueError, match="not a readable torch state dict"):
        import_authors_policy(tmp_path / "code.pt", target)


def test_import_policy_command(tmp_path, capsys):
    target_dir, drafter_dir = save_tiny_pair(tmp_path, family="qwen3", vocab_size=VOCAB)
    torch.save(authors_state_dict(width=256, depth=3, classes=3), tmp_path / "model.pt")
    models = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--device", "cpu"]
    out = tmp_path / "imported"
    assert (
        main(
            ["import-policy", str(tmp_path / "model.pt"), *models, "--output", str(out), "--candidates", "4", "8", "2"]
        )
        == 0
    )
    policy = BlockPilotPolicy.from_pretrained(out)
    assert policy.candidates == [4, 8, 2] and len(policy.logits_mlp.layers) == 3  # class order kept
    card = (out / "README.md").read_text()
    assert "raw last-token logits" in card and "hidden states of target layers" not in card
    capsys.readouterr()
    assert main(["generate", "hello", *models, "--policy", str(out), "--max-new-tokens", "6", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["block_size"] in (2, 4, 8)
    assert main(["import-policy", str(tmp_path / "absent.pt"), *models, "--output", str(out)]) == 2
    assert "no predictor checkpoint" in capsys.readouterr().err
