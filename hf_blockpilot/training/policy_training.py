"""BlockPilot policy training: a measured cost model, cost-aware objectives, regret or cross-entropy loss."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..controllers import AcceptanceModel
from ..costs import CostModel
from ..modeling_block_diffusion import BlockDiffusionDrafter
from ..policy import BlockPilotPolicy
from .calibration import fit_acceptance_model
from .oracle import OracleRecord


def objective_values(
    record: OracleRecord, candidates: Sequence[int], objective: str, cost: CostModel | None
) -> list[float]:
    """Per candidate: τ(b) (`acceptance`) or modeled tokens per second (`throughput`): from the record's
    modeled decoding times when it has them (collected with a cost model; the only way for labels collected
    under the adaptive controller, whose rounds differ in cost), else τ(b) / round latency."""
    if objective == "acceptance":
        return [record.tau[b] for b in candidates]
    if record.ms and all(record.ms.get(b, 0) > 0 for b in candidates):
        return [1000.0 * record.new_tokens / record.ms[b] for b in candidates]
    if cost is None:
        raise ValueError("the `throughput` objective needs a cost model (hf-blockpilot collect measures one)")
    return [1000.0 * record.tau[b] / cost.round_ms(b, record.temperature) for b in candidates]


@dataclass
class PolicyTrainingConfig:
    loss: str = "regret"  # "regret" (expected regret) or "ce" (cross-entropy to the oracle b, smoothed)
    objective: str = "throughput"
    label_smoothing: float = 0.1
    epochs: int = 300
    learning_rate: float = 3e-3
    weight_decay: float = 1e-2
    validation_fraction: float = 0.2  # of the prompts for the test split, then of the rest for validation
    patience: int = 40
    seed: int = 0
    width: int = 64
    dropout: float = 0.1


@dataclass
class PolicyReport:
    """Held-out metrics: accuracy vs the oracle b, regret, modeled speed against fixed b and the oracle."""

    accuracy: float
    regret: float
    policy_value: float
    best_fixed_b: int
    best_fixed_value: float
    oracle_value: float
    chosen: dict[int, int] = field(default_factory=dict)
    oracle_counts: dict[int, int] = field(default_factory=dict)
    objective: str = "throughput"
    validation_prompts: int = 0
    by_temperature: dict[str, dict] = field(default_factory=dict)  # the same metrics per label temperature
    cost_model_device: str = ""  # where the throughput objective's round latencies were measured


def split_by_prompt(records: Sequence[OracleRecord], fraction: float, seed: int) -> tuple[list, list]:
    """Deterministic train/validation split by prompt: a prompt's records (one per temperature) stay together."""
    ids = sorted({r.id for r in records})
    random.Random(seed).shuffle(ids)
    held = set(ids[: max(1, int(round(len(ids) * fraction)))])
    return [r for r in records if r.id not in held], [r for r in records if r.id in held]


def evaluate_choices(
    values: torch.Tensor, chosen: torch.Tensor, candidates: Sequence[int], objective: str
) -> PolicyReport:
    """Report for choices `chosen` (indices) on prompts whose per-candidate objective is `values` (n, k)."""
    oracle = values.argmax(dim=1)
    best_fixed = int(values.mean(dim=0).argmax())
    rows = torch.arange(values.shape[0])
    return PolicyReport(
        accuracy=float((chosen == oracle).float().mean()),
        regret=float((values[rows, oracle] - values[rows, chosen]).mean()),
        policy_value=float(values[rows, chosen].mean()),
        best_fixed_b=candidates[best_fixed],
        best_fixed_value=float(values[:, best_fixed].mean()),
        oracle_value=float(values[rows, oracle].mean()),
        chosen={b: int((chosen == i).sum()) for i, b in enumerate(candidates)},
        oracle_counts={b: int((oracle == i).sum()) for i, b in enumerate(candidates)},
        objective=objective,
        validation_prompts=values.shape[0],
    )


def train_policy(
    records: Sequence[OracleRecord],
    candidates: Sequence[int],
    feature_layers: Sequence[int],
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    config: PolicyTrainingConfig,
    cost: CostModel | None = None,
    prompt_lookup: bool = False,
    acceptance: AcceptanceModel | None = None,
) -> tuple[BlockPilotPolicy, PolicyReport]:
    """Fit a `BlockPilotPolicy` on oracle records: early stopping on validation regret, metrics on a test split
    of prompts it never saw. `prompt_lookup`: the records label decoding with prompt lookup on (recorded in the
    policy). Records of decoding under `AdaptiveVerify` (`collect --adaptive`) make a policy that serves under it
    by default; fixed and adaptive records cannot be mixed. The per-round controller's acceptance model
    (`acceptance`, else fitted on the records' recorded rounds, when they have any) and `cost` are stored in the
    policy. Returns the policy and that report."""
    from ..policy import drafter_fingerprint

    label_controllers = {r.controller for r in records}
    if len(label_controllers) > 1:
        raise ValueError(
            "these labels mix rounds verified in full (`collect`) and cut by the per-round controller "
            "(`collect --adaptive`): their best widths differ; train on one kind"
        )
    torch.manual_seed(config.seed)
    # train / validation (early stopping) / test (the reported metrics), split by prompt
    rest, test = split_by_prompt(records, config.validation_fraction, config.seed)
    train, val = split_by_prompt(rest, config.validation_fraction, config.seed + 1)

    def tensors(rows):
        x = torch.tensor([r.features for r in rows], dtype=torch.float32)
        v = torch.tensor([objective_values(r, candidates, config.objective, cost) for r in rows])
        return x, v

    x_train, v_train = tensors(train)
    x_val, v_val = tensors(val)
    x_test, v_test = tensors(test)
    text_config = target.config.get_text_config()
    policy = BlockPilotPolicy(
        candidates=list(candidates),
        feature_layers=list(feature_layers),
        target_hidden_size=text_config.hidden_size,
        target_vocab_size=target.get_input_embeddings().weight.shape[0],
        target_num_layers=text_config.num_hidden_layers,
        width=config.width,
        dropout=config.dropout,
        objective=config.objective,
        target_name=getattr(target.config, "_name_or_path", ""),
        drafter_name=getattr(drafter.config, "_name_or_path", ""),
        drafter_fingerprint=drafter_fingerprint(drafter),
        training_loss=config.loss,
        prompt_lookup=prompt_lookup,
        label_controller=label_controllers.pop() if label_controllers else "fixed",
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    # per-prompt regret of each candidate, relative to the prompt's best (scale-free across prompts)
    regret_train = (v_train.max(dim=1, keepdim=True).values - v_train) / v_train.max(dim=1, keepdim=True).values
    best_state, best_regret, stale = None, float("inf"), 0
    for _ in range(config.epochs):
        policy.train()
        logits = policy(x_train)
        if config.loss == "regret":
            loss = (logits.softmax(dim=1) * regret_train).sum(dim=1).mean()
        elif config.loss == "ce":
            loss = F.cross_entropy(logits, v_train.argmax(dim=1), label_smoothing=config.label_smoothing)
        else:
            raise ValueError(f"unknown loss {config.loss!r}; use 'regret' or 'ce'")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        policy.eval()
        with torch.no_grad():
            regret = evaluate_choices(v_val, policy(x_val).argmax(dim=1), candidates, config.objective).regret
        if regret < best_regret - 1e-9:
            best_regret, stale = regret, 0
            best_state = {k: t.clone() for k, t in policy.state_dict().items()}
        else:
            stale += 1
            if stale >= config.patience:
                break
    policy.load_state_dict(best_state)
    policy.eval()
    with torch.no_grad():
        chosen = policy(x_test).argmax(dim=1)
    report = evaluate_choices(v_test, chosen, candidates, config.objective)
    if cost is not None and config.objective == "throughput":
        report.cost_model_device = cost.device
    temperatures = torch.tensor([r.temperature for r in test])
    if len(set(temperatures.tolist())) > 1:
        for t in sorted(set(temperatures.tolist())):
            rows = temperatures == t
            report.by_temperature[f"{t:g}"] = asdict(
                evaluate_choices(v_test[rows], chosen[rows], candidates, config.objective)
            )
    policy.report = asdict(report)
    policy._hub_mixin_config["report"] = policy.report  # saved with the config, shown on the model card
    rows = [row for r in records for row in r.slot_rows]
    if acceptance is None and rows:
        acceptance = fit_acceptance_model(rows)
    policy.attach_verify_model(acceptance, cost)
    return policy, report


def compare_objectives(records: Sequence[OracleRecord], candidates: Sequence[int], cost: CostModel) -> dict:
    """How much choosing b by acceptance (argmax τ, the paper's labels) differs from choosing by throughput.

    Returns, per objective, the per-prompt oracle histogram and the best fixed b, plus the modeled tokens/s
    (from `cost`) of each objective's oracle and best fixed choice.
    """
    tau = torch.tensor([objective_values(r, candidates, "acceptance", None) for r in records])
    speed = torch.tensor([objective_values(r, candidates, "throughput", cost) for r in records])
    rows = torch.arange(len(records))
    out = {}
    for name, values in (("acceptance", tau), ("throughput", speed)):
        oracle = values.argmax(dim=1)
        fixed = int(values.mean(dim=0).argmax())
        out[name] = {
            "oracle_counts": {b: int((oracle == i).sum()) for i, b in enumerate(candidates)},
            "best_fixed_b": candidates[fixed],
            "oracle_tokens_per_second": float(speed[rows, oracle].mean()),
            "best_fixed_tokens_per_second": float(speed[:, fixed].mean()),
            "oracle_tau": float(tau[rows, oracle].mean()),
        }
    return out
