"""BlockPilot policy training: τ(b) regression (objective `"tau"`, hardware-free; the default) or a classifier of
the best width (objectives `"throughput"` / `"acceptance"`, regret or cross-entropy loss)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..controllers import AcceptanceModel
from ..costs import CostModel
from ..device_calibration import resolve_cost_model
from ..modeling_block_diffusion import BlockDiffusionDrafter
from ..policy import OBJECTIVES, PrefillMLPPolicy, margin_for
from .calibration import fit_acceptance_model
from .oracle import OracleRecord, read_oracle_labels


def objective_values(
    record: OracleRecord, candidates: Sequence[int], objective: str, cost: CostModel | None
) -> list[float]:
    """Per candidate: τ(b) (`acceptance`) or modeled tokens per second (`throughput`): from the record's
    modeled decoding times when it has them (collected with a cost model; the only way for labels collected
    under the adaptive controller, whose rounds differ in cost), else τ(b) / round latency."""
    if objective == "acceptance":
        return [record.tau[b] for b in candidates]
    if objective == "tau":  # the labels are hardware-free: price τ with the given (local) cost model
        return local_throughput(record, candidates, cost)
    if record.ms and all(record.ms.get(b, 0) > 0 for b in candidates):
        return [1000.0 * record.new_tokens / record.ms[b] for b in candidates]
    return local_throughput(record, candidates, cost)


def local_throughput(record: OracleRecord, candidates: Sequence[int], cost: CostModel | None) -> list[float]:
    """Per candidate: modeled tokens per second with every draft verified, τ(b) / round latency under `cost`."""
    if cost is None:
        raise ValueError("pricing widths needs a cost model (`hf-blockpilot calibrate` measures this machine's)")
    return [1000.0 * record.tau[b] / cost.round_ms(b, record.temperature) for b in candidates]


@dataclass
class PolicyTrainingConfig:
    #: "tau" (predict τ(b), priced at request time by the local cost model), "throughput" or "acceptance"
    objective: str = "tau"
    #: the classifiers' loss: "regret" (expected regret) or "ce" (cross-entropy to the oracle b, smoothed); None:
    #: regret for them, the squared log error of τ(b) for "tau" (its only loss)
    loss: str | None = None
    label_smoothing: float = 0.1
    epochs: int = 300
    learning_rate: float = 3e-3
    weight_decay: float = 1e-2
    validation_fraction: float = 0.2  # of the prompts for the test split, then of the rest for validation
    patience: int = 40
    seed: int = 0
    width: int = 64
    dropout: float = 0.1
    #: how the τ objective's head predicts τ(b) (`policy.TAU_HEADS`): one output per candidate or per draft slot
    tau_head: str = "per_width"


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
    tau_error: float | None = None  # objective "tau": mean |τ̂(b) - τ(b)| / τ(b) over the drafting candidates


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
) -> tuple[PrefillMLPPolicy, PolicyReport]:
    """Fit a `PrefillMLPPolicy` on oracle records: early stopping on the validation split, metrics on a test split
    of prompts it never saw. `prompt_lookup`: the records label decoding with prompt lookup on (recorded in the
    policy).

    Objective `"tau"` (default): the policy learns τ(b) (squared log error) from labels of fully verified rounds,
    which depend on no machine; `cost` (this machine's, say) only prices the report's choices. The classifying
    objectives learn the best width under `cost` (or the records' modeled times); records of decoding under
    `AdaptiveVerify` (`collect --adaptive`) make a policy that serves under it by default; fixed and adaptive
    records cannot be mixed. The per-round controller's acceptance model (`acceptance`, else fitted on the
    records' recorded rounds, when they have any) and `cost` are stored in the policy. Returns the policy and
    the report."""
    from ..policy import drafter_fingerprint

    if config.objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {config.objective!r}")
    predicts_tau = config.objective == "tau"
    if predicts_tau and config.loss is not None:
        raise ValueError("the tau objective has one loss (squared log error of τ(b)): leave the loss unset")
    loss_name = "tau-log-mse" if predicts_tau else (config.loss or "regret")
    if loss_name not in ("tau-log-mse", "regret", "ce"):
        raise ValueError(f"unknown loss {config.loss!r}; use 'regret' or 'ce'")
    label_controllers = {r.controller for r in records}
    if len(label_controllers) > 1:
        raise ValueError(
            "these labels mix rounds verified in full (`collect`) and cut by the per-round controller "
            "(`collect --adaptive`): their best widths differ; train on one kind"
        )
    if predicts_tau and label_controllers != {"fixed"}:
        raise ValueError(
            "the tau objective learns τ(b) of fully verified rounds, which no machine's costs shaped: collect the "
            "labels without --adaptive"
        )
    if predicts_tau and cost is None:
        raise ValueError("pass a cost model (this machine's calibration, say) to price the report's choices")
    torch.manual_seed(config.seed)
    # train / validation (early stopping) / test (the reported metrics), split by prompt
    rest, test = split_by_prompt(records, config.validation_fraction, config.seed)
    train, val = split_by_prompt(rest, config.validation_fraction, config.seed + 1)

    def tensors(rows):
        x = torch.tensor([r.features for r in rows], dtype=torch.float32)
        v = torch.tensor([objective_values(r, candidates, config.objective, cost) for r in rows])
        tau = torch.tensor([[r.tau[b] for b in candidates] for r in rows])
        ms = torch.tensor([[cost.round_ms(b, r.temperature) for b in candidates] for r in rows]) if cost else None
        return x, v, tau, ms

    x_train, v_train, tau_train, _ = tensors(train)
    x_val, v_val, tau_val, _ = tensors(val)
    x_test, v_test, tau_test, ms_test = tensors(test)
    text_config = target.config.get_text_config()
    policy = PrefillMLPPolicy(
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
        training_loss=loss_name,
        prompt_lookup=prompt_lookup,
        label_controller=label_controllers.pop() if label_controllers else "fixed",
        tau_head=config.tau_head,
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    # per-prompt regret of each candidate, relative to the prompt's best (scale-free across prompts)
    regret_train = (v_train.max(dim=1, keepdim=True).values - v_train) / v_train.max(dim=1, keepdim=True).values

    def tau_loss(outputs: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        return (policy.predicted_tau(outputs).log() - tau.log()).square().mean()

    best_state, best_score, stale = None, float("inf"), 0
    for _ in range(config.epochs):
        policy.train()
        logits = policy(x_train)
        if predicts_tau:
            loss = tau_loss(logits, tau_train)
        elif loss_name == "regret":
            loss = (logits.softmax(dim=1) * regret_train).sum(dim=1).mean()
        else:
            loss = F.cross_entropy(logits, v_train.argmax(dim=1), label_smoothing=config.label_smoothing)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        policy.eval()
        with torch.no_grad():
            if predicts_tau:
                score = float(tau_loss(policy(x_val), tau_val))
            else:
                score = evaluate_choices(v_val, policy(x_val).argmax(dim=1), candidates, config.objective).regret
        if score < best_score - 1e-9:
            best_score, stale = score, 0
            best_state = {k: t.clone() for k, t in policy.state_dict().items()}
        else:
            stale += 1
            if stale >= config.patience:
                break
    policy.load_state_dict(best_state)
    policy.eval()
    with torch.no_grad():
        outputs = policy(x_test)
        predicted = policy.consistent_tau(policy.predicted_tau(outputs))
    # what serving does: a τ policy prices its consistent prediction with the costs, drafting only where it beats
    # plain decoding by its held-out error; a classifier takes its top class
    tau_error = None
    if predicts_tau:
        drafting = torch.tensor(candidates) > 1
        tau_error = float(((predicted - tau_test).abs() / tau_test)[:, drafting].mean())
    chosen = policy.priced_choice(predicted, ms_test, margin_for(tau_error)) if predicts_tau else outputs.argmax(dim=1)
    report = evaluate_choices(v_test, chosen, candidates, config.objective)
    report.tau_error = tau_error
    if cost is not None and config.objective in ("throughput", "tau"):
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


def read_label_manifest(labels: str | Path, candidates: Sequence[int] | None = None) -> dict:
    """The manifest of a `collect` directory, after checking it exists and holds `candidates` (if given)."""
    labels = Path(labels)
    if not (labels / "manifest.json").is_file():
        raise FileNotFoundError(
            f"no labels in {labels} (no manifest.json): collect them first with "
            f"`hf-blockpilot collect --output-dir {labels}`"
        )
    manifest = json.loads((labels / "manifest.json").read_text())
    missing = sorted(set(candidates or []) - set(manifest["candidates"]))
    if missing:
        raise ValueError(f"block sizes {missing} were not collected in {labels} (collected: {manifest['candidates']})")
    return manifest


def train_policy_from_labels(
    labels: str | Path,
    output: str | Path,
    target: PreTrainedModel,
    drafter: BlockDiffusionDrafter,
    config: PolicyTrainingConfig,
    cost: CostModel | None = None,
    candidates: Sequence[int] | None = None,
    acceptance: AcceptanceModel | None = None,
) -> tuple[PrefillMLPPolicy, PolicyReport, dict | None]:
    """`train_policy` on a `collect` directory, written to `output`: the checkpoint and its card, the report
    (`training_report.json`), the acceptance model, and, with a cost model, where choosing by acceptance and by
    throughput disagree (`objectives.json`). `cost`: default, the labels' own `cost_model.json` for the
    classifying objectives, this machine's (`resolve_cost_model`) for the τ objective. `candidates`: a subset
    of the collected ones. Returns the policy, its report and that comparison (or None)."""
    labels = Path(labels)
    manifest = read_label_manifest(labels, candidates)
    candidates = list(candidates or manifest["candidates"])
    if cost is None and config.objective == "tau":  # the labels have no machine: price the report on this one
        cost = resolve_cost_model(target, drafter, max_width=max(candidates))
    elif cost is None and (labels / "cost_model.json").is_file():
        cost = CostModel.load(labels / "cost_model.json")
    missing_costs = sorted(set(candidates) - {1} - set(cost.target_ms)) if cost else []
    if missing_costs:
        raise ValueError(
            f"the cost model has no latency for block sizes {missing_costs}; measure them with "
            "`hf-blockpilot measure-cost --candidates ...` or pass --candidates without them"
        )
    records = read_oracle_labels(labels)
    policy, report = train_policy(
        records,
        candidates,
        manifest["feature_layers"],
        target,
        drafter,
        config,
        cost,
        prompt_lookup=manifest.get("prompt_lookup", False),
        acceptance=acceptance,
    )
    output = Path(output)
    policy.save_pretrained(output)
    if policy.acceptance_model is not None:
        (output / "acceptance_model.json").write_text(json.dumps(policy.acceptance_model.to_dict(), indent=2))
    policy.generate_model_card().save(output / "README.md")  # save_pretrained keeps an existing card
    (output / "training_report.json").write_text(json.dumps(asdict(report), indent=2))
    comparison = None
    if cost is not None:
        comparison = compare_objectives(records, candidates, cost)
        (output / "objectives.json").write_text(json.dumps(comparison, indent=2))
    return policy, report, comparison
