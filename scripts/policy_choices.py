"""The embedded policy's width per held-out prompt under each recorded cost table (../shared/calibrations/ and
docs/calibrations/): its raw τ head with the 5 % margin (before) -> consistent τ with its held-out-error margin
(now). Run from the repository root: `.venv/bin/python scripts/policy_choices.py` (offline, about a minute)."""

import glob

import torch

from hf_blockpilot.costs import CostModel
from hf_blockpilot.data import chat_inputs, load_prompts
from hf_blockpilot.policy import MIN_PREDICTED_GAIN
from hf_blockpilot.tools.loading import load_default_target, resolve_policy

t, tok = load_default_target(dtype=torch.float32)
pol = resolve_policy("default")
tables = {
    p.split("/")[-1].removesuffix(".json"): CostModel.load(p)
    for p in sorted(glob.glob("../shared/calibrations/*.json") + glob.glob("docs/calibrations/*.json"))
}
rows = []
for ds in ("humaneval", "mtbench", "gsm8k"):
    for rec in load_prompts(ds, 6):
        ids = chat_inputs(tok, rec.prompt, "cpu")
        with torch.no_grad():
            out = t(ids, output_hidden_states=True)
            feats = pol.features(out, t.get_output_embeddings(), 0.0)
            raw = pol.predicted_tau(pol(feats)[0].float())
        fixed = pol.consistent_tau(raw)
        row = [rec.id]
        for cost in tables.values():
            ms = torch.tensor([cost.round_ms(b) for b in pol.candidates])
            before = pol.candidates[int(pol.priced_choice(raw, ms, MIN_PREDICTED_GAIN))]
            now = pol.candidates[int(pol.priced_choice(fixed, ms))]
            row.append(f"{before}→{now}")
        rows.append(row)
print("| prompt | " + " | ".join(tables) + " |")
print("|---" * (len(tables) + 1) + "|")
for r in rows:
    print("| " + " | ".join(r) + " |")
print(f"margin now: {pol.drafting_margin():.3f}")
