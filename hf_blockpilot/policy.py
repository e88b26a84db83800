"""BlockPilot: a small policy that picks the block size once per request from the target's prefill outputs.

The features come from the prefill forward `generate` runs anyway (no extra target forward): last-token and
mean-pooled prompt hidden states of a few target layers, the last-token logit entropy / top-2 margin, the prompt
length and the request's sampling temperature (acceptance, hence the best block size, drops as it rises).
Checkpoints are tiny safetensors files on the Hub (`PyTorchModelHubMixin`), loaded strictly.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard, ModelCardData, PyTorchModelHubMixin
from torch import nn

from ._compat import tensor_version
from .controllers import AcceptanceModel
from .costs import CostModel

CARD_TEMPLATE = Path(__file__).parent / "templates" / "policy_card.md"
NUM_SCALAR_FEATURES = 5  # entropy, top-1 probability, top-1 minus top-2 probability, log prompt length, temperature


def drafter_fingerprint(drafter: nn.Module) -> str:
    """A short hash of the drafter's context projection, stable across fp32/bf16 loading.

    Hashing copies the whole projection to the host (docs/design-measurements.md), and `generate` checks it on
    every call with a policy attached, so the hash is kept on the drafter until the weight changes (another
    tensor, or an in-place update such as a training step).
    """
    weight = drafter.fc.weight
    version = tensor_version(weight)  # None (an inference-mode tensor): hash it every time
    cached = drafter.__dict__.get("_fingerprint")
    if version is not None and cached is not None and cached[0] == version:
        return cached[1]
    data = weight.detach().to("cpu", torch.bfloat16).float().contiguous()
    digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]
    drafter.__dict__["_fingerprint"] = (version, digest)
    return digest


def default_feature_layers(target: nn.Module) -> list[int]:
    """The layers whose states the policy reads by default: the middle and the second-to-last one."""
    num_layers = target.config.get_text_config().num_hidden_layers
    return sorted({max(num_layers // 2 - 1, 0), max(num_layers - 2, 0)})


def checked_feature_layers(target: nn.Module, feature_layers: Sequence[int] | None) -> list[int]:
    """`feature_layers` (or the default) after checking each is a layer id of `target`."""
    if feature_layers is None:
        return default_feature_layers(target)
    num_layers = target.config.get_text_config().num_hidden_layers
    wrong = [i for i in feature_layers if not 0 <= i < num_layers]
    if wrong or not feature_layers:
        raise ValueError(
            f"feature layers {list(feature_layers)}: the target has {num_layers} layers, so ids 0..{num_layers - 1} "
            f"(out of range: {wrong}); leave them out for the default {default_feature_layers(target)}"
        )
    return list(feature_layers)


def prefill_features(
    outputs: Any, feature_layers: list[int], lm_head: nn.Module, temperature: float = 0.0
) -> torch.Tensor:
    """(1, D) features of one request from the target's prefill outputs (`output_hidden_states=True`).

    Per layer id i (`hidden_states[i + 1]`): the last prompt token's state and the prompt's mean state;
    then entropy, top-1 probability and top-2 margin of the last token's next-token distribution, log prompt
    length, and the sampling temperature (0 = greedy). Runs on the outputs' device; no host synchronisation.

    The distribution comes from the target's *raw* logits, recomputed by `lm_head` (the target's output
    embeddings) from the final hidden state (`hidden_states[-1]`, after the final norm): with sampling,
    `generate` overwrites `outputs.logits` with its processed logits (temperature, top-k/top-p) for fp32 targets
    but not for bf16 ones, so reading them would make the features depend on the dtype; the temperature is
    given to the policy as a feature of its own instead.
    """
    hidden_states = outputs.hidden_states
    parts = []
    for i in feature_layers:
        hidden = hidden_states[i + 1][0].float()
        parts += [hidden[-1], hidden.mean(dim=0)]
    last = hidden_states[-1][:, -1]
    logits = lm_head(last.to(lm_head.weight.dtype))[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    top2 = probs.topk(2).values
    length = math.log(hidden_states[-1].shape[1])
    entropy = -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum()  # 0 * log 0 = 0
    request = torch.tensor([length, temperature], device=logits.device)
    stats = torch.cat([torch.stack([entropy, top2[0], top2[0] - top2[1]]), request])
    return torch.cat(parts + [stats]).unsqueeze(0)


def last_token_logits(outputs: Any, lm_head: nn.Module) -> torch.Tensor:
    """(1, V) the target's raw next-token logits after the prompt, recomputed from the final hidden state (see
    `prefill_features` for why not `outputs.logits`): the input of an architecture `"last-logits-mlp"` policy."""
    last = outputs.hidden_states[-1][:, -1]
    return lm_head(last.to(lm_head.weight.dtype)).float()


class LastLogitsMLP(nn.Module):
    """The BlockPilot authors' predictor (AMAP-ML/BlockPilot `utils/predict.py`), with their parameter names:
    `layers.0` vocab -> width, `layers.1..` width -> width with a residual, ReLU after each, `fc_out` -> classes."""

    def __init__(self, vocab_size: int, width: int, depth: int, num_classes: int, dropout: float):
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(vocab_size, width)] + [nn.Linear(width, width) for _ in range(depth - 1)]
        )
        self.dropout = nn.Dropout(dropout)
        self.fc_out = nn.Linear(width, num_classes)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits
        for i, layer in enumerate(self.layers):
            y = self.dropout(torch.relu(layer(x)))
            x = y + x if i > 0 else y
        return self.fc_out(x)


ARCHITECTURES = ("prefill-mlp", "last-logits-mlp")
LABEL_CONTROLLERS = ("fixed", "adaptive")  # what verified the rounds of a policy's labels (`collect [--adaptive]`)


class BlockPilotPolicy(
    nn.Module,
    PyTorchModelHubMixin,
    library_name="hf-blockpilot",
    tags=["speculative-decoding", "dflash", "blockpilot"],
):
    """MLP over prefill features -> a distribution over candidate block sizes (1 = speculation off).

    The config records the candidates, the feature spec, the widths, and the identity of the target and
    drafter it was trained for, so attaching it elsewhere fails or warns clearly.

    `architecture`: `"prefill-mlp"` (ours: `prefill_features` of `feature_layers`, a `width`-wide MLP) or
    `"last-logits-mlp"` (the BlockPilot authors' predictor over the target's last-token logits, `depth` layers
    of `width`; `hf-blockpilot import-policy` converts their checkpoints). `dtype`: of the parameters.
    """

    def __init__(
        self,
        candidates: list[int],
        feature_layers: list[int],
        target_hidden_size: int,
        target_vocab_size: int,
        target_num_layers: int,
        width: int = 64,
        dropout: float = 0.1,
        objective: str = "throughput",
        target_name: str = "",
        drafter_name: str = "",
        drafter_fingerprint: str = "",
        training_loss: str = "",
        report: dict | None = None,
        prompt_lookup: bool = False,
        acceptance_model: dict | None = None,
        cost_model: dict | None = None,
        architecture: str = "prefill-mlp",
        depth: int = 1,
        dtype: str = "float32",
        label_controller: str = "fixed",
    ):
        super().__init__()
        if architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        if not candidates or any(not isinstance(b, int) or b < 1 for b in candidates):
            raise ValueError(f"candidates must be block sizes >= 1 (1 = speculation off), got {candidates}")
        if objective not in ("throughput", "acceptance"):
            raise ValueError(f"objective must be 'throughput' or 'acceptance', got {objective!r}")
        if label_controller not in LABEL_CONTROLLERS:
            raise ValueError(f"label_controller must be one of {LABEL_CONTROLLERS}, got {label_controller!r}")
        self.candidates = list(candidates)
        self.feature_layers = list(feature_layers)
        self.target_hidden_size = target_hidden_size
        self.target_vocab_size = target_vocab_size
        self.target_num_layers = target_num_layers
        self.objective = objective
        self.target_name = target_name
        self.drafter_name = drafter_name
        self.drafter_fingerprint = drafter_fingerprint
        self.architecture = architecture
        if architecture == "last-logits-mlp":
            if feature_layers:
                raise ValueError("a last-logits-mlp policy reads only the last-token logits: give no feature_layers")
            self.logits_mlp = LastLogitsMLP(target_vocab_size, width, depth, len(candidates), dropout)
        else:
            feature_dim = 2 * len(feature_layers) * target_hidden_size + NUM_SCALAR_FEATURES
            # LayerNorm over the hidden-state features only: the O(1) scalars (the temperature among them) would
            # vanish next to the hidden states' outlier dimensions; they join the network as they are.
            self.input_norm = nn.LayerNorm(feature_dim - NUM_SCALAR_FEATURES)
            self.net = nn.Sequential(
                nn.Linear(feature_dim, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, len(candidates))
            )
            # a linear path from the scalars to the choice: the temperature's effect is easy to learn from few prompts
            self.scalar_head = nn.Linear(NUM_SCALAR_FEATURES, len(candidates))

        self.training_loss = training_loss
        self.prompt_lookup = prompt_lookup  # labels collected with the drafter's prompt lookup on
        # how its labels' rounds were verified: "fixed" (every draft) or "adaptive" (cut by AdaptiveVerify): the
        # widths it picks are best under that controller, which is the default one it serves under
        self.label_controller = label_controller
        self.report = report  # held-out metrics (from training), kept in config.json and shown on the card
        # what an AdaptiveVerify under this policy cuts each round with, unless given its own
        self.acceptance_model = AcceptanceModel.from_dict(acceptance_model) if acceptance_model else None
        self.cost_model = CostModel.from_dict(cost_model) if cost_model else None
        self.to(getattr(torch, dtype))  # before loading, so a bf16 checkpoint stays bf16 in memory

    def attach_verify_model(self, acceptance: AcceptanceModel | None, cost: CostModel | None) -> None:
        """Store the per-round controller's acceptance model and cost model in this policy (and its config,
        so `save_pretrained` / `push_to_hub` keep them)."""
        self.acceptance_model, self.cost_model = acceptance, cost
        self._hub_mixin_config["acceptance_model"] = acceptance.to_dict() if acceptance else None
        self._hub_mixin_config["cost_model"] = cost.to_dict() if cost else None

    def generate_model_card(self, *args: Any, **kwargs: Any) -> ModelCard:
        """The Hub model card (README.md) written by `save_pretrained` / `push_to_hub`, from our template."""
        card_data = ModelCardData(library_name="hf-blockpilot", tags=["speculative-decoding", "dflash", "blockpilot"])
        return ModelCard.from_template(
            card_data,
            template_path=str(CARD_TEMPLATE),
            candidates=self.candidates,
            architecture=self.architecture,
            feature_layers=self.feature_layers,
            target_name=self.target_name,
            target_hidden_size=self.target_hidden_size,
            target_num_layers=self.target_num_layers,
            target_vocab_size=self.target_vocab_size,
            drafter_name=self.drafter_name,
            drafter_fingerprint=self.drafter_fingerprint,
            objective=self.objective,
            num_parameters=sum(p.numel() for p in self.parameters()),
            report=self.report,
            training_loss=self.training_loss,
            prompt_lookup=self.prompt_lookup,
            label_controller=self.label_controller,
            acceptance_model=self.acceptance_model.to_dict() if self.acceptance_model else None,
            cost_model=self.cost_model,
        )

    def features(self, prefill_outputs: Any, lm_head: nn.Module, temperature: float = 0.0) -> torch.Tensor:
        """(1, D) this policy's input for one request (its architecture's features of the prefill)."""
        if self.architecture == "last-logits-mlp":
            return last_token_logits(prefill_outputs, lm_head)
        return prefill_features(prefill_outputs, self.feature_layers, lm_head, temperature)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over `candidates` for (batch, D) features."""
        if self.architecture == "last-logits-mlp":
            return self.logits_mlp(features.to(self.logits_mlp.fc_out.weight.dtype))
        features = features.to(self.input_norm.weight.dtype)
        hidden, scalars = features[:, :-NUM_SCALAR_FEATURES], features[:, -NUM_SCALAR_FEATURES:]
        return self.net(torch.cat([self.input_norm(hidden), scalars], dim=-1)) + self.scalar_head(scalars)

    @torch.no_grad()
    def choose_block_size(self, prefill_outputs: Any, lm_head: nn.Module, temperature: float = 0.0) -> tuple[int, dict]:
        """The block size for this request and the policy's probability for each candidate.

        `lm_head`: the target's output embeddings; `temperature`: the request's sampling temperature, 0 = greedy.
        """
        features = self.features(prefill_outputs, lm_head, temperature).to(next(self.parameters()).device)
        probs = torch.softmax(self(features)[0].float(), dim=-1).cpu()  # one small sync per request
        if not torch.isfinite(probs).all():
            raise ValueError(
                "the BlockPilot policy got non-finite prefill features (NaN/inf in the target's hidden states or "
                "logits); check the target's dtype and inputs, or detach the policy with drafter.set_policy(None)."
            )
        chosen = self.candidates[int(probs.argmax())]
        return chosen, {b: float(p) for b, p in zip(self.candidates, probs, strict=True)}

    def check_compatible(self, target: nn.Module, drafter: nn.Module | None = None) -> None:
        """Error if the features cannot come from `target`; warn if trained for another drafter, for decoding
        with prompt lookup set otherwise than on `drafter`, or with round latencies of another kind of device."""
        text_config = target.config.get_text_config()
        problems = []
        reads_states = self.architecture == "prefill-mlp"  # the other reads only the logits
        if reads_states and text_config.hidden_size != self.target_hidden_size:
            problems.append(f"hidden size {text_config.hidden_size} != {self.target_hidden_size}")
        if reads_states and text_config.num_hidden_layers != self.target_num_layers:
            problems.append(f"{text_config.num_hidden_layers} layers != {self.target_num_layers}")
        if target.get_input_embeddings().weight.shape[0] != self.target_vocab_size:
            problems.append(f"vocab {target.get_input_embeddings().weight.shape[0]} != {self.target_vocab_size}")
        if problems:
            raise ValueError(
                f"this BlockPilot policy was trained for target {self.target_name or '?'} and cannot read this "
                f"target's prefill ({'; '.join(problems)}). Train one for it with `hf-blockpilot train-policy`, or "
                "detach it with drafter.set_policy(None)."
            )
        if (
            drafter is not None
            and self.drafter_fingerprint
            and drafter_fingerprint(drafter) != self.drafter_fingerprint
        ):
            warnings.warn(
                f"this BlockPilot policy was trained for drafter {self.drafter_name or self.drafter_fingerprint}, not "
                "the attached one: its block-size choices may be poor (output stays lossless).",
                stacklevel=3,
            )
        lookup = getattr(drafter, "prompt_lookup", self.prompt_lookup)
        if lookup != self.prompt_lookup:
            warnings.warn(
                f"this BlockPilot policy was trained on labels of decoding with prompt lookup "
                f"{'on' if self.prompt_lookup else 'off'}, but drafter.prompt_lookup is {lookup}: lookup changes which "
                "block size is fastest. Train one on labels of "
                f"`hf-blockpilot collect{' --prompt-lookup' if lookup else ''}` "
                "(output stays lossless).",
                stacklevel=3,
            )
        cost_device = (self.report or {}).get("cost_model_device", "")
        device = next(target.parameters()).device
        if cost_device and torch.device(cost_device).type != device.type:
            warnings.warn(
                f"this BlockPilot policy weighs block sizes by round latencies measured on {cost_device}, but the "
                f"target runs on {device.type}: the best block size differs between devices. Re-time them here with "
                "`hf-blockpilot measure-cost` and retrain with `train-policy --cost-model` (output stays lossless).",
                stacklevel=3,
            )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, strict: bool = True, **kwargs: Any):
        """Load from a Hub repo id or a directory; strict by default (missing or extra tensors are an error)."""
        try:
            # huggingface_hub prints "Loading weights from local directory" to stdout: keep stdout for results
            with contextlib.redirect_stdout(sys.stderr):
                return super().from_pretrained(pretrained_model_name_or_path, *args, strict=strict, **kwargs)
        except TypeError as err:  # the config lacks the policy's own fields: another kind of checkpoint
            if "required positional argument" not in str(err):
                raise
            raise ValueError(
                f"{pretrained_model_name_or_path} is not a BlockPilot policy checkpoint ({err}); pass the policy's "
                "repo id or directory, not the drafter's or the target's"
            ) from None
        except RuntimeError as err:
            if "Missing key" in str(err) or "Unexpected key" in str(err) or "Error(s) in loading" in str(err):
                raise ValueError(
                    f"{pretrained_model_name_or_path} does not hold a BlockPilot policy matching its config: {err}"
                ) from err
            raise
