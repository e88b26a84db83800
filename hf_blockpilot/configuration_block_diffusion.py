"""Configuration of the block-diffusion (DFlash) drafter.

On disk the config uses the z-lab DFlash layout unchanged (`model_type: "qwen3"`,
`architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers`,
`dflash_config: {mask_token_id, target_layer_ids}`), so checkpoints such as
`z-lab/Qwen3-4B-DFlash-b16` load without `trust_remote_code` and ours load in z-lab's code. DFlash 2
checkpoints (`architectures: ["DFlash2DraftModel"]`) add `conv_kernel_size`, `conv_group_size`,
`selector_rank` and `selector_top_k` to `dflash_config`.
"""

from __future__ import annotations

from typing import Any

from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

DFLASH_ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
DFLASH_MODEL_TYPE = "qwen3"
#: DFlash 2's convolution and candidate-selector sizes (all four, or none for a v1 drafter).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
#: The sizes of z-lab's published DFlash 2 drafters (e.g. their Qwen3.5 drafter's `dflash_config`).
DFLASH2_DEFAULT_SIZES = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
#: Fields the reference reads from `dflash_config` first, then from the top level of the config.
_NESTED_FIELDS = ("mask_token_id", "target_layer_ids", *DFLASH2_FIELDS)
#: Draft-layer kinds (`layer_types` entries) the drafter implements.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
_TOP_LEVEL_FIELDS = ("block_size", "input_embedding_scale", "output_multiplier", "final_logit_softcapping")


def _gather_dflash_fields(config_dict: dict) -> None:
    """Put each DFlash field where this config keeps it, with the reference loader's precedence
    (`dflash_config` over the top level): mask token, layer ids and DFlash 2 sizes in `dflash_config`, the rest
    at the top."""
    draft = dict(config_dict.get("dflash_config") or {})
    for name in _NESTED_FIELDS:
        top = config_dict.pop(name, None)
        if name not in draft and top is not None:
            draft[name] = top
    for name in _TOP_LEVEL_FIELDS:
        if name in draft:
            config_dict[name] = draft.pop(name)
    config_dict["dflash_config"] = draft


def build_target_layer_ids(num_target_layers: int, num_context_layers: int) -> list[int]:
    """DFlash's default choice of target layers feeding the drafter's context.

    Spreads `num_context_layers` ids evenly over `[1, num_target_layers - 3]` (one layer: the middle one).
    Id `i` is the output of target decoder layer `i`, i.e. Transformers' `hidden_states[i + 1]`.
    """
    if num_target_layers < 1 or num_context_layers < 1:
        raise ValueError(
            f"need at least one target layer and one context layer, got {num_target_layers} and {num_context_layers}"
        )
    if num_context_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, max(num_target_layers - 3, 1)
    span = end - start
    return [int(round(start + i * span / (num_context_layers - 1))) for i in range(num_context_layers)]


class BlockDiffusionConfig(Qwen3Config):
    r"""Configuration of a [`BlockDiffusionDrafter`].

    The drafter is a stack of Qwen3-style decoder layers sized like its target (same hidden size), plus:

    block_size (`int`): the block size it was trained with (and the default block size at inference).
    num_target_layers (`int`): number of decoder layers of the target it was built for.
    dflash_config (`dict`): `{"mask_token_id": int, "target_layer_ids": list[int]}` as in z-lab checkpoints;
        a DFlash 2 drafter adds `conv_kernel_size` and `conv_group_size` (the grouped dynamic causal
        convolutions around each layer's attention and MLP) and `selector_rank` and `selector_top_k` (its
        candidate selector).
    draft_vocab_size (`int`, optional): size of a reduced draft vocabulary (the drafter then scores only
        the `d2t` shortlist of target ids); `None` scores the target's full vocabulary.
    input_embedding_scale (`float`): block tokens are embedded as the target's raw embedding table times this.
    output_multiplier (`float`): draft logits are multiplied by this.
    final_logit_softcapping (`float`, optional): draft logits are soft-capped, `c * tanh(logits / c)`.

    Draft attention follows the reference: `layer_types` (full or sliding-window layers, with `sliding_window`
    and `use_sliding_window` as in Qwen3) and an optional top-level `is_causal` overriding each layer's default
    (sliding layers causal, full layers not); see `layer_attention`.

    As in the reference loader, each DFlash field may sit in `dflash_config` or at the top level
    (`dflash_config` wins); fields the package cannot honour are an error naming them.
    """

    model_type = "blockpilot_dflash"

    block_size: int = 16
    num_target_layers: int | None = None
    dflash_config: dict | None = None
    draft_vocab_size: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        # `model_type` is a class attribute; the z-lab layout stores "qwen3" in the file.
        kwargs.pop("model_type", None)
        super().__post_init__(**kwargs)
        self.dflash_config = dict(self.dflash_config or {})
        if "target_layer_ids" not in self.dflash_config and self.num_target_layers is not None:
            # z-lab's default when a checkpoint does not list its layers.
            self.dflash_config["target_layer_ids"] = build_target_layer_ids(
                self.num_target_layers, self.num_hidden_layers
            )
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 2:
            raise ValueError(f"block_size must be an int >= 2 (one anchor slot plus drafts), got {self.block_size!r}")
        self._check_attention_fields()
        unknown = sorted(set(self.dflash_config) - set(_NESTED_FIELDS))
        if unknown:
            raise ValueError(
                f"this drafter's dflash_config has fields hf-blockpilot does not know: {unknown} (known: "
                f"{list(_NESTED_FIELDS) + list(_TOP_LEVEL_FIELDS)}); ignoring them could draft differently from the "
                "checkpoint's reference implementation"
            )
        self._check_dflash2_fields()

    def _check_attention_fields(self) -> None:
        """Per-layer attention the drafter implements: full or sliding-window layers, causal or not."""
        is_causal = getattr(self, "is_causal", None)
        if is_causal is not None and not isinstance(is_causal, bool):
            raise ValueError(f"is_causal must be true, false or absent (per-layer default), got {is_causal!r}")
        layer_types = list(self.layer_types or [])
        unknown = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"this drafter's layer_types lists {unknown}, which hf-blockpilot does not implement for draft layers "
                f"(known: {list(ATTENTION_LAYER_TYPES)}): it would draft differently from the checkpoint's reference"
            )
        if "sliding_attention" not in layer_types:
            return
        window = self.sliding_window  # None (no window, or use_sliding_window=false): causal layers, as the reference
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"sliding_window must be an int >= 1 (tokens a query sees), got {window!r}")

    def layer_attention(self, layer_idx: int) -> tuple[bool, int | None]:
        """`(is_causal, sliding_window)` of draft layer `layer_idx`, as the reference reads them: a sliding layer
        is causal unless a top-level `is_causal` says otherwise, a full layer non-causal unless it says so."""
        layer_type = self.layer_types[layer_idx] if self.layer_types else "full_attention"
        sliding = layer_type == "sliding_attention"
        is_causal = getattr(self, "is_causal", None)
        return (sliding if is_causal is None else is_causal), (self.sliding_window if sliding else None)

    def has_masked_layers(self) -> bool:
        """Whether any draft layer is causal or windowed (`layer_attention`), unlike the full, non-causal layers of
        z-lab's DFlash drafters that training and batched decoding implement."""
        return any(self.layer_attention(i) != (False, None) for i in range(self.num_hidden_layers))

    def _check_dflash2_fields(self) -> None:
        given = [name for name in DFLASH2_FIELDS if self.dflash_config.get(name) is not None]
        if not given:
            return
        missing = [name for name in DFLASH2_FIELDS if name not in given]
        if missing:
            raise ValueError(f"a DFlash 2 drafter config needs all of {list(DFLASH2_FIELDS)}; missing {missing}")
        sizes = {name: self.dflash_config[name] for name in DFLASH2_FIELDS}
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in sizes.values()):
            raise ValueError(f"the DFlash 2 sizes must be positive ints, got {sizes}")
        if self.hidden_size % sizes["conv_group_size"]:
            raise ValueError(f"conv_group_size={sizes['conv_group_size']} must divide hidden_size={self.hidden_size}")
        if sizes["selector_top_k"] > self.vocab_size:
            raise ValueError(f"selector_top_k={sizes['selector_top_k']} exceeds the vocabulary ({self.vocab_size})")
        if self.draft_vocab_size is not None:
            raise ValueError(
                "a DFlash 2 drafter selects among the full vocabulary's top candidates: drop draft_vocab_size"
            )

    @property
    def is_dflash2(self) -> bool:
        """A DFlash 2 drafter: convolutions around attention and MLP, and a candidate selector."""
        return self.dflash_config.get("conv_kernel_size") is not None

    def dflash2_size(self, name: str) -> int:
        """One of `DFLASH2_FIELDS` (a DFlash 2 config only)."""
        return int(self.dflash_config[name])

    @property
    def mask_token_id(self) -> int | None:
        """Target token id used to fill the block's draft slots."""
        return self.dflash_config.get("mask_token_id")

    @property
    def target_layer_ids(self) -> list[int]:
        """Target decoder layers whose outputs form the drafter's context (id i = `hidden_states[i + 1]`)."""
        ids = self.dflash_config.get("target_layer_ids")
        if not ids:
            raise ValueError("the drafter config lists no `dflash_config.target_layer_ids`")
        return list(ids)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> tuple[dict, dict]:
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        architectures = config_dict.get("architectures") or []
        if DFLASH_ARCHITECTURE in architectures or DFLASH2_ARCHITECTURE in architectures:
            config_dict["model_type"] = cls.model_type
            _gather_dflash_fields(config_dict)
            declared_v2 = DFLASH2_ARCHITECTURE in architectures
            has_v2_fields = any(config_dict["dflash_config"].get(name) is not None for name in DFLASH2_FIELDS)
            if declared_v2 != has_v2_fields:
                raise ValueError(
                    f"{pretrained_model_name_or_path}: architectures={architectures} but the config "
                    f"{'lacks' if declared_v2 else 'has'} DFlash 2 fields {list(DFLASH2_FIELDS)}: the checkpoint is "
                    "inconsistent (a DFlash 2 drafter declares DFlash2DraftModel and all four sizes)"
                )
        elif config_dict.get("model_type") not in (cls.model_type, None):
            raise ValueError(
                f"{pretrained_model_name_or_path} is not a DFlash drafter checkpoint: its config has "
                f"model_type={config_dict.get('model_type')!r} and architectures={config_dict.get('architectures')}, "
                f"expected architectures=['{DFLASH_ARCHITECTURE}']. Pass the drafter's repo id or directory, "
                "not the target's."
            )
        elif not config_dict:  # a local directory without config.json reads as an empty config
            raise FileNotFoundError(
                f"{pretrained_model_name_or_path} has no config.json: pass the drafter's repo id or the directory "
                "that holds its config.json and weights"
            )
        elif "dflash_config" not in config_dict:
            hint = (
                " (it holds a BlockPilot policy: load it with BlockPilotPolicy.from_pretrained)"
                if "candidates" in config_dict
                else ""
            )
            raise ValueError(
                f"{pretrained_model_name_or_path} is not a DFlash drafter checkpoint: its config has no "
                f"`dflash_config`{hint}. Pass the drafter's repo id or directory."
            )
        return config_dict, kwargs

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output["model_type"] = DFLASH_MODEL_TYPE
        output["architectures"] = [DFLASH2_ARCHITECTURE if self.is_dflash2 else DFLASH_ARCHITECTURE]
        output.pop("auto_map", None)
        # Readers on Transformers 4.x (z-lab's code, older vLLM/SGLang) take RoPE's base from `rope_theta`.
        rope = output.get("rope_parameters") or {}
        if "rope_theta" in rope:
            output["rope_theta"] = rope["rope_theta"]
        return output
