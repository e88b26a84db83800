"""BlockPilot: a small policy that picks the block size once per request from the target's prefill outputs.

The features come from the prefill forward `generate` runs anyway (no extra target forward): last-token and
mean-pooled prompt hidden states of a few target layers, the last-token logit entropy / top-2 margin, the prompt
length and the request's sampling temperature (acceptance, hence the best block size, drops as it rises).

A policy trained with the objective `"tau"` predicts the acceptance length τ(b) of each candidate width, which
depends on the prompt, the target and the drafter but not on the machine; the width is then chosen per request
as the most expected committed tokens per ms under the *local* cost model (this machine's calibration), so one
checkpoint picks wide blocks where a wide verify is cheap (a GPU, AMX in bf16) and narrow ones where it is not.

One class per architecture (`PrefillMLPPolicy`, `LastLogitsMLPPolicy`) over the shared `BlockPilotPolicy`, whose
`from_pretrained` loads either by the checkpoint's config. Checkpoints are tiny safetensors files on the Hub
(`PyTorchModelHubMixin`), loaded strictly.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import safetensors.torch
import torch
from huggingface_hub import ModelCard, ModelCardData, PyTorchModelHubMixin, hf_hub_download
from torch import nn

from ._compat import tensor_version
from .controllers import AcceptanceModel
from .costs import MIN_PREDICTED_GAIN, CostModel

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


def last_logits(outputs: Any, lm_head: nn.Module) -> torch.Tensor:
    """(1, V) the raw next-token logits after the prompt: the prefill outputs' own (`logits`), or for outputs that
    carry only hidden states, recomputed by `lm_head` (the target's output embeddings) from the final one (after
    the final norm). Reading the prefill's saves a vocabulary-wide product per request."""
    logits = getattr(outputs, "logits", None)
    if logits is not None:
        return logits[:, -1]
    last = outputs.hidden_states[-1][:, -1]
    return lm_head(last.to(lm_head.weight.dtype))


def prefill_features(
    outputs: Any, feature_layers: list[int], lm_head: nn.Module, temperature: float = 0.0
) -> torch.Tensor:
    """(1, D) features of one request from the target's prefill outputs (`output_hidden_states=True`).

    Per layer id i (`hidden_states[i + 1]`): the last prompt token's state and the prompt's mean state;
    then entropy, top-1 probability and top-2 margin of the last token's next-token distribution, log prompt
    length, and the sampling temperature (0 = greedy). Runs on the outputs' device; no host synchronisation.

    The distribution comes from the target's *raw* logits (`last_logits`): the decoding loop hands the policy
    the prefill's own, before any logits processor (temperature, top-k/top-p) sees them, so the features do not
    depend on the sampling settings; the temperature is given to the policy as a feature of its own instead.
    """
    hidden_states = outputs.hidden_states
    parts = []
    for i in feature_layers:
        hidden = hidden_states[i + 1][0].float()
        parts += [hidden[-1], hidden.mean(dim=0)]
    logits = last_logits(outputs, lm_head)[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    top2 = probs.topk(2).values
    length = math.log(hidden_states[feature_layers[0] + 1].shape[1])
    entropy = -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum()  # 0 * log 0 = 0
    request = torch.tensor([length, temperature], device=logits.device)
    stats = torch.cat([torch.stack([entropy, top2[0], top2[0] - top2[1]]), request])
    return torch.cat(parts + [stats]).unsqueeze(0)


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


#: What a policy's head outputs, per candidate block size (the config field `objective`):
#: `"tau"`: the expected acceptance length τ(b) with every draft verified, learnt from hardware-free labels; the
#: width is chosen per request as the best expected committed tokens per ms under the *local* cost model.
#: `"throughput"` / `"acceptance"`: a distribution over the candidates, trained to put the most mass on the fastest
#: width on the machine the labels were priced on / on the width of the longest τ (checkpoints before the τ head).
OBJECTIVES = ("tau", "throughput", "acceptance")


def margin_for(tau_error: float | None) -> float:
    """The predicted gain over plain decoding a τ policy needs before it drafts: its held-out relative τ error,
    at least `MIN_PREDICTED_GAIN`."""
    return max(MIN_PREDICTED_GAIN, float(tau_error or 0.0))


#: How a τ policy's head outputs become τ(b): `"per_width"`, one output per candidate (made consistent afterwards,
#: `consistent_tau`); `"per_slot"`, one conditional acceptance per draft slot 1..max(b)-1, whose running products
#: sum to τ(b) (consistent and monotone in b by construction; every width's label trains the shared slots).
TAU_HEADS = ("per_width", "per_slot")
LABEL_CONTROLLERS = ("fixed", "adaptive")  # what verified the rounds of a policy's labels (`collect [--adaptive]`)
DTYPES = ("float32", "bfloat16", "float16")
#: Config keys of checkpoints written when one class served both architectures; ignored where a class has no use.
_LEGACY_KEYS = {"feature_layers", "target_hidden_size", "target_num_layers", "depth"}


class BlockPilotPolicy(
    nn.Module,
    PyTorchModelHubMixin,
    library_name="hf-blockpilot",
    tags=["speculative-decoding", "dflash", "blockpilot"],
):
    """The shared base of BlockPilot policies: a small network over prefill features that picks the block size
    of a request (1 = speculation off). One subclass per architecture (`PrefillMLPPolicy`, `LastLogitsMLPPolicy`);
    `BlockPilotPolicy.from_pretrained` loads either, by the `architecture` in the checkpoint's config.

    Fields every architecture shares: `candidates` (block sizes), `target_vocab_size`, `objective` (see
    `OBJECTIVES`), the identity of the target and drafter it was trained for (so attaching it elsewhere fails or
    warns clearly), `training_loss` and `report` (shown on the card), `prompt_lookup` and `label_controller` (how
    its labels were decoded), the per-round controller's `acceptance_model` and `cost_model` (dicts), the
    parameters' `dtype` and a τ policy's `tau_head` (see `TAU_HEADS`); `architecture`, if given, must be the
    class's own (so a saved config round-trips).
    """

    architecture: ClassVar[str] = ""

    def __init__(
        self,
        candidates: list[int],
        target_vocab_size: int,
        objective: str = "throughput",
        target_name: str = "",
        drafter_name: str = "",
        drafter_fingerprint: str = "",
        training_loss: str = "",
        report: dict | None = None,
        prompt_lookup: bool = False,
        acceptance_model: dict | None = None,
        cost_model: dict | None = None,
        dtype: str = "float32",
        label_controller: str = "fixed",
        tau_head: str = "per_width",
        architecture: str | None = None,
    ):
        given = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        if not type(self).architecture:
            raise TypeError(
                "BlockPilotPolicy is the shared base of the policy architectures: construct "
                f"{' or '.join(c.__name__ for c in POLICY_CLASSES.values())}, or load a checkpoint of either with "
                "BlockPilotPolicy.from_pretrained"
            )
        if architecture not in (None, type(self).architecture):
            raise ValueError(
                f"architecture {architecture!r} is {POLICY_CLASSES[architecture].__name__}'s, not "
                f"{type(self).__name__}'s"
                if architecture in POLICY_CLASSES
                else f"architecture must be one of {sorted(POLICY_CLASSES)}, got {architecture!r}"
            )
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if not candidates or any(not isinstance(b, int) or b < 1 for b in candidates):
            raise ValueError(f"candidates must be block sizes >= 1 (1 = speculation off), got {candidates}")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if tau_head not in TAU_HEADS:
            raise ValueError(f"tau_head must be one of {TAU_HEADS}, got {tau_head!r}")
        if tau_head == "per_slot" and objective != "tau":
            raise ValueError(f"a per-slot head predicts acceptance: it needs objective 'tau', not {objective!r}")
        if label_controller not in LABEL_CONTROLLERS:
            raise ValueError(f"label_controller must be one of {LABEL_CONTROLLERS}, got {label_controller!r}")
        self.candidates = list(candidates)
        self.target_vocab_size = target_vocab_size
        self.objective = objective
        self.target_name = target_name
        self.drafter_name = drafter_name
        self.drafter_fingerprint = drafter_fingerprint
        self.training_loss = training_loss
        self.prompt_lookup = prompt_lookup  # labels collected with the drafter's prompt lookup on
        # how its labels' rounds were verified: "fixed" (every draft) or "adaptive" (cut by AdaptiveVerify)
        self.label_controller = label_controller
        self.tau_head = tau_head
        # the head's width: one output per draft slot, or one per candidate (τ or class logits)
        self.num_outputs = max(candidates) - 1 if tau_head == "per_slot" else len(candidates)
        self.report = report  # held-out metrics (from training), kept in config.json and shown on the card
        # what an AdaptiveVerify under this policy cuts each round with, unless given its own
        self.acceptance_model = AcceptanceModel.from_dict(acceptance_model) if acceptance_model else None
        self.cost_model = CostModel.from_dict(cost_model) if cost_model else None
        self.parameter_dtype = getattr(torch, dtype)
        # the whole config, defaults included (the Hub mixin records only the subclass's own defaults), and the
        # architecture `from_pretrained` dispatches on
        self._hub_mixin_config.update(given, candidates=self.candidates, architecture=self.architecture)

    @property
    def weighs_costs(self) -> bool:
        """Whether the choice weighs predicted acceptance against the local cost model (objective `"tau"`); the
        classifying objectives carry the costs of the machine their labels were priced on in their weights."""
        return self.objective == "tau"

    @property
    def serving_controller(self) -> str:
        """What verifies its widths' drafts by default (`controllers.default_controller`): as its labels' rounds
        were verified, `"adaptive"` (`AdaptiveVerify`) for `collect --adaptive` labels, else `"fixed"` (every draft
        verified: what a τ policy's prices assume)."""
        return "adaptive" if self.label_controller == "adaptive" else "fixed"

    def attach_verify_model(self, acceptance: AcceptanceModel | None, cost: CostModel | None) -> None:
        """Store the per-round controller's acceptance model and cost model in this policy (and its config,
        so `save_pretrained` / `push_to_hub` keep them)."""
        self.acceptance_model, self.cost_model = acceptance, cost
        self._hub_mixin_config["acceptance_model"] = acceptance.to_dict() if acceptance else None
        self._hub_mixin_config["cost_model"] = cost.to_dict() if cost else None

    def generate_model_card(self, *args: Any, **kwargs: Any) -> ModelCard:
        """The Hub model card (README.md) written by `save_pretrained` / `push_to_hub`, from our template."""
        card_data = ModelCardData(library_name="hf-blockpilot", tags=["speculative-decoding", "dflash", "blockpilot"])
        fields = {  # the config (a subclass's fields too), and what the card shows beyond it
            **self._hub_mixin_config,
            "num_parameters": sum(p.numel() for p in self.parameters()),
            "serving_controller": self.serving_controller,
            "cost_model": self.cost_model,
        }
        return ModelCard.from_template(card_data, template_path=str(CARD_TEMPLATE), **fields)

    def features(self, prefill_outputs: Any, lm_head: nn.Module, temperature: float = 0.0) -> torch.Tensor:
        """(1, D) this policy's input for one request (its architecture's features of the prefill)."""
        raise NotImplementedError

    def predicted_tau(self, outputs: torch.Tensor) -> torch.Tensor:
        """(..., k) τ(b) per candidate from a τ head's outputs, 1 <= τ(b) <= b (a round of b slots commits at most
        b - 1 drafts and a bonus; b = 1 is exactly one token). Per width: 1 + (b - 1) σ(output). Per slot: σ(output
        j) is the chance slot j is accepted after slots 1..j-1 were, and τ(b) = 1 + Σ_{j<b} Π_{i<=j} σ(output i)."""
        widths = torch.tensor(self.candidates, device=outputs.device)
        if self.tau_head == "per_width":
            return 1.0 + (widths - 1.0) * torch.sigmoid(outputs.float())
        reached = torch.sigmoid(outputs.float()).cumprod(dim=-1)  # P(slots 1..j all accepted)
        tau = 1.0 + torch.cat([torch.zeros_like(reached[..., :1]), reached], dim=-1).cumsum(dim=-1)
        return tau[..., widths - 1]

    def consistent_tau(self, tau: torch.Tensor) -> torch.Tensor:
        """(..., k) predicted τ(b) made consistent with how rounds commit: each extra slot adds the chance that
        every draft up to it is accepted, so τ never falls as b grows and its gain per slot never grows (nor
        exceeds 1). Each candidate keeps its own prediction where that is consistent with the narrower ones,
        else the nearest consistent value (a τ head trained per width can predict τ(4) far above what its τ(2)
        allows)."""
        out = tau.clone()
        previous_width, previous = 1, torch.ones_like(tau[..., 0])
        slope = torch.ones_like(previous)  # the gain per slot of the last gap; at most 1
        for j in sorted(range(len(self.candidates)), key=lambda i: self.candidates[i]):
            width = self.candidates[j]
            if width == 1:
                out[..., j] = 1.0
                continue
            gap = width - previous_width
            gain = torch.minimum((tau[..., j] - previous).clamp(min=0.0), slope * gap)
            out[..., j] = previous + gain
            slope, previous_width, previous = gain / gap, width, out[..., j]
        return out

    def drafting_margin(self) -> float:
        """How much faster than plain decoding a width must be predicted before it is drafted
        (`margin_for` this policy's held-out `report.tau_error`, from training)."""
        return margin_for(self.report.get("tau_error") if isinstance(self.report, dict) else None)

    def priced_choice(self, tau: torch.Tensor, round_ms: torch.Tensor, margin: float | None = None) -> torch.Tensor:
        """(...,) index of the candidate with the most expected tokens per ms, τ(b) / round latency, given (..., k)
        predicted τ and round latencies; plain decoding (b = 1) unless a width beats it by `margin` (default:
        `drafting_margin()`)."""
        rate = tau / round_ms
        if 1 in self.candidates:  # draft only where clearly faster than plain decoding
            rate = rate.clone()
            rate[..., self.candidates.index(1)] *= 1.0 + (self.drafting_margin() if margin is None else margin)
        return rate.argmax(dim=-1)

    @torch.no_grad()
    def choose_block_size(
        self, prefill_outputs: Any, lm_head: nn.Module, temperature: float = 0.0, cost_model: CostModel | None = None
    ) -> tuple[int, dict]:
        """The block size for this request, and per candidate the policy's probability (classifying objectives)
        or its predicted τ(b) (objective `"tau"`).

        `lm_head`: the target's output embeddings; `temperature`: the request's sampling temperature, 0 = greedy;
        `cost_model`: this machine's costs, which a τ-predicting policy weighs its prediction (made consistent,
        `consistent_tau`) against (default: the shipped fallback for the device): the width with the most
        expected committed tokens per ms, plain decoding unless a width is predicted `drafting_margin()` faster.
        """
        features = self.features(prefill_outputs, lm_head, temperature).to(next(self.parameters()).device)
        outputs = self(features)[0].float()
        scores = (
            self.consistent_tau(self.predicted_tau(outputs)) if self.weighs_costs else torch.softmax(outputs, dim=-1)
        )
        scores = scores.cpu()  # one small sync per request
        if not torch.isfinite(scores).all():
            raise ValueError(
                "the BlockPilot policy got non-finite prefill features (NaN/inf in the target's hidden states or "
                "logits); check the target's dtype and inputs, or detach the policy with drafter.set_policy(None)."
            )
        if self.weighs_costs:
            cost = cost_model or CostModel.default_for(features.device)
            ms = torch.tensor([cost.round_ms(b, temperature) for b in self.candidates])
            chosen = self.candidates[int(self.priced_choice(scores, ms))]
        else:
            chosen = self.candidates[int(scores.argmax())]
        return chosen, {b: float(s) for b, s in zip(self.candidates, scores, strict=True)}

    def _shape_problems(self, target: nn.Module) -> list[str]:
        """Where `target` cannot give this policy its features (empty: it can)."""
        vocab = target.get_input_embeddings().weight.shape[0]
        return [f"vocab {vocab} != {self.target_vocab_size}"] if vocab != self.target_vocab_size else []

    def check_compatible(self, target: nn.Module, drafter: nn.Module | None = None) -> None:
        """Error if the features cannot come from `target`; warn if trained for another drafter, for decoding
        with prompt lookup set otherwise than on `drafter`, or (a classifying policy) with round latencies of
        another kind of device."""
        problems = self._shape_problems(target)
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
        if not self.weighs_costs and cost_device and torch.device(cost_device).type != device.type:
            warnings.warn(
                f"this BlockPilot policy weighs block sizes by round latencies measured on {cost_device}, but the "
                f"target runs on {device.type}: the best block size differs between devices. Train a τ-predicting "
                "one (`train-policy --objective tau`), which weighs this machine's costs (output stays lossless).",
                stacklevel=3,
            )

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | Path,
        *,
        strict: bool = True,
        revision: str | None = None,
        cache_dir: str | Path | None = None,
        force_download: bool = False,
        local_files_only: bool = False,
        token: str | bool | None = None,
        map_location: str = "cpu",
    ) -> BlockPilotPolicy:
        """Load from a Hub repo id or a directory: the class named by the config's `architecture` (checkpoints
        written before it was recorded are `"prefill-mlp"`), strict by default (missing or extra tensors, or
        tensors of other shapes, are an error naming them)."""
        source = str(pretrained_model_name_or_path)

        def fetch(filename: str) -> Path:
            if Path(source).is_dir():
                path = Path(source) / filename
                if not path.is_file():
                    raise ValueError(f"{source} is not a BlockPilot policy checkpoint: it has no {filename}")
                return path
            return Path(
                hf_hub_download(
                    source,
                    filename,
                    revision=revision,
                    cache_dir=cache_dir,
                    force_download=force_download,
                    local_files_only=local_files_only,
                    token=token,
                )
            )

        config = json.loads(fetch("config.json").read_text())
        architecture = config.get("architecture", "prefill-mlp")
        if "candidates" not in config or architecture not in POLICY_CLASSES:
            has = "no 'candidates'" if "candidates" not in config else f"architecture {architecture!r}"
            raise ValueError(
                f"{source} is not a BlockPilot policy checkpoint (its config has {has}); pass the policy's repo id "
                "or directory, not the drafter's or the target's"
            )
        policy_class = POLICY_CLASSES[architecture]
        if not issubclass(policy_class, cls):
            raise ValueError(f"{source} holds a {policy_class.__name__} ({architecture}), not a {cls.__name__}")
        parameters = inspect.signature(policy_class.__init__).parameters
        missing = [n for n, p in parameters.items() if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
        missing = [n for n in missing if n != "self" and n not in config]
        if missing:
            raise ValueError(f"{source} is not a BlockPilot policy checkpoint: its config lacks {missing}")
        known = set(parameters) | set(inspect.signature(BlockPilotPolicy.__init__).parameters)
        unknown = set(config) - known - _LEGACY_KEYS
        if unknown:
            raise ValueError(
                f"{source}: config fields {sorted(unknown)} are not {policy_class.__name__}'s; it was written by "
                "another hf-blockpilot version (upgrade the package)"
            )
        policy = policy_class(**{k: v for k, v in config.items() if k in known})
        state = safetensors.torch.load_file(fetch("model.safetensors"), device=map_location)
        expected = policy.state_dict()
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        problems = [f"missing {missing}"] * bool(strict and missing) + [f"unexpected {unexpected}"] * bool(
            strict and unexpected
        )
        problems += [
            f"{name}: {tuple(state[name].shape)} in the file, {tuple(t.shape)} for its config"
            for name, t in expected.items()
            if name in state and state[name].shape != t.shape
        ]
        if problems:
            raise ValueError(f"{source} does not hold a BlockPilot policy matching its config: {'; '.join(problems)}")
        policy.load_state_dict(state, strict=strict)
        return policy.eval()


class PrefillMLPPolicy(BlockPilotPolicy):
    """Ours: an MLP over `prefill_features` of `feature_layers` (a LayerNorm over the hidden-state features, a
    `width`-wide GELU layer) plus a linear path from the scalar features; one output per candidate or draft slot
    (`tau_head`)."""

    architecture = "prefill-mlp"

    def __init__(
        self,
        candidates: list[int],
        feature_layers: list[int],
        target_hidden_size: int,
        target_vocab_size: int,
        target_num_layers: int,
        width: int = 64,
        dropout: float = 0.1,
        **common: Any,
    ):
        """`common`: the fields every policy has (see `BlockPilotPolicy`)."""
        super().__init__(candidates, target_vocab_size, **common)
        self.feature_layers = list(feature_layers)
        self.target_hidden_size = target_hidden_size
        self.target_num_layers = target_num_layers
        feature_dim = 2 * len(feature_layers) * target_hidden_size + NUM_SCALAR_FEATURES
        # LayerNorm over the hidden-state features only: the O(1) scalars (the temperature among them) would
        # vanish next to the hidden states' outlier dimensions; they join the network as they are.
        self.input_norm = nn.LayerNorm(feature_dim - NUM_SCALAR_FEATURES)
        self.net = nn.Sequential(
            nn.Linear(feature_dim, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, self.num_outputs)
        )
        # a linear path from the scalars to the choice: the temperature's effect is easy to learn from few prompts
        self.scalar_head = nn.Linear(NUM_SCALAR_FEATURES, self.num_outputs)
        self.to(self.parameter_dtype)  # before loading, so a bf16 checkpoint stays bf16 in memory

    def features(self, prefill_outputs: Any, lm_head: nn.Module, temperature: float = 0.0) -> torch.Tensor:
        return prefill_features(prefill_outputs, self.feature_layers, lm_head, temperature)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Outputs per candidate for (batch, D) features: logits, or τ head outputs (see `predicted_tau`)."""
        features = features.to(self.input_norm.weight.dtype)
        hidden, scalars = features[:, :-NUM_SCALAR_FEATURES], features[:, -NUM_SCALAR_FEATURES:]
        return self.net(torch.cat([self.input_norm(hidden), scalars], dim=-1)) + self.scalar_head(scalars)

    def _shape_problems(self, target: nn.Module) -> list[str]:
        text_config = target.config.get_text_config()
        problems = super()._shape_problems(target)
        if text_config.hidden_size != self.target_hidden_size:
            problems.append(f"hidden size {text_config.hidden_size} != {self.target_hidden_size}")
        if text_config.num_hidden_layers != self.target_num_layers:
            problems.append(f"{text_config.num_hidden_layers} layers != {self.target_num_layers}")
        return problems


class LastLogitsMLPPolicy(BlockPilotPolicy):
    """The BlockPilot authors' predictor over the target's raw last-token logits (`LastLogitsMLP`, `depth` layers
    of `width`); `hf-blockpilot import-policy` converts their checkpoints. It does not read the temperature."""

    architecture = "last-logits-mlp"

    def __init__(
        self,
        candidates: list[int],
        target_vocab_size: int,
        width: int = 64,
        depth: int = 1,
        dropout: float = 0.1,
        **common: Any,
    ):
        """`common`: the fields every policy has (see `BlockPilotPolicy`)."""
        super().__init__(candidates, target_vocab_size, **common)
        self.feature_layers: list[int] = []  # no layer's states: only the final one, for the logits
        self.logits_mlp = LastLogitsMLP(target_vocab_size, width, depth, self.num_outputs, dropout)
        self.to(self.parameter_dtype)

    def features(self, prefill_outputs: Any, lm_head: nn.Module, temperature: float = 0.0) -> torch.Tensor:
        """(1, V) the target's raw next-token logits after the prompt (`last_logits`)."""
        return last_logits(prefill_outputs, lm_head).float()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Outputs per candidate for (batch, V) last-token logits."""
        return self.logits_mlp(features.to(self.logits_mlp.fc_out.weight.dtype))


#: The policy class of each `architecture` a checkpoint's config may name.
POLICY_CLASSES: dict[str, type[BlockPilotPolicy]] = {c.architecture: c for c in (PrefillMLPPolicy, LastLogitsMLPPolicy)}
