"""DFlash drafter training for any Transformers causal LM target.

Per sequence, random anchor positions in the response; each block is `[anchor token, MASK x (b-1)]` at
positions anchor..anchor+b-1, sees the target context strictly before its anchor and itself
bidirectionally, never other blocks. Slot k predicts token anchor+k (slot 0 excluded), with cross-entropy
weighted by exp(-(k-1)/gamma). The target's embedding and LM head are frozen and shared.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import random
import shutil
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .._compat import runs_bf16_natively
from ..data import PromptRecord
from ..modeling_block_diffusion import BlockDiffusionDrafter
from .data import SequenceView, TrainingSequence, load_hidden_states, target_hidden_states
from .distributed import (
    barrier,
    full_states,
    load_full_states,
    on_any_rank,
    rank_and_world_size,
    shard,
    summed_over_ranks,
)

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"


@dataclass
class DrafterTrainingConfig:
    """Hyper-parameters of the DFlash recipe (defaults sized for a 2-core CPU)."""

    block_size: int = 16
    anchors_per_sequence: int = 32
    sequences_per_step: int = 4
    max_steps: int = 2000
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # loss decay over slots; None: DFlash's 7 (b=16), 5 (b=10), 4 (b=8)
    bf16: bool | None = None  # bf16 autocast; None: where the device runs bf16 natively (`runs_bf16_natively`)
    seed: int = 0
    save_every: int = 100
    save_every_minutes: float | None = None  # also save when this much time passed since the last save
    log_every: int = 10
    max_minutes: float | None = None
    validation_fraction: float = 0.02  # sequences never trained on (chosen by a hash of their id)
    validation_max_sequences: int = 64  # at most this many of them are scored at each evaluation
    eval_every: int = 500
    # Share of each sequence's anchors placed where greedy decoding with the current drafter starts its rounds
    # (replayed each step over a window of twice as many positions): right after a failed draft, where real
    # rounds start and drafting is hardest. Costs one more drafter forward per sequence (docs/design-measurements.md).
    decoding_anchor_fraction: float = 0.0
    # Under torchrun: shard the drafter (and a target computing hidden states live) with FSDP2 `fully_shard`
    # instead of replicating the drafter with DDP, for models that do not fit one device.
    fsdp: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.decoding_anchor_fraction <= 1.0:
            raise ValueError(f"decoding_anchor_fraction must be in [0, 1], got {self.decoding_anchor_fraction}")

    def loss_gamma(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return max(1.0, 4.0 + (self.block_size - 8) * 3.0 / 8.0)


def is_validation_sequence(seq_id: str, fraction: float) -> bool:
    """Deterministic held-out split by a hash of the id: stable across runs, resumes and growing data."""
    return zlib.crc32(seq_id.encode("utf-8")) % 10_000 < fraction * 10_000


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """Boolean (n*b, context_len + n*b) mask, True = attend, for blocks anchored at `anchors` (n,).

    Block j sees context positions strictly before `anchors[j]` and its own b slots, never other blocks.
    """
    n = anchors.shape[0]
    block_of_query = torch.arange(n * block_size, device=anchors.device) // block_size
    context = torch.arange(context_len, device=anchors.device)[None, :] < anchors[block_of_query][:, None]
    same_block = block_of_query[:, None] == block_of_query[None, :]
    return torch.cat([context, same_block], dim=1)


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for slots k = 1..b-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def build_draft_vocab(
    sequences: Sequence[TrainingSequence], size: int, always: Sequence[int] = (), vocab_size: int | None = None
) -> list[int]:
    """A reduced draft vocabulary of `size` target ids, sorted: `always` (e.g. EOS), then the most frequent
    response tokens, then, if the data has fewer distinct tokens and `vocab_size` is given, the lowest
    unused ids (BPE assigns low ids to early, frequent merges)."""
    counts = Counter(tok for seq in sequences for tok in seq.supervised_tokens())
    chosen = list(dict.fromkeys(list(always) + [tok for tok, _ in counts.most_common(size)]))[:size]
    if vocab_size is not None and len(chosen) < size:
        taken = set(chosen)
        chosen += [i for i in range(vocab_size) if i not in taken][: size - len(chosen)]
    return sorted(chosen)


@torch.no_grad()
def init_drafter_from_target(drafter: BlockDiffusionDrafter, target: PreTrainedModel) -> None:
    """Start the drafter as a copy of the target's last layers reading the target's own past.

    Draft layer i copies target layer `L - n + i` (attention and MLP projections, layer norms; the Qwen3-style
    q/k norms start at one) and the final norm is the target's, so the LM head sees familiar states. When the
    context includes the input of the first copied layer (layer id `L - n - 1`), `fc` starts as the identity on
    it and `hidden_norm` as that layer's input norm: the copied attention then starts out attending over the
    very keys/values the target computes for past tokens. Otherwise `fc` gets a small random init.
    """
    target_layers = target.get_decoder().layers
    first = len(target_layers) - len(drafter.layers)
    for i, layer in enumerate(drafter.layers):
        source = target_layers[first + i]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).load_state_dict(getattr(source.self_attn, name).state_dict())
        layer.mlp.load_state_dict(source.mlp.state_dict())
        layer.input_layernorm.weight.copy_(source.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
    drafter.norm.weight.copy_(target.get_decoder().norm.weight)
    hidden = drafter.config.hidden_size
    if first - 1 in drafter.target_layer_ids:
        slot = drafter.target_layer_ids.index(first - 1)
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, slot * hidden : (slot + 1) * hidden].copy_(torch.eye(hidden))
        drafter.hidden_norm.weight.copy_(target_layers[first].input_layernorm.weight)
    else:
        drafter.fc.weight.normal_(0.0, 0.1 / math.sqrt(drafter.fc.in_features))


class DrafterTrainer:
    """Trains a `BlockDiffusionDrafter` on target hidden states, cached on disk (`hidden_cache_dir`) or
    computed by the target in each step (`None`: no disk, the better choice on a GPU); resumable from
    `output_dir`.

    Under torch.distributed (torchrun; `distributed.init_from_torchrun`) every rank runs one: the drafter is
    wrapped in `DistributedDataParallel` (or sharded with FSDP2, `config.fsdp`), each step's global batch
    (`sequences_per_step`, drawn alike on every rank) is split over the ranks, each reading only its own
    sequences' hidden states, and the loss is normalised by the global batch, so losses, schedule and weights do
    not depend on the number of ranks. Rank 0 logs, evaluates (every rank, when sharded) and saves."""

    def __init__(
        self,
        drafter: BlockDiffusionDrafter,
        target: PreTrainedModel,
        sequences: Sequence[TrainingSequence],
        hidden_cache_dir: str | Path | None,
        output_dir: str | Path,
        config: DrafterTrainingConfig,
    ):
        if drafter.config.has_masked_layers():
            raise ValueError(
                "training drafters with causal or sliding-window layers (layer_types / is_causal) is not implemented: "
                "the training mask would ignore them. Train a drafter with full, non-causal layers (from_target's)"
            )
        self.config = config
        self.rank, self.world_size = rank_and_world_size()
        if min(config.sequences_per_step, len(sequences)) < self.world_size:
            raise ValueError(
                f"{self.world_size} ranks need at least as many sequences per step "
                f"(sequences_per_step={config.sequences_per_step}, {len(sequences)} sequences): raise "
                "--sequences-per-step or start fewer processes"
            )
        self.drafter = drafter.train()
        self.sharded = config.fsdp and self.world_size > 1
        if self.sharded:
            if config.decoding_anchor_fraction:
                raise ValueError(
                    "decoding anchors replay a different number of drafter forwards on each rank, which FSDP's "
                    "gathers cannot follow: use --decoding-anchors 0 with --fsdp, or DDP"
                )
            shard(drafter.layers, drafter)
            if hidden_cache_dir is None:  # frozen; its embeddings and head, read outside its forward, stay whole
                shard(target.get_decoder().layers)
        self.model = drafter
        if self.world_size > 1 and not self.sharded:
            # the buffers (draft vocabulary map, rotary frequencies) never change: no broadcast in every forward
            self.model = DistributedDataParallel(drafter, broadcast_buffers=False)
        # one pass over the data, which may be read from disk as it is used (`read_sequences`): an index is kept
        # per training sequence, and the first `validation_max_sequences` held-out ones by id
        training, held_out = [], []
        for index, seq in enumerate(sequences):
            if len(seq.supervised_tokens()) < 2:
                continue
            if is_validation_sequence(seq.id, config.validation_fraction):
                held_out.append((seq.id, index))
            else:
                training.append(index)
        self.sequences = SequenceView(sequences, training)
        first = heapq.nsmallest(config.validation_max_sequences, held_out)
        self.validation = SequenceView(sequences, [index for _, index in first])
        if not self.sequences:
            raise ValueError("no training sequence has a response of at least 2 tokens")
        self.hidden_cache_dir = None if hidden_cache_dir is None else Path(hidden_cache_dir)
        self.target = target
        self.bf16 = runs_bf16_natively(drafter.device) if config.bf16 is None else config.bf16
        self.output_dir = Path(output_dir)
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self._bind_draft_vocab()
        self.weights = loss_weights(config.block_size, config.loss_gamma())
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.step = 0
        self.rng = random.Random(config.seed)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._resume()

    def _lr_factor(self, step: int) -> float:
        cfg = self.config
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def _bind_draft_vocab(self) -> None:
        """LM-head rows and the target -> draft id map for the drafter's current `d2t`."""
        weight, bias = self.drafter.draft_head(self.lm_head)
        self.head_weight = weight.detach()
        self.head_bias = None if bias is None else bias.detach()
        vocab = self.embed.weight.shape[0]
        if self.drafter.d2t is None:
            self.target_to_draft = torch.arange(vocab)
        else:
            self.target_to_draft = torch.full((vocab,), -100, dtype=torch.long)
            self.target_to_draft[self.drafter.d2t.cpu()] = torch.arange(self.drafter.d2t.numel())

    def set_draft_vocab(self, vocab: Sequence[int]) -> None:
        """Point the drafter at another draft vocabulary of the same size, e.g. rebuilt after data was added.

        No trainable weight depends on it (the head rows are the frozen target LM head's), so training goes on.
        """
        d2t = self.drafter.d2t
        ids = sorted(set(vocab))
        if d2t is None or len(ids) != d2t.numel():
            raise ValueError(
                f"the drafter's draft vocabulary has {None if d2t is None else d2t.numel()} ids; "
                f"got {len(ids)} distinct ids"
            )
        with torch.no_grad():
            d2t.copy_(torch.tensor(ids, dtype=d2t.dtype))
        self._bind_draft_vocab()

    def vocab_coverage(self) -> float:
        """Share of the training response tokens the draft vocabulary can propose (1.0 for the full one)."""
        covered = total = 0
        for seq in self.sequences:
            tokens = torch.tensor(seq.supervised_tokens(), dtype=torch.long)
            covered, total = covered + int((self.target_to_draft[tokens] >= 0).sum()), total + tokens.numel()
        return covered / total if total else 1.0

    # ------------------------------------------------------------------------------------------ one step
    def hidden_states(self, batch: Sequence[TrainingSequence]) -> torch.Tensor:
        """Target hidden states of `batch`, right-padded to (len(batch), longest, layers * hidden): read from
        the on-disk cache, or computed by the target now when the trainer has no cache (`hidden_cache_dir=None`)."""
        if self.hidden_cache_dir is None:
            return target_hidden_states(self.target, batch, self.drafter.target_layer_ids)
        states = [load_hidden_states(self.hidden_cache_dir, seq) for seq in batch]
        return torch.nn.utils.rnn.pad_sequence(states, batch_first=True)

    def sequence_loss(
        self, seq: TrainingSequence, hidden: torch.Tensor, rng: random.Random | None = None
    ) -> tuple[torch.Tensor, dict]:
        """`batch_loss` of one sequence with its (length, layers * hidden) hidden states."""
        return self.batch_loss([seq], hidden[None], rng)

    def batch_loss(
        self,
        batch: Sequence[TrainingSequence],
        hidden: torch.Tensor,
        rng: random.Random | None = None,
        anchors: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """Weighted block-diffusion loss over the blocks of a batch of sequences, in one drafter forward.

        Each sequence gets up to `anchors_per_sequence` random anchors (drawn from `rng`, default the
        trainer's), or the given `anchors` (one sorted list per sequence); sequences with fewer anchors repeat
        their first one in blocks that carry no loss. `hidden` is (len(batch), >= longest, layers * hidden),
        right-padded: a block only sees context before its anchor, so padding is never attended. Returns the
        loss (the weighted mean over the batch's slots) and per-block slot accuracy counts, with the loss
        weights' sum (`"weight"`).
        """
        b = self.config.block_size
        if anchors is None:
            anchors = self.random_anchors(batch, [rng or self.rng] * len(batch))
        lengths = [len(seq.input_ids) for seq in batch]
        width = hidden.shape[1]
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        supervised = torch.zeros((len(batch), width), dtype=torch.bool)  # labels only on supervised tokens
        anchor_rows, block_valid = [list(row) for row in anchors], []
        for row, seq in enumerate(batch):
            ids[row, : lengths[row]] = torch.tensor(seq.input_ids)
            for start, end in seq.supervised_spans():
                supervised[row, start:end] = True
        n = max(len(chosen) for chosen in anchor_rows)
        for chosen in anchor_rows:
            block_valid.append([True] * len(chosen) + [False] * (n - len(chosen)))
            chosen += chosen[:1] * (n - len(chosen))
        anchors = torch.tensor(anchor_rows)  # (batch, n)
        block_valid = torch.tensor(block_valid)
        offsets = torch.arange(b)
        positions = (anchors[:, :, None] + offsets).reshape(len(batch), -1)
        rows = torch.arange(len(batch))[:, None]
        block_ids = torch.full_like(positions, self.drafter.mask_token_id)
        block_ids[:, ::b] = ids[rows, anchors]
        label_pos = (anchors[:, :, None] + offsets[1:]).clamp(max=width - 1)
        valid = supervised[rows[:, :, None], label_pos] & (anchors[:, :, None] + offsets[1:] < width)
        valid &= block_valid[:, :, None]
        labels = torch.where(valid, ids[rows[:, :, None], label_pos], -100)
        draft_labels = torch.where(valid, self.target_to_draft[labels.clamp(min=0)], -100)
        mask = torch.stack([block_attention_mask(row, b, width) for row in anchors])[:, None]
        device = self.drafter.device
        labels_here = draft_labels.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = (self.model if torch.is_grad_enabled() else self.drafter)(  # DDP syncs only where it trains
                block_embeds=self.drafter.embed_block(self.embed, block_ids).to(device).detach(),
                block_position_ids=positions.to(device),
                target_hidden=hidden.to(device),
                context_position_ids=torch.arange(width, device=device).expand(len(batch), -1),
                attention_mask=mask.to(device),
                block_size=b,
            ).last_hidden_state
            slots = out.view(len(batch), n, b, -1)[:, :, 1:]
            logits = F.linear(slots, self.head_weight.to(slots.dtype), self.head_bias)
        logits = self.drafter.finish_logits(logits.float())
        ce = F.cross_entropy(logits.flatten(0, -2), labels_here.flatten(), reduction="none").view_as(labels_here)
        drafted = logits.argmax(-1)
        if self.drafter.candidate_selector is not None:
            previous = ids[rows[:, :, None], (label_pos - 1).clamp(min=0)].to(device)  # slot 1's: the anchor
            selector_ce, drafted = self.selector_loss(slots, logits, previous, labels_here)
            ce = ce + selector_ce
        weights = self.weights.to(device) * valid.to(device)
        loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
        correct = (drafted.cpu() == draft_labels) & valid
        keep = block_valid.reshape(-1)
        counts = {"correct": correct.reshape(-1, b - 1)[keep], "valid": valid.reshape(-1, b - 1)[keep]}
        return loss, {**counts, "weight": weights.sum()}

    def selector_loss(
        self, slots: torch.Tensor, logits: torch.Tensor, previous: torch.LongTensor, labels: torch.LongTensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DFlash 2's candidate-selector loss, teacher-forced: each slot scores its top-k draft candidates after the
        true previous token (`previous`: the anchor for slot 1), as greedy drafting does while its drafts are
        right, and the cross-entropy over those scores targets the label (0 where the label is not a candidate:
        the token loss teaches the drafter to rank it there). Returns that per-slot loss and the token each slot
        drafts (the best-scored candidate)."""
        selector = self.drafter.candidate_selector
        unary, candidates = logits.topk(selector.top_k, dim=-1)
        scores = unary + selector.pair_scores(selector.project(slots), previous, candidates).float()
        hit = candidates == labels[..., None]
        target = torch.where(hit.any(-1), hit.int().argmax(-1), -100)
        loss = F.cross_entropy(scores.flatten(0, -2), target.flatten(), reduction="none").view_as(labels)
        return loss, candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]

    def train(self, on_save: Callable[[DrafterTrainer], None] | None = None) -> dict:
        """Run until `max_steps` (or `max_minutes`), checkpointing every `save_every` steps (and every
        `save_every_minutes`) and scoring the held-out sequences every `eval_every` steps; returns the last
        training and validation figures. `on_save(trainer)` runs after each checkpoint (e.g. to copy it off a
        lent machine)."""
        cfg = self.config
        start = last_save = time.monotonic()

        def save() -> None:
            nonlocal last_save
            self.save()
            last_save = time.monotonic()
            if on_save is not None and self.rank == 0:
                on_save(self)

        lead = self.rank == 0  # logs, evaluates and saves
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="drafter training", unit="step", disable=not lead)
        window: list[dict] = []
        summary: dict = {}
        evaluation: dict = {}
        tokens = 0  # supervised response tokens seen in this call
        while self.step < cfg.max_steps:
            # the global batch, drawn alike on every rank; each rank takes its share, every sequence its own
            # anchor draws (seeded by the step and its place in the batch, whatever rank holds it)
            batch = self.rng.sample(self.sequences, min(cfg.sequences_per_step, len(self.sequences)))
            tokens += sum(len(seq.supervised_tokens()) for seq in batch)
            mine = range(self.rank, len(batch), self.world_size)
            local = [batch[i] for i in mine]
            self.optimizer.zero_grad(set_to_none=True)
            hidden = self.hidden_states(local)
            anchors = self.training_anchors(local, hidden, [random.Random(f"{cfg.seed}/{self.step}/{i}") for i in mine])
            loss, acc = self.batch_loss(local, hidden, anchors=anchors)
            weight = acc.pop("weight")
            total_weight = summed_over_ranks(weight.detach()).clamp(min=1e-6)
            # the global batch's weighted mean; DDP averages the ranks' gradients, hence the world size
            (loss * weight * (self.world_size / total_weight)).backward()
            total = float(summed_over_ranks(loss.detach() * weight) / total_weight)
            window.append(acc)
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            bar.update(1)
            if self.step % cfg.log_every == 0:
                seconds = time.monotonic() - start
                summary = {
                    "step": self.step,
                    "loss": total,
                    "lr": self.scheduler.get_last_lr()[0],
                    "seconds": round(seconds, 2),  # since this call started, evaluations and saves included
                    "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
                    **accuracy_summary(window),
                }
                window = []
                bar.set_postfix(
                    loss=f"{total:.3f}", tau_est=f"{summary['tau_estimate']:.2f}", tok_s=summary["tokens_per_second"]
                )
                self._log(summary)
            if self.step % cfg.eval_every == 0 and (lead or self.sharded):
                evaluation = self.evaluate()
                self._log(evaluation)
            # decisions on time: every rank takes rank-alike branches (they save and stop together)
            minutes_since_save = (time.monotonic() - last_save) / 60
            timed_save = cfg.save_every_minutes is not None and minutes_since_save >= cfg.save_every_minutes
            if self.step % cfg.save_every == 0 or on_any_rank(timed_save):
                save()
            if on_any_rank(cfg.max_minutes is not None and time.monotonic() - start > 60 * cfg.max_minutes):
                break
        bar.close()
        if (lead or self.sharded) and (self.step % cfg.eval_every or not evaluation):
            evaluation = self.evaluate()
            self._log(evaluation)
        save()
        barrier()  # the last checkpoint is written before any rank returns
        return {**summary, **evaluation}

    def training_anchors(
        self, batch: Sequence[TrainingSequence], hidden: torch.Tensor, rngs: Sequence[random.Random]
    ) -> list[list[int]]:
        """Per sequence, up to `anchors_per_sequence` anchors: a `decoding_anchor_fraction` share from
        `decoding_anchors` over a window of twice that many positions (where real rounds start), the rest
        random (drawn from the sequence's own `rngs` entry), all distinct and sorted."""
        counts = [min(self.config.anchors_per_sequence, len(seq.anchor_candidates())) for seq in batch]
        wanted = [round(self.config.decoding_anchor_fraction * n) for n in counts]
        chosen = [
            self.decoding_anchors(seq, hidden[row], 2 * n, rng)[:n] if n else []
            for row, (seq, n, rng) in enumerate(zip(batch, wanted, rngs, strict=True))
        ]
        return self.random_anchors(batch, rngs, chosen)

    def random_anchors(
        self,
        batch: Sequence[TrainingSequence],
        rngs: Sequence[random.Random],
        chosen: Sequence[Sequence[int]] | None = None,
    ) -> list[list[int]]:
        """Per sequence, its `chosen` anchors and random ones (from its `rngs` entry) up to `anchors_per_sequence`,
        distinct and sorted; an anchor's slot 1 always has a label."""
        rows = []
        for seq, rng, taken in zip(batch, rngs, chosen or [()] * len(batch), strict=True):
            candidates = seq.anchor_candidates()
            count = min(self.config.anchors_per_sequence, len(candidates))
            excluded = set(taken)
            rest = [a for a in candidates if a not in excluded]
            rows.append(sorted([*taken, *rng.sample(rest, count - len(taken))]))
        return rows

    def decoding_anchors(
        self,
        seq: TrainingSequence,
        hidden: torch.Tensor,
        window: int | None = None,
        rng: random.Random | None = None,
    ) -> list[int]:
        """Anchors of the rounds that greedy speculative decoding with the current drafter runs along `seq`'s
        response (see `replay_acceptance`): the first response token, then each position after a round. With
        `window`, only the rounds within that many positions from a random start (drawn from `rng`, default
        the trainer's)."""
        start, stop = seq.response_start, len(seq.input_ids) - 1
        if window is not None and window < stop - start:
            start = (rng or self.rng).randrange(start, stop - window + 1)
            stop = start + window
        committed = self.replay_acceptance(seq, hidden, start=start, stop=stop)
        return list(accumulate(committed[:-1], initial=start))

    @torch.no_grad()
    def replay_acceptance(
        self,
        seq: TrainingSequence,
        hidden: torch.Tensor,
        chunk: int = 64,
        start: int | None = None,
        stop: int | None = None,
    ) -> list[int]:
        """Tokens committed per round of greedy speculative decoding along `seq`'s response at this block size.

        Drafts from every response position are scored (in chunks of `chunk` blocks); the rounds are then
        chained as real decoding chains them (a round anchored at a commits its accepted slots plus the
        target's token, so the next anchor is a + accepted + 1), starting at the first response token, which
        the prefill commits. For the target's own greedy response this equals real decoding's acceptance;
        random anchors (`tau_estimate`) read higher, since real rounds start where the last draft failed.
        `start`/`stop` replay the rounds from position `start` up to `stop` only (default: the whole response).
        """
        start = seq.response_start if start is None else start
        stop = len(seq.input_ids) - 1 if stop is None else stop
        accepted = self.draft_acceptance(seq, hidden, chunk, start, stop)
        committed = []
        anchor = start
        while anchor < stop:
            committed.append(min(accepted[anchor - start] + 1, stop - anchor))
            anchor += committed[-1]
        return committed

    @torch.no_grad()
    def draft_acceptance(
        self, seq: TrainingSequence, hidden: torch.Tensor, chunk: int, start: int, stop: int
    ) -> list[int]:
        """Drafts the target accepts (greedy, 0..block_size - 1) of a block anchored at each position
        `start..stop - 1` of `seq`, scored in chunks of `chunk` blocks."""
        positions = list(range(start, stop))
        correct = []
        for i in range(0, len(positions), chunk):
            _, acc = self.batch_loss([seq], hidden[None], anchors=[positions[i : i + chunk]])
            correct.append(acc["correct"])
        return torch.cat(correct).int().cumprod(dim=1).sum(dim=1).tolist() if correct else []

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and τ estimate on the held-out sequences (same anchors every time, so values compare across
        steps); empty when there are none. A validation τ that stops climbing says training has stopped paying."""
        if not self.validation:
            return {}
        rng = random.Random(self.config.seed + 1)
        self.drafter.eval()
        losses, window = [], []
        committed = rounds = 0
        try:
            step = self.config.sequences_per_step
            for start in range(0, len(self.validation), step):
                batch = self.validation[start : start + step]
                hidden = self.hidden_states(batch)
                loss, acc = self.batch_loss(batch, hidden, rng)
                losses.append(loss.item())
                window.append(acc)
                for row, seq in enumerate(batch):
                    per_round = self.replay_acceptance(seq, hidden[row])
                    committed, rounds = committed + sum(per_round), rounds + len(per_round)
        finally:
            self.drafter.train()
        summary = accuracy_summary(window)
        return {
            "step": self.step,
            "val_loss": sum(losses) / len(losses),
            "val_tau_replay": committed / max(rounds, 1),
            "val_tau_estimate": summary["tau_estimate"],
            "val_slot_accuracy": summary["slot_accuracy"],
            "val_sequences": len(self.validation),
        }

    def _log(self, record: dict) -> None:
        if record and self.rank == 0:
            with (self.output_dir / LOG_FILE).open("a") as f:
                f.write(json.dumps(record) + "\n")
        if "val_tau_replay" in record:
            logger.info(
                "step %d: held-out loss %.3f, τ %.2f (greedy decoding replayed; random-anchor estimate %.2f)",
                record["step"],
                record["val_loss"],
                record["val_tau_replay"],
                record["val_tau_estimate"],
            )

    # ----------------------------------------------------------------------------------- checkpointing
    def save(self) -> None:
        """Drafter in the z-lab format under `output_dir/checkpoint`, optimizer state beside it (atomic); every
        rank calls it (a sharded drafter is gathered), rank 0 writes."""
        weights, optimizer = full_states(self.drafter, self.optimizer)
        if self.rank != 0:
            return
        tmp, old = (self.output_dir / f"{CHECKPOINT_DIR}.{suffix}" for suffix in ("tmp", "old"))
        for stale in (tmp, old):  # left by a run killed while saving (`_resume` read the newest already)
            shutil.rmtree(stale, ignore_errors=True)
        self.drafter.save_pretrained(tmp, state_dict=weights)
        torch.save(
            {
                "step": self.step,
                "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict(),
                "rng": self.rng.getstate(),
                "config": asdict(self.config),
            },
            tmp / STATE_FILE,
        )
        final = self.output_dir / CHECKPOINT_DIR
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)

    def _resume(self) -> None:
        """Continue from the newest complete checkpoint: `save` writes the state file last, so a `.tmp` with one is
        complete, and a run killed between its renames left the new checkpoint there."""
        names = (CHECKPOINT_DIR, f"{CHECKPOINT_DIR}.tmp")
        ckpt = next((self.output_dir / n for n in names if (self.output_dir / n / STATE_FILE).exists()), None)
        if ckpt is None:
            return
        state = torch.load(ckpt / STATE_FILE, weights_only=False)
        weights = BlockDiffusionDrafter.from_pretrained(ckpt).state_dict()
        load_full_states(self.drafter, self.optimizer, weights, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.rng.setstate(state["rng"])
        self.step = state["step"]
        self._bind_draft_vocab()


def accuracy_summary(window: list[dict]) -> dict:
    """Per-slot top-1 accuracy and the acceptance length a greedy verifier would give on these blocks."""
    correct = torch.cat([w["correct"] for w in window])
    valid = torch.cat([w["valid"] for w in window])
    per_slot = (correct.sum(0) / valid.sum(0).clamp(min=1)).tolist()
    accepted = correct.int().cumprod(dim=1).sum(dim=1).float()
    return {"slot_accuracy": [round(a, 4) for a in per_slot], "tau_estimate": 1.0 + accepted.mean().item()}


def train_drafter(
    target: PreTrainedModel,
    tokenizer,
    output_dir: str | Path,
    prompts: Iterable[PromptRecord] | None = None,
    *,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    draft_vocab_size: int | None = 8192,
    generation_batch_size: int = 64,
    max_new_tokens: int = 192,
    config: DrafterTrainingConfig | None = None,
    refresh_draft_vocab: bool = False,
    cache_hidden_states_on_disk: bool = True,
    init_drafter: str | Path | None = None,
    generation_minutes: float | None = None,
    dflash2: Mapping[str, int] | None = None,
) -> BlockDiffusionDrafter:
    """The whole recipe, each stage resumable: target responses -> hidden-state cache -> training.

    Writes `output_dir/data` (responses), `output_dir/hidden` (target hidden states) and
    `output_dir/checkpoint` (the drafter in the z-lab format, plus optimizer state). Returns the drafter.
    `cache_hidden_states_on_disk=False` has the target compute hidden states in every step instead (no disk;
    pays on a GPU, where a target forward is cheaper than reading its states back).
    `refresh_draft_vocab` rebuilds a resumed drafter's reduced vocabulary from the current data (after adding
    prompts of another kind); a coverage below 95% of the response tokens is warned about.
    `init_drafter` (a Hub id or directory) starts a new run from that drafter's weights instead of from the
    target (fine-tuning, e.g. on one domain's responses; fresh optimizer and schedule; its architecture and
    vocabulary are kept, the architecture arguments are ignored).
    `generation_minutes` caps the time spent answering new prompts (training then uses what was answered).
    `dflash2` (sizes, e.g. `DFLASH2_DEFAULT_SIZES`) makes a new drafter a DFlash 2 one (convolutions and a
    candidate selector over the full vocabulary: `draft_vocab_size` must be None).
    """
    if dflash2 is not None and draft_vocab_size:
        raise ValueError(
            "a DFlash 2 drafter selects among the full vocabulary's top candidates: pass draft_vocab_size=None "
            "(--draft-vocab-size 0) with dflash2"
        )
    from .data import (
        cache_hidden_states,
        generate_responses,
        generation_eos_ids,
        read_sequences,
    )

    config = config or DrafterTrainingConfig()
    output_dir = Path(output_dir)
    if prompts is not None:  # under torchrun every rank answers its share
        generate_responses(
            target,
            tokenizer,
            prompts,
            output_dir / "data",
            generation_batch_size,
            max_new_tokens,
            max_seconds=None if generation_minutes is None else 60 * generation_minutes,
        )
    barrier()
    sequences = read_sequences(output_dir / "data")
    num_embeddings = target.get_input_embeddings().weight.shape[0]

    def vocab_from_data(size: int) -> list[int]:
        return build_draft_vocab(sequences, size, generation_eos_ids(target), num_embeddings)

    checkpoint = output_dir / CHECKPOINT_DIR
    if (checkpoint / STATE_FILE).exists():
        drafter = BlockDiffusionDrafter.from_pretrained(checkpoint).to(target.device)
        drafter.check_compatible(target)
    elif init_drafter is not None:
        drafter = BlockDiffusionDrafter.from_pretrained(init_drafter, dtype=torch.float32).to(target.device)
        drafter.check_compatible(target)
    else:
        vocab = vocab_from_data(draft_vocab_size) if draft_vocab_size else None
        drafter = BlockDiffusionDrafter.from_target(
            target,
            num_hidden_layers=num_layers,
            block_size=config.block_size,
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            draft_vocab=vocab,
            dflash2=dflash2,
        )
        init_drafter_from_target(drafter, target)
    hidden_dir = None
    if cache_hidden_states_on_disk:
        hidden_dir = cache_hidden_states(target, sequences, drafter.target_layer_ids, output_dir / "hidden")
    trainer = DrafterTrainer(drafter, target, sequences, hidden_dir, output_dir, config)
    if refresh_draft_vocab and drafter.d2t is not None:
        trainer.set_draft_vocab(vocab_from_data(drafter.d2t.numel()))
    coverage = trainer.vocab_coverage()
    logger.info("draft vocabulary covers %.1f%% of the training response tokens", 100 * coverage)
    if coverage < 0.95:
        logger.warning(
            "the draft vocabulary covers only %.1f%% of the training response tokens: tokens outside it can never "
            "be drafted. Rebuild it with refresh_draft_vocab=True (`--refresh-draft-vocab`) or raise its size.",
            100 * coverage,
        )
    trainer.train()
    return drafter.eval()
