"""Offline quickstart on the embedded default: SmolLM2-135M-Instruct + its DFlash drafter, no Hub access.

python examples/quickstart_offline.py
"""

import torch

import hf_blockpilot  # noqa: F401  (routes generate(assistant_model=<drafter>) to block-diffusion drafting)
from hf_blockpilot.tools.loading import load_default_target, resolve_drafter, resolve_policy

target, tokenizer = load_default_target()
drafter = resolve_drafter()  # the embedded drafter
drafter.set_policy(resolve_policy("default"))  # the embedded BlockPilot policy picks the block size per request

messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)

plain = target.generate(**inputs, max_new_tokens=96, do_sample=False)
fast = target.generate(
    **inputs, assistant_model=drafter, max_new_tokens=96, do_sample=False, return_dict_in_generate=True
)
assert torch.equal(plain, fast.sequences), "greedy block-diffusion decoding must equal plain generate"
print(tokenizer.decode(fast.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
stats = fast.speculation_stats  # this call's own statistics
print(
    f"block size {stats.block_size}, tau {stats.tau:.2f}, "
    f"{stats.target_forwards} target forwards for {stats.new_tokens} tokens"
)
