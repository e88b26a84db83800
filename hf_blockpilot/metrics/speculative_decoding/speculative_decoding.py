"""`evaluate` metric for lossless speculative decoding: greedy exact match, τ and speedup.

import evaluate, hf_blockpilot.metrics
metric = hf_blockpilot.metrics.load("speculative_decoding")   # a local module: no Hub access
metric.compute(predictions=fast_ids, references=plain_ids, target_forwards=[...], seconds=[...],
               reference_seconds=[...])
"""

import datasets
import evaluate

_DESCRIPTION = """Scores speculative decoding against plain decoding of the same prompts:
exact_match (fraction of outputs token-identical to plain greedy generate), tau (tokens committed per target
forward, prefill included, pooled over prompts; plain decoding = 1.0) and speedup (pooled tokens/s over the
reference's pooled tokens/s, measured in the same process)."""

_KWARGS = """
Args:
    predictions: generated token ids (new tokens only) with speculative decoding, one list per prompt.
    references: token ids from plain `generate` for the same prompts.
    target_forwards: optional, target forwards per prompt (prefill included), for tau.
    seconds / reference_seconds: optional, wall time per prompt of each method, for speedup.
Returns:
    exact_match, and tau / speedup when their inputs are given.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class SpeculativeDecoding(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("int64")),
                    "references": datasets.Sequence(datasets.Value("int64")),
                }
            ),
        )

    def _compute(self, predictions, references, target_forwards=None, seconds=None, reference_seconds=None):
        result = {"exact_match": sum(list(p) == list(r) for p, r in zip(predictions, references)) / len(references)}
        tokens = sum(len(p) for p in predictions)
        if target_forwards is not None:
            result["tau"] = tokens / sum(target_forwards)
        if seconds is not None and reference_seconds is not None:
            reference_tokens = sum(len(r) for r in references)
            result["speedup"] = (tokens / sum(seconds)) / (reference_tokens / sum(reference_seconds))
        return result
