"""Model card for a trained drafter, rendered from `templates/drafter_card.md` with measured τ."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ..configuration_block_diffusion import BlockDiffusionConfig
from ..modeling_block_diffusion import BlockDiffusionDrafter
from .evaluation import TauReport

TEMPLATE = Path(__file__).parent.parent / "templates" / "drafter_card.md"


def draft_layer_attention(config: BlockDiffusionConfig) -> str:
    """How the draft layers attend over [target context ; block], e.g. "non-causal" or "layer 0: causal,
    window 4; layer 1: non-causal"."""
    kinds = [config.layer_attention(i) for i in range(config.num_hidden_layers)]
    describe = [
        ("causal" if causal else "non-causal") + (f", window {window}" if window else "") for causal, window in kinds
    ]
    if len(set(describe)) == 1:
        return describe[0]
    return "; ".join(f"layer {i}: {d}" for i, d in enumerate(describe))


def drafter_model_card(
    drafter: BlockDiffusionDrafter,
    name: str,
    target_name: str,
    reports: Sequence[TauReport],
    recipe: str,
    train_command: str,
    eval_command: str,
    license: str = "apache-2.0",
) -> ModelCard:
    """The Hub model card of a drafter: architecture, measured τ per block size, recipe, reproduction."""
    block_sizes = sorted({b for r in reports for b in r.block_sizes})
    card_data = ModelCardData(
        library_name="hf-blockpilot",
        license=license,
        base_model=target_name,
        tags=["speculative-decoding", "dflash", "block-diffusion"],
    )
    draft_vocab = (
        f"{drafter.d2t.numel()} target ids (`d2t` map; -inf elsewhere). The DFlash reference loader (`dflash` "
        "package) drops `d2t` and drafts over the full vocabulary: there this is a different drafter; load it "
        "with hf-blockpilot"
        if drafter.d2t is not None
        else "the target's full vocabulary"
    )
    return ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE),
        name=name,
        target_name=target_name,
        num_layers=drafter.config.num_hidden_layers,
        layer_attention=draft_layer_attention(drafter.config),
        target_layer_ids=drafter.target_layer_ids,
        block_size=drafter.config.block_size,
        mask_token_id=drafter.mask_token_id,
        draft_vocab=draft_vocab,
        num_parameters=f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M",
        block_sizes=block_sizes,
        reports=reports,
        mismatches=sum(sum(r.mismatches.values()) for r in reports),
        recipe=recipe,
        train_command=train_command,
        eval_command=eval_command,
    )
