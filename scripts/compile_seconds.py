"""Compile seconds of `generate(..., compile=True)`: the first call minus the fastest of two later ones (compilation
and the compiled-cost timing), embedded pair, bfloat16, b = 4, one HumanEval prompt, 64 tokens; the eager
calibration runs first, untimed. `PYTHONPATH=<tree>` picks the package version (e.g. a worktree of an older commit):

    PYTHONPATH=/tmp/hf-blockpilot-old python scripts/compile_seconds.py
"""

import json
import time
import warnings

import hf_blockpilot
from hf_blockpilot.data import chat_inputs, load_prompts
from hf_blockpilot.tools.loading import load_default_target, resolve_drafter

warnings.simplefilter("ignore")
target, tok = load_default_target(dtype="bfloat16")
drafter = resolve_drafter(None, dtype="bfloat16")
ids = chat_inputs(tok, load_prompts("humaneval", 1)[0].prompt, target.device)
gen = dict(max_new_tokens=64, do_sample=False, assistant_model=drafter, draft_controller=4, compile=True)
target.generate(ids, assistant_model=drafter, draft_controller=4, max_new_tokens=8)  # eager calibration, untimed
times = []
for _ in range(3):
    start = time.perf_counter()
    target.generate(ids, **gen)
    times.append(time.perf_counter() - start)
first, later = times[0], times[1:]
report = {"package": hf_blockpilot.__file__, "first_s": first, "later_s": later, "compile_s": first - min(later)}
print(json.dumps(report))
