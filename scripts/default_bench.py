"""Default vs plain `generate` vs unguarded fixed widths, bfloat16, embedded pair, per prompt, interleaved repeats.

python scripts/default_bench.py [prompts per set] [repeats] [out.json]
"""

import json
import statistics
import sys
import time

import torch

import hf_blockpilot  # noqa: F401  (routes generate(assistant_model=drafter))
from hf_blockpilot.data import chat_inputs, load_prompts
from hf_blockpilot.device_calibration import describe_device
from hf_blockpilot.tools.loading import load_default_target, resolve_drafter, resolve_policy

N = int(sys.argv[1]) if len(sys.argv) > 1 else 4
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
dtype = "bfloat16"
records = load_prompts("humaneval", N) + load_prompts("mtbench", N)
target, tok = load_default_target(dtype=dtype)
prompts = [chat_inputs(tok, r.prompt, target.device) for r in records]
drafter = resolve_drafter(None, dtype=dtype)
drafter.set_policy(resolve_policy("default", prompt_lookup=False))
bare = resolve_drafter(None, dtype=dtype)
gen = dict(max_new_tokens=96, do_sample=False)
configs = {"plain": None, "default": (drafter, None), "b=2": (bare, 2), "b=3": (bare, 3)}


def run(cfg, ids):
    if cfg is None:
        return target.generate(ids, **gen), None
    d, c = cfg
    out = target.generate(ids, assistant_model=d, draft_controller=c, return_dict_in_generate=True, **gen)
    return out.sequences, out.speculation_stats


want = [run(None, ids)[0] for ids in prompts]
stats = {}
for name, cfg in configs.items():
    for i, ids in enumerate(prompts):
        seq, st = run(cfg, ids)
        if not torch.equal(seq, want[i]):
            print("MISMATCH", name, i)
        if st is not None:
            stats[(name, i)] = (st.block_size, round(st.tau, 2), st.drafter_forwards, st.plain_rounds)
secs = {(n, i): [] for n in configs for i in range(len(prompts))}
for _ in range(REPEATS):
    for i, ids in enumerate(prompts):
        for name, cfg in configs.items():
            t = time.perf_counter()
            run(cfg, ids)
            secs[(name, i)].append(time.perf_counter() - t)
med = {k: statistics.median(v) for k, v in secs.items()}
report = {"device": describe_device(target.device), "threads": torch.get_num_threads(), "dtype": dtype, "rows": []}
indices = range(len(prompts))
for name in configs:
    per = [med[("plain", i)] / med[(name, i)] for i in indices]
    total = sum(med[("plain", i)] for i in indices) / sum(med[(name, i)] for i in indices)
    print(
        f"{name:8s} total {total:.3f}x plain  min {min(per):.3f} median {statistics.median(per):.3f}  ",
        [round(p, 2) for p in per],
    )
    stats_of = [stats.get((name, i)) for i in indices]
    report["rows"].append({"config": name, "vs_plain": total, "per_prompt": per, "stats": stats_of})
for k, v in stats.items():
    if k[0] == "default":
        print(k, v)
if len(sys.argv) > 3:
    with open(sys.argv[3], "w") as f:
        json.dump(report, f, indent=2)
