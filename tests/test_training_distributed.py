"""Drafter training on torch.distributed (gloo on CPU): 2 ranks x 2 sequences a step train exactly as 1 rank x 4."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import make_target

from hf_blockpilot import BlockDiffusionDrafter
from hf_blockpilot.training.data import TrainingSequence
from hf_blockpilot.training.distributed import rank_and_world_size
from hf_blockpilot.training.drafter import (
    STATE_FILE,
    DrafterTrainer,
    DrafterTrainingConfig,
    init_drafter_from_target,
)

STEPS = 4


def _sequences() -> list[TrainingSequence]:
    g = torch.Generator().manual_seed(0)
    return [
        TrainingSequence(f"seq/{i}", torch.randint(3, 48, (14 + 3 * i,), generator=g).tolist(), 4) for i in range(6)
    ]


#: A DFlash 2 drafter's sizes for the tests' tiny target (hidden size 64).
DFLASH2_SIZES = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5}


def _train(output_dir: Path, fsdp: bool = False, save_every: int = STEPS, dflash2: bool = False) -> None:
    """One rank's run (or the only one): same target, drafter and data on every rank."""
    torch.set_num_threads(1)
    target, drafter = _initial(dflash2)
    config = _config(save_every=save_every, fsdp=fsdp)
    DrafterTrainer(drafter, target, _sequences(), None, output_dir, config).train()


def _initial(dflash2: bool = False) -> tuple[torch.nn.Module, BlockDiffusionDrafter]:
    """The tests' target and the drafter every run starts from."""
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    torch.manual_seed(0)
    sizes = DFLASH2_SIZES if dflash2 else None
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4, dflash2=sizes)
    init_drafter_from_target(drafter, target)
    return target, drafter


def _config(**overrides) -> DrafterTrainingConfig:
    """The tests' runs: 4 sequences a step, every step logged, no held-out sequences, float32."""
    settings = dict(block_size=4, anchors_per_sequence=5, sequences_per_step=4, max_steps=STEPS, learning_rate=1e-2)
    settings |= dict(warmup_steps=1, log_every=1, save_every=STEPS, bf16=False, validation_fraction=0.0)
    return DrafterTrainingConfig(**settings | overrides)


def _rank(rank: int, world_size: int, rendezvous: str, output_dir: str, fsdp: bool, dflash2: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        assert rank_and_world_size() == (rank, world_size)
        _train(Path(output_dir), fsdp, dflash2=dflash2)
    finally:
        dist.destroy_process_group()


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_ranks_train_exactly_as_one_with_the_same_global_batch(tmp_path, fsdp, dflash2):
    """DDP replicates the drafter, FSDP2 shards it (and the target computing hidden states live); a DFlash 2
    drafter's candidate selector, scored outside the drafter's forward, trains alike too."""
    args = (2, str(tmp_path / "rendezvous"), str(tmp_path / "ddp"), fsdp, dflash2)
    mp.spawn(_rank, args=args, nprocs=2, join=True)
    _train(tmp_path / "single", dflash2=dflash2)
    ddp, single = _losses(tmp_path / "ddp"), _losses(tmp_path / "single")
    assert len(ddp) == len(single) == STEPS
    torch.testing.assert_close(torch.tensor(ddp), torch.tensor(single), rtol=1e-5, atol=1e-6)
    trained = {
        name: BlockDiffusionDrafter.from_pretrained(tmp_path / name / "checkpoint").state_dict()
        for name in ("ddp", "single")
    }
    initial = _initial(dflash2)[1]
    for key, value in trained["single"].items():  # AdamW turns a gradient near its eps (the ranks sum it in
        # another order) into a step of up to lr: 1e-4 absolute still catches any real divergence at lr = 1e-2
        ddp_value = trained["ddp"][key]
        torch.testing.assert_close(ddp_value, value, rtol=1e-4, atol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
    for name, parameter in initial.named_parameters():  # every trained weight moved, the selector's too
        assert not torch.equal(trained["ddp"][name], parameter.detach()), name
    assert not (tmp_path / "ddp" / "checkpoint.tmp").exists() and os.listdir(tmp_path / "ddp")


def test_more_ranks_than_sequences_a_step_is_a_clear_error(monkeypatch, tmp_path):
    from hf_blockpilot.training import drafter as drafter_module

    monkeypatch.setattr(drafter_module, "rank_and_world_size", lambda: (0, 8))
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4)
    with pytest.raises(ValueError, match="8 ranks need at least as many sequences per step"):
        DrafterTrainer(drafter, target, _sequences(), None, tmp_path, DrafterTrainingConfig(sequences_per_step=4))


def test_torchrun_runs_train_drafter_on_two_ranks(tmp_path):
    """The command line as torchrun starts it: two gloo ranks, rank 0 prepares the data, one checkpoint (of a
    DFlash 2 drafter, sharded with FSDP2)."""
    import shutil
    import subprocess
    import sys

    from conftest import save_tiny_pair

    from hf_blockpilot.training.data import RESPONSES_FILE

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    target_dir, _ = save_tiny_pair(tmp_path)
    data = tmp_path / "run" / "data"
    data.mkdir(parents=True)
    rows = [{"id": seq.id, "prompt_ids": seq.input_ids[:4], "response_ids": seq.input_ids[4:]} for seq in _sequences()]
    (data / RESPONSES_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "hf_blockpilot", "train-drafter"]
    command += ["--target", str(target_dir), "--output-dir", str(tmp_path / "run"), "--num-prompts", "0"]
    command += ["--chat-prompts", "0", "--num-layers", "1", "--block-size", "4", "--max-steps", "3"]
    command += ["--sequences-per-step", "4", "--anchors", "4", "--warmup-steps", "1"]
    command += ["--no-hidden-cache", "--fsdp"]  # the target's layers sharded too
    command += ["--dflash2"]  # over the full vocabulary without --draft-vocab-size 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    trained = BlockDiffusionDrafter.from_pretrained(tmp_path / "run" / "checkpoint")
    assert trained.config.block_size == 4 and trained.config.is_dflash2 and trained.d2t is None
    state = torch.load(tmp_path / "run" / "checkpoint" / STATE_FILE, weights_only=False)
    assert state["step"] == 3 and state["config"]["fsdp"] is True


KILLED_RUN = """
import os, signal, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[2])
from test_training_distributed import _train

update = torch.optim.AdamW.step
count = [0]

def step(self, *args, **kwargs):
    count[0] += 1
    if count[0] == 4:  # step 4, mid-step: its gradients computed, the update not made; the last save was step 2
        os.kill(os.getpid(), signal.SIGKILL)
    return update(self, *args, **kwargs)

torch.optim.AdamW.step = step
_train(Path(sys.argv[1]), save_every=2)
"""


def test_a_run_killed_mid_step_resumes_to_the_uninterrupted_weights(tmp_path):
    import signal
    import subprocess
    import sys

    tests = str(Path(__file__).parent)
    killed = subprocess.run([sys.executable, "-c", KILLED_RUN, str(tmp_path / "killed"), tests], timeout=600)
    assert killed.returncode == -signal.SIGKILL
    assert torch.load(tmp_path / "killed" / "checkpoint" / STATE_FILE, weights_only=False)["step"] == 2
    _train(tmp_path / "killed", save_every=2)  # resumes at step 2
    _train(tmp_path / "whole", save_every=2)
    resumed, whole = (
        BlockDiffusionDrafter.from_pretrained(tmp_path / name / "checkpoint").state_dict()
        for name in ("killed", "whole")
    )
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), key
    assert _losses(tmp_path / "killed")[-2:] == _losses(tmp_path / "whole")[-2:]  # steps 3 and 4, run again


def test_a_run_killed_between_the_checkpoint_renames_resumes_from_the_new_one(tmp_path):
    _train(tmp_path / "run", save_every=2)
    run = tmp_path / "run"
    (run / "checkpoint").rename(run / "checkpoint.tmp")  # as if killed after moving the old one aside
    (run / "checkpoint.old").mkdir()  # an older, incomplete leftover
    config = _config()
    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    drafter = BlockDiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4)
    trainer = DrafterTrainer(drafter, target, _sequences(), None, run, config)
    assert trainer.step == STEPS
    trainer.save()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]


def test_offline_hidden_states_are_sharded_over_ranks_and_train_as_live_ones(tmp_path, monkeypatch, caplog):
    import logging

    from hf_blockpilot.training import data as data_module
    from hf_blockpilot.training.data import MANIFEST_FILE, cache_hidden_states

    target = make_target("qwen3", vocab_size=48, hidden_size=64, seed=0)
    seqs = _sequences()
    layer_ids = [0, 1]
    computed = {}

    def spy(model, batch, ids, dtype):
        computed.setdefault(rank, []).extend(s.id for s in batch)
        return real(model, batch, ids, dtype)

    real = data_module.target_hidden_states
    monkeypatch.setattr(data_module, "target_hidden_states", spy)
    monkeypatch.setattr(data_module, "barrier", lambda: None)
    for rank in (1, 0):  # as two torchrun ranks would, rank 0 last (it writes the manifest)
        monkeypatch.setattr(data_module, "rank_and_world_size", lambda rank=rank: (rank, 2))
        with caplog.at_level(logging.INFO, logger=data_module.__name__):
            cache = cache_hidden_states(target, seqs, layer_ids, tmp_path / "hidden", torch.float32)
    assert sorted(computed[0] + computed[1]) == sorted(s.id for s in seqs) and not set(computed[0]) & set(computed[1])
    manifest = json.loads((cache / MANIFEST_FILE).read_text())
    token_bytes = 2 * 64 * 4  # two layers of 64 float32 values
    assert manifest["bytes_per_token"] == token_bytes and manifest["layer_ids"] == layer_ids
    assert manifest["bytes"] == sum(len(s.input_ids) for s in seqs) * token_bytes
    assert all((cache / manifest["sequences"][s.id]["file"]).exists() for s in seqs)
    assert "GB on disk" in caplog.text  # the cost, said before computing

    losses = {}
    for name, hidden_dir in (("offline", cache), ("live", None)):
        torch.manual_seed(0)
        drafter = BlockDiffusionDrafter.from_target(
            target, num_hidden_layers=1, block_size=4, target_layer_ids=layer_ids
        )
        DrafterTrainer(drafter, target, seqs, hidden_dir, tmp_path / name, _config(max_steps=3)).train()
        losses[name] = _losses(tmp_path / name)
    assert len(losses["offline"]) == len(losses["live"]) == 3
    # live states are computed in bfloat16 where the CPU runs it natively, the offline ones were stored in float32
    torch.testing.assert_close(torch.tensor(losses["offline"]), torch.tensor(losses["live"]), rtol=2e-2, atol=2e-2)


def test_prepare_hidden_states_command_writes_the_run_s_states_and_manifest(tmp_path, capsys):
    from conftest import save_tiny_pair

    from hf_blockpilot.cli import main
    from hf_blockpilot.training.data import MANIFEST_FILE, RESPONSES_FILE

    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    data = tmp_path / "run" / "data"
    data.mkdir(parents=True)
    rows = [{"id": s.id, "prompt_ids": s.input_ids[:4], "response_ids": s.input_ids[4:]} for s in _sequences()]
    (data / RESPONSES_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = ["prepare-hidden-states", "--target", str(target_dir), "--output-dir", str(tmp_path / "run")]
    assert main([*command, "--drafter", str(drafter_dir)]) == 0
    cache = Path(capsys.readouterr().out.strip().splitlines()[-1])
    manifest = json.loads((cache / MANIFEST_FILE).read_text())
    layers = BlockDiffusionDrafter.from_pretrained(drafter_dir).target_layer_ids
    assert (
        manifest["layer_ids"] == layers and len(manifest["sequences"]) == len(rows) and manifest["dtype"] == "bfloat16"
    )
    assert main(command) == 2  # no layers given: a clear error
    assert "--target-layer-ids" in capsys.readouterr().err
