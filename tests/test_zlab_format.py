"""z-lab DFlash checkpoints load unchanged, and `save_pretrained` writes the same on-disk format.

The checkpoint is written by hand exactly as z-lab ships it (e.g. `z-lab/Qwen3-4B-DFlash-b16`): a Qwen3-style
`config.json` with `architectures: ["DFlashDraftModel"]`, `auto_map`, `block_size`, `num_target_layers` and
`dflash_config`, and a `model.safetensors` in bfloat16 holding only the drafter's own tensors (no embedding, no
LM head, no rotary buffers).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import make_drafter, make_target
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

from hf_blockpilot import BlockDiffusionConfig, BlockDiffusionDrafter
from hf_blockpilot.configuration_block_diffusion import build_target_layer_ids

VOCAB, HIDDEN, INTERMEDIATE, TARGET_LAYERS = 97, 64, 128, 4  # conftest's default tiny target
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
ZLAB_LAYER_KEYS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]


def zlab_keys(num_layers: int) -> set[str]:
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    keys |= {f"layers.{n}.{k}" for n in range(num_layers) for k in ZLAB_LAYER_KEYS}
    return keys


def zlab_config(
    num_layers: int = 2,
    block_size: int = 4,
    target_layer_ids: list[int] | None = (0, 2),
    mask_token_id: int = VOCAB - 1,
    num_target_layers: int = TARGET_LAYERS,
    dtype_key: str = "torch_dtype",
) -> dict:
    """A config.json as z-lab writes it (transformers 4.5x Qwen3Config + DFlash fields)."""
    dflash_config = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash_config["target_layer_ids"] = list(target_layer_ids)
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": block_size,
        "bos_token_id": 1,
        "dflash_config": dflash_config,
        dtype_key: "bfloat16",
        "eos_token_id": 2,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": 512,
        "max_window_layers": num_layers,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": KV_HEADS,
        "num_target_layers": num_target_layers,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "transformers_version": "4.57.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


def zlab_state_dict(num_layers: int, num_context_layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bfloat16 tensors under exactly z-lab's keys; norms away from 1 so an unloaded one shows."""
    gen = torch.Generator().manual_seed(seed)

    def lin(out_features, in_features):
        return (0.05 * torch.randn(out_features, in_features, generator=gen)).to(torch.bfloat16)

    def norm(size):
        return (1.0 + 0.2 * torch.randn(size, generator=gen)).to(torch.bfloat16)

    sd = {
        "fc.weight": lin(HIDDEN, num_context_layers * HIDDEN),
        "hidden_norm.weight": norm(HIDDEN),
        "norm.weight": norm(HIDDEN),
    }
    for n in range(num_layers):
        p = f"layers.{n}."
        sd[p + "self_attn.q_proj.weight"] = lin(HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.k_proj.weight"] = lin(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.v_proj.weight"] = lin(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.o_proj.weight"] = lin(HIDDEN, HEADS * HEAD_DIM)
        sd[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM)
        sd[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM)
        sd[p + "mlp.gate_proj.weight"] = lin(INTERMEDIATE, HIDDEN)
        sd[p + "mlp.up_proj.weight"] = lin(INTERMEDIATE, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = lin(HIDDEN, INTERMEDIATE)
        sd[p + "input_layernorm.weight"] = norm(HIDDEN)
        sd[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
    assert set(sd) == zlab_keys(num_layers)
    return sd


def write_zlab_checkpoint(directory: Path, config: dict, state_dict: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(state_dict, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@contextlib.contextmanager
def capture_transformers_log():
    """Records transformers' log records (WARNING and up) and Python warnings."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("transformers")
    handler = Collect(level=logging.WARNING)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield records
        records.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, layers=TARGET_LAYERS, seed=0)


def _greedy(target, prompt, **kwargs):
    return target.generate(prompt, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0, **kwargs)


def _prompt():
    return torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))


def _drafter_logits(drafter, target, prompt, block_size: int = 5):
    """Drafter output on one block after `prompt` (deterministic; used to compare two drafters)."""
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
        ctx = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], -1)
        n = prompt.shape[1]
        block = torch.full((1, block_size), drafter.mask_token_id)
        block[0, 0] = prompt[0, -1]
        hidden = drafter(
            block_embeds=target.get_input_embeddings()(block),
            block_position_ids=torch.arange(n - 1, n - 1 + block_size)[None],
            target_hidden=ctx[:, : n - 1],
            context_position_ids=torch.arange(n - 1)[None],
        ).last_hidden_state
    return hidden.float()


def assert_rope_initialised(drafter, theta: float = 10000.0):
    """`inv_freq` is a non-persistent buffer, rebuilt (not loaded) by from_pretrained: it must be RoPE's."""
    expected = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    torch.testing.assert_close(drafter.rotary_emb.inv_freq.float(), expected)


def assert_same_as_state_dict_load(drafter, state_dict, target):
    """A drafter built from the same config with `load_state_dict` (no from_pretrained) computes the same."""
    reference = BlockDiffusionDrafter(copy.deepcopy(drafter.config)).float().eval()
    reference.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    ours = copy.deepcopy(drafter).float().eval()
    prompt = _prompt()
    torch.testing.assert_close(_drafter_logits(ours, target, prompt), _drafter_logits(reference, target, prompt))


@pytest.mark.parametrize("dtype_key", ["torch_dtype", "dtype"])
def test_load_zlab_checkpoint_exactly(tmp_path, target, dtype_key):
    sd = zlab_state_dict(num_layers=2, num_context_layers=2)
    path = write_zlab_checkpoint(tmp_path / "zlab", zlab_config(dtype_key=dtype_key), sd)
    with capture_transformers_log() as log:
        drafter, info = BlockDiffusionDrafter.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert log == [], log  # no load report, no warnings at all

    loaded = drafter.state_dict()
    assert set(loaded) == set(sd), set(loaded) ^ set(sd)
    for key, value in sd.items():
        assert loaded[key].dtype == torch.bfloat16, key
        assert torch.equal(loaded[key], value), key

    assert isinstance(drafter.config, BlockDiffusionConfig)
    assert drafter.block_size == drafter.config.block_size == 4
    assert drafter.mask_token_id == VOCAB - 1
    assert drafter.target_layer_ids == [0, 2]
    assert drafter.config.num_target_layers == TARGET_LAYERS
    assert drafter.config.num_hidden_layers == len(drafter.layers) == 2
    assert drafter.d2t is None
    assert drafter.config.rope_parameters["rope_theta"] == 10000.0
    assert_rope_initialised(drafter)
    assert_same_as_state_dict_load(drafter, sd, target)

    drafter.eval()
    prompt = _prompt()
    expected = _greedy(target, prompt)
    assert torch.equal(_greedy(target, prompt, assistant_model=drafter), expected)  # bf16 drafter, fp32 target
    assert drafter.last_stats.drafter_forwards > 0


def test_load_warnings_are_captured(tmp_path):
    """Negative control: the capture above does see a load report with missing/unexpected keys; and such a
    checkpoint is an error naming them, not a drafter with a random norm."""
    sd = zlab_state_dict(num_layers=2, num_context_layers=2)
    sd["extra.weight"] = sd.pop("norm.weight")
    path = write_zlab_checkpoint(tmp_path / "broken", zlab_config(), sd)
    with (
        capture_transformers_log() as log,
        pytest.raises(
            ValueError,
            match=r"does not use \['extra.weight'\]; weights it needs but the checkpoint lacks \['norm.weight'\]",
        ),
    ):
        BlockDiffusionDrafter.from_pretrained(path)
    assert any("norm.weight" in m for m in log), log


def test_zlab_config_without_layer_ids_gets_dflash_default(tmp_path):
    num_target_layers, num_layers = 8, 3
    expected_ids = [1, 3, 5]  # DFlash: round(1 + i * (8 - 3 - 1) / (3 - 1)) for i in 0..2
    assert build_target_layer_ids(num_target_layers, num_layers) == expected_ids
    config = zlab_config(num_layers=num_layers, target_layer_ids=None, num_target_layers=num_target_layers)
    assert "target_layer_ids" not in config["dflash_config"]
    sd = zlab_state_dict(num_layers=num_layers, num_context_layers=len(expected_ids))
    path = write_zlab_checkpoint(tmp_path / "noids", config, sd)
    drafter, info = BlockDiffusionDrafter.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert drafter.target_layer_ids == expected_ids
    assert drafter.fc.weight.shape == (HIDDEN, len(expected_ids) * HIDDEN)
    assert torch.equal(drafter.fc.weight, sd["fc.weight"])
    assert_rope_initialised(drafter)
    target = make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, layers=num_target_layers, seed=1)
    prompt = _prompt()
    assert torch.equal(_greedy(target, prompt, assistant_model=drafter.eval()), _greedy(target, prompt))


def _saved(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config = json.loads((directory / "config.json").read_text())
    files = sorted(directory.glob("*.safetensors"))
    assert [f.name for f in files] == ["model.safetensors"]
    with safe_open(str(files[0]), "pt") as f:
        assert (f.metadata() or {}).get("format") == "pt"  # what z-lab's and HF loaders expect
    return config, load_file(str(files[0]))


def test_save_pretrained_writes_zlab_format_and_round_trips(tmp_path, target):
    sd = zlab_state_dict(num_layers=2, num_context_layers=2)
    drafter = BlockDiffusionDrafter.from_pretrained(write_zlab_checkpoint(tmp_path / "zlab", zlab_config(), sd))
    drafter.block_size = 7  # the runtime block size is a per-instance setting, not the trained one
    drafter.save_pretrained(tmp_path / "ours")
    config, tensors = _saved(tmp_path / "ours")

    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 4
    assert config["num_target_layers"] == TARGET_LAYERS
    assert config["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2]}
    assert config["rope_theta"] == zlab_config()["rope_theta"]  # what Transformers 4.x readers take RoPE's base from
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_hidden_layers",
        "rms_norm_eps",
        "vocab_size",
    ):
        assert config[key] == zlab_config()[key], key
    assert set(tensors) == zlab_keys(2), set(tensors) ^ zlab_keys(2)  # no rotary buffers, no d2t
    for key, value in sd.items():
        assert torch.equal(tensors[key], value), key

    with capture_transformers_log() as log:
        reloaded, info = BlockDiffusionDrafter.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info.values()), info
    assert log == [], log
    assert reloaded.block_size == 4
    assert reloaded.target_layer_ids == [0, 2] and reloaded.mask_token_id == VOCAB - 1
    assert_rope_initialised(reloaded)
    prompt = _prompt()
    reloaded_logits = _drafter_logits(reloaded.eval(), target, prompt)
    assert torch.equal(reloaded_logits, _drafter_logits(drafter.eval(), target, prompt))
    reloaded.block_size = drafter.block_size = 5
    out_a = _greedy(target, prompt, assistant_model=drafter)
    stats_a = drafter.last_stats
    out_b = _greedy(target, prompt, assistant_model=reloaded)
    assert torch.equal(out_a, out_b) and torch.equal(out_a, _greedy(target, prompt))
    assert stats_a.accepted_per_round == reloaded.last_stats.accepted_per_round


def test_reduced_vocab_round_trip_keeps_d2t(tmp_path, target):
    draft_vocab = list(range(0, VOCAB, 3))
    drafter = make_drafter(target, seed=4, block_size=6, draft_vocab=draft_vocab)
    drafter.save_pretrained(tmp_path / "reduced")
    config, tensors = _saved(tmp_path / "reduced")
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["draft_vocab_size"] == len(draft_vocab)
    num_layers = drafter.config.num_hidden_layers
    assert set(tensors) == zlab_keys(num_layers) | {"d2t"}, set(tensors) ^ (zlab_keys(num_layers) | {"d2t"})
    assert tensors["d2t"].tolist() == draft_vocab

    reloaded, info = BlockDiffusionDrafter.from_pretrained(tmp_path / "reduced", output_loading_info=True)
    assert not any(info.values()), info
    assert reloaded.d2t.tolist() == draft_vocab
    assert_rope_initialised(reloaded)
    prompt = _prompt()
    assert torch.equal(_drafter_logits(reloaded.eval(), target, prompt), _drafter_logits(drafter, target, prompt))
    out = _greedy(target, prompt, assistant_model=reloaded)
    assert torch.equal(out, _greedy(target, prompt, assistant_model=drafter))
    assert torch.equal(out, _greedy(target, prompt))

    # the full-vocabulary drafter writes no d2t
    make_drafter(target, seed=4).save_pretrained(tmp_path / "full")
    assert "d2t" not in _saved(tmp_path / "full")[1]


def test_reduced_head_slice_is_reused_until_the_head_or_map_changes(target):
    target = copy.deepcopy(target)  # the head is modified below; the fixture is shared
    drafter = make_drafter(target, seed=4, block_size=6, draft_vocab=list(range(0, VOCAB, 3)))
    head = target.get_output_embeddings()
    weight, _ = drafter.draft_head(head)
    assert torch.equal(weight, head.weight[drafter.d2t])
    assert drafter.draft_head(head)[0] is weight  # no new copy per request
    with torch.no_grad():
        head.weight[0].add_(1.0)  # an in-place update (e.g. fine-tuning) invalidates it
        drafter.d2t[0] = 1
    updated, _ = drafter.draft_head(head)
    assert updated is not weight and torch.equal(updated, head.weight[drafter.d2t])
    with torch.inference_mode():  # a slice made under inference mode is never handed to autograd code
        assert drafter.draft_head(head)[0] is not updated
    assert drafter.draft_head(head)[0] is not updated and not drafter.draft_head(head)[0].is_inference()
    with torch.inference_mode():  # a head made under inference mode has no version counter: sliced every call
        frozen = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    first = drafter.draft_head(frozen)[0]
    assert torch.equal(first, frozen.weight[drafter.d2t]) and drafter.draft_head(frozen)[0] is not first


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_loading_a_target_checkpoint_as_drafter_fails_clearly(tmp_path, family):
    make_target(family, vocab_size=VOCAB, hidden_size=HIDDEN).save_pretrained(tmp_path / family)
    with pytest.raises(ValueError, match="not a DFlash drafter checkpoint"):
        BlockDiffusionDrafter.from_pretrained(tmp_path / family)


def test_drafter_and_policy_checkpoints_are_not_taken_for_each_other(tmp_path):
    from hf_blockpilot import BlockPilotPolicy
    from hf_blockpilot.policy import PrefillMLPPolicy

    target = make_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN)
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    PrefillMLPPolicy(
        candidates=[1, 4],
        feature_layers=[1],
        target_hidden_size=HIDDEN,
        target_vocab_size=VOCAB,
        target_num_layers=TARGET_LAYERS,
    ).save_pretrained(tmp_path / "policy")
    with pytest.raises(
        ValueError,
        match=r"not a DFlash drafter checkpoint: its config has no `dflash_config` "
        r"\(it holds a BlockPilot policy",
    ):
        BlockDiffusionDrafter.from_pretrained(tmp_path / "policy")
    for other in ("drafter", "target"):
        if other == "target":
            target.save_pretrained(tmp_path / "target")
        with pytest.raises(ValueError, match=r"is not a BlockPilot policy checkpoint .*'candidates'"):
            BlockPilotPolicy.from_pretrained(tmp_path / other)


def _write_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> str:
    """Lay `files` out like huggingface_hub's cache: blobs + snapshot symlinks + refs/main."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo_dir / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snapshot / name)
    return commit


def test_load_by_repo_id_from_offline_hub_cache(tmp_path):
    sd = zlab_state_dict(num_layers=2, num_context_layers=2, seed=3)
    src = write_zlab_checkpoint(tmp_path / "src", zlab_config(), sd)
    cache = tmp_path / "hub"
    _write_hub_cache(cache, "org/name", {f: (src / f).read_bytes() for f in ("config.json", "model.safetensors")})
    script = (
        "import torch, hf_blockpilot\n"
        "d = hf_blockpilot.BlockDiffusionDrafter.from_pretrained('org/name')\n"
        "torch.save({k: v.clone() for k, v in d.state_dict().items()}, 'loaded.pt')\n"
        "print(d.block_size, d.mask_token_id, d.target_layer_ids)\n"
    )
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("TRANSFORMERS_CACHE", None)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-2] == f"4 {VOCAB - 1} [0, 2]"
    loaded = torch.load(tmp_path / "loaded.pt")
    assert set(loaded) == set(sd)
    for key, value in sd.items():
        assert torch.equal(loaded[key], value), key


def test_auto_classes():
    config = AutoConfig.for_model("blockpilot_dflash")
    assert isinstance(config, BlockDiffusionConfig)
    config = BlockDiffusionConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=8,
        num_target_layers=TARGET_LAYERS,
        dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 2]},
    )
    model = AutoModel.from_config(config)
    assert type(model) is BlockDiffusionDrafter
    assert model.block_size == 8 and model.target_layer_ids == [1, 2]
    assert model.fc.weight.shape == (HIDDEN, 2 * HIDDEN)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop", "hold no `d2t` map"),
        ("negative", "outside the vocabulary"),
        ("too_large", "outside the vocabulary"),
        ("repeated", "several draft tokens to one target id"),
    ],
)
def test_a_damaged_or_missing_draft_vocabulary_map_is_a_load_error(tmp_path, target, change, message):
    draft_vocab = list(range(0, VOCAB, 3))
    make_drafter(target, seed=4, block_size=6, draft_vocab=draft_vocab).save_pretrained(tmp_path / "reduced")
    path = tmp_path / "reduced" / "model.safetensors"
    tensors = load_file(path)
    if change == "drop":
        del tensors["d2t"]
    elif change == "negative":
        tensors["d2t"][0] = -3
    elif change == "too_large":
        tensors["d2t"][-1] = VOCAB + 7
    else:
        tensors["d2t"][1] = tensors["d2t"][0]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        BlockDiffusionDrafter.from_pretrained(tmp_path / "reduced")
