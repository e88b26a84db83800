"""Tiny random-weight targets and drafters built from configs (CPU, offline)."""

from __future__ import annotations

import os
import string

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hf_blockpilot  # noqa: F401  (installs the generate() routing)
from hf_blockpilot import BlockDiffusionDrafter
from hf_blockpilot.batched import BatchedSpeculativeDecoder

# Decisions weigh the shipped fallback costs unless a test calibrates (monkeypatching the variable): timing
# tiny models is noise, and tests must not write to the user's cache.
os.environ.setdefault("HF_BLOCKPILOT_CALIBRATE", "0")

# Tiny models: one thread is faster and keeps tests stable next to other work on 2 cores.
torch.set_num_threads(1)


def make_target(family: str = "llama", vocab_size: int = 97, hidden_size: int = 64, layers: int = 4, seed: int = 0):
    """A tiny random causal LM of the given family."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif family == "gemma3":  # embeddings scaled by sqrt(hidden) inside the embedding module; softcapped logits
        config = Gemma3TextConfig(
            head_dim=16, layer_types=["full_attention"] * layers, final_logit_softcapping=30.0, **common
        )
        model = Gemma3ForCausalLM(config)
    else:
        raise ValueError(family)
    return model.eval()


def make_sharp_target(vocab_size: int = 4):
    """A one-layer tiny-vocab target whose next-token law is far from uniform (a random init is nearly uniform),
    for the chi-square tests of sampling."""
    model = make_target("llama", vocab_size=vocab_size, hidden_size=32, layers=1, seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    return model


def make_drafter(target, seed: int = 0, block_size: int = 8, scale: float = 1.0, **kwargs) -> BlockDiffusionDrafter:
    """A random drafter for `target`; `scale` > 1 sharpens its (random) draft distribution."""
    torch.manual_seed(seed)
    drafter = BlockDiffusionDrafter.from_target(target, block_size=block_size, **kwargs).eval()
    if scale != 1.0:
        with torch.no_grad():
            drafter.norm.weight.mul_(scale)
    return drafter


def make_windowed_drafter(
    target, sliding_window: int, layer_types: list[str] | None = None, is_causal: bool | None = None, **kwargs
) -> BlockDiffusionDrafter:
    """`make_drafter(target, **kwargs)`'s drafter (same weights) with the newer z-lab drafters' attention:
    `layer_types` (default: all sliding) over a `sliding_window`, and a top-level `is_causal` if given."""
    from hf_blockpilot.configuration_block_diffusion import BlockDiffusionConfig

    base = make_drafter(target, **kwargs)
    config = base.config.to_dict()
    config.update(
        use_sliding_window=True,
        sliding_window=sliding_window,
        layer_types=layer_types or ["sliding_attention"] * config["num_hidden_layers"],
    )
    if is_causal is not None:
        config["is_causal"] = is_causal
    drafter = BlockDiffusionDrafter(BlockDiffusionConfig.from_dict(config)).to(target.dtype).eval()
    drafter.load_state_dict(base.state_dict())
    return drafter


def init_dflash2(model: torch.nn.Module, seed: int, sharpen: float) -> None:
    """Random DFlash 2 weights that make the convolutions and the selector matter (the reference leaves
    `base_kernel` uninitialised) and drafts that a target often accepts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.copy_(0.4 * torch.randn(conv.base_kernel.shape, generator=gen))
                conv.base_kernel[:, 0] += 1.0
                conv.kernel_projection.weight.mul_(4.0)
        model.candidate_selector.hidden_projection.weight.normal_(0.0, 0.5, generator=gen)
        model.norm.weight.mul_(sharpen)


def make_dflash2_drafter(
    target, seed: int = 0, block_size: int = 4, sharpen: float = 8.0, **sizes
) -> BlockDiffusionDrafter:
    """A random DFlash 2 drafter (convolutions + candidate selector) for `target`."""
    from hf_blockpilot.configuration_block_diffusion import BlockDiffusionConfig

    torch.manual_seed(seed)
    config = BlockDiffusionDrafter.from_target(target, block_size=block_size).config.to_dict()
    hidden = config["hidden_size"]
    config["dflash_config"].update(
        {"conv_kernel_size": 2, "conv_group_size": min(8, hidden), "selector_rank": 4, "selector_top_k": 3, **sizes}
    )
    drafter = BlockDiffusionDrafter(BlockDiffusionConfig.from_dict(config)).to(target.dtype).eval()
    init_dflash2(drafter, seed, sharpen)
    return drafter


def default_where_drafting_pays(drafter):
    """The default controller (`default_controller`: the guard around the drafter's policy or block size), judged
    on costs where drafting any width pays (a verify of up to 64 tokens costs one plain step): it drafts at the width
    it decides, on any machine and whatever the shipped fallback table says."""
    from hf_blockpilot.controllers import default_controller
    from hf_blockpilot.costs import CostModel

    controller = default_controller(drafter)
    controller.use_cost_model(CostModel(target_ms={1: 10.0, 64: 10.0}, drafter_ms={2: 1.0, 64: 1.0}))
    return controller


def greedy_generate(target, prompt, max_new_tokens, eos, **kwargs):
    """Greedy `generate` stopping on `eos` (None: only on length), pad id 0; kwargs e.g. `assistant_model`."""
    return target.generate(
        prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0, **kwargs
    )


@pytest.fixture
def built_decoders(monkeypatch):
    """Collect the decoders (`BatchedSpeculativeDecoder`) block-diffusion calls build (behaviour unchanged)."""
    built = []
    run = BatchedSpeculativeDecoder.run

    def spy(decoder):
        built.append(decoder)
        return run(decoder)

    monkeypatch.setattr(BatchedSpeculativeDecoder, "run", spy)
    return built


@pytest.fixture(params=["llama", "qwen3"])
def family(request) -> str:
    return request.param


class ScriptedDrafter(BlockDiffusionDrafter):
    """A drafter rigged to be *often right*: it runs the real drafter forward (cache, context, RoPE), then
    replaces its output so that the target's LM head yields `script[position]` at each block slot, except
    with probability `error_rate` per slot, where it proposes a wrong token. Needs vocab <= hidden size, so
    that the LM head has an exact right inverse."""

    def rig(
        self,
        target,
        script: torch.Tensor,
        error_rate: float,
        seed: int = 0,
        by_position: bool = False,
        varied_confidence: bool = False,
    ) -> ScriptedDrafter:
        """`by_position`: whether a slot errs depends only on the (anchor, slot) position, not on the call order.
        `varied_confidence`: each slot's logit margin is drawn at random (wrong slots tend to be less sure), so
        controllers that read confidences see a spread."""
        self.script = script.view(-1)
        self.error_rate = error_rate
        self.varied_confidence = varied_confidence
        self.rng = torch.Generator().manual_seed(seed)
        self.errors = None
        if by_position:
            self.errors = torch.rand((self.script.numel(), self.block_size), generator=self.rng) < error_rate
        weight = target.get_output_embeddings().weight.detach().float()
        assert weight.shape[0] <= weight.shape[1], "ScriptedDrafter needs vocab_size <= hidden_size"
        self.head_inverse = torch.linalg.pinv(weight)  # (hidden, vocab)
        return self

    def forward(self, block_embeds, block_position_ids, **kwargs):
        out = super().forward(block_embeds, block_position_ids, **kwargs)
        vocab = self.head_inverse.shape[1]
        positions = block_position_ids[0].clamp(max=self.script.numel() - 1)
        tokens = self.script[positions].clone()
        if self.errors is None:
            wrong = torch.rand(tokens.shape, generator=self.rng) < self.error_rate
        else:
            wrong = self.errors[positions[0], : tokens.numel()]
        tokens[wrong] = (tokens[wrong] + 1 + torch.randint(vocab - 1, tokens[wrong].shape, generator=self.rng)) % vocab
        margin = torch.full(tokens.shape, 20.0)
        if getattr(self, "varied_confidence", False):
            margin = 0.5 + 8.0 * torch.rand(tokens.shape, generator=self.rng) * torch.where(wrong, 0.4, 1.0)
        logits = margin.unsqueeze(-1) * torch.nn.functional.one_hot(tokens, vocab).float()
        out.last_hidden_state = (logits @ self.head_inverse.T).unsqueeze(0).to(out.last_hidden_state.dtype)
        return out


class BatchScriptedDrafter(BlockDiffusionDrafter):
    """`ScriptedDrafter` for batches: `scripts[i]` is row i's expected real tokens (prompt without padding, then
    its output), and each batch row of a forward is matched to the first remaining script whose token at the
    block's anchor position is the anchor (rows keep their order as finished ones leave the batch)."""

    def rig(self, target, scripts: list[list[int]], error_rate: float, seed: int = 0) -> BatchScriptedDrafter:
        self.scripts = scripts
        self.error_rate = error_rate
        self.rng = torch.Generator().manual_seed(seed)
        weight = target.get_output_embeddings().weight.detach().float()
        assert weight.shape[0] <= weight.shape[1], "BatchScriptedDrafter needs vocab_size <= hidden_size"
        self.head_inverse = torch.linalg.pinv(weight)
        self.embedding = target.get_input_embeddings().weight.detach().float()
        return self

    def forward(self, block_embeds, block_position_ids, **kwargs):
        out = super().forward(block_embeds, block_position_ids, **kwargs)
        vocab = self.head_inverse.shape[1]
        anchors = torch.cdist(block_embeds[:, 0].float(), self.embedding).argmin(-1).tolist()
        rows, width = block_position_ids.shape
        hidden, start = [], 0
        for r in range(rows):
            position, anchor = int(block_position_ids[r, 0]), anchors[r]
            match = next(
                (
                    i
                    for i in range(start, len(self.scripts))
                    if position < len(self.scripts[i]) and self.scripts[i][position] == anchor
                ),
                None,
            )
            start = start if match is None else match + 1
            script = self.scripts[match] if match is not None else [anchor]
            positions = (block_position_ids[r]).clamp(max=len(script) - 1)
            tokens = torch.tensor(script)[positions]
            wrong = torch.rand(tokens.shape, generator=self.rng) < (self.error_rate if match is not None else 1.0)
            tokens[wrong] = (
                tokens[wrong] + 1 + torch.randint(vocab - 1, tokens[wrong].shape, generator=self.rng)
            ) % vocab
            logits = 20.0 * torch.nn.functional.one_hot(tokens, vocab).float()
            hidden.append(logits @ self.head_inverse.T)
        out.last_hidden_state = torch.stack(hidden).to(out.last_hidden_state.dtype)
        return out


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}Q{% endif %}"


def char_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """An offline tokenizer over a tiny vocab: id 0 = <pad>, then single characters; with a chat template."""
    chars = (string.ascii_lowercase + string.ascii_uppercase)[: vocab_size - 1]
    vocab = {"<pad>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == vocab_size
    sample = "abcA" if vocab_size > 27 else "abc"
    ids = [1, 2, 3, 27][: len(sample)]
    assert tokenizer(sample, add_special_tokens=False)["input_ids"] == ids and tokenizer.decode(ids) == sample
    return tokenizer


def save_tiny_pair(directory, family: str = "llama", vocab_size: int = 48, block_size: int = 4):
    """A tiny target (+ tokenizer with chat template) and a drafter for it, saved as checkpoints."""
    target = make_target(family, vocab_size=vocab_size, hidden_size=64, seed=0)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    target.save_pretrained(directory / "target")
    char_tokenizer(vocab_size).save_pretrained(directory / "target")
    make_drafter(target, block_size=block_size).save_pretrained(directory / "drafter")
    return directory / "target", directory / "drafter"
