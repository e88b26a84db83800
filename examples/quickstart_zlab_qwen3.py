"""Quickstart with a public z-lab DFlash drafter for Qwen3-4B (needs Hub access and, ideally, a GPU).

python examples/quickstart_zlab_qwen3.py [--policy <BlockPilot policy repo or dir>]
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_blockpilot  # noqa: F401
from hf_blockpilot import BlockDiffusionDrafter

parser = argparse.ArgumentParser()
parser.add_argument("--target", default="Qwen/Qwen3-4B")
parser.add_argument("--drafter", default="z-lab/Qwen3-4B-DFlash-b16")
parser.add_argument("--policy", default=None, help="a BlockPilot policy trained for this pair (Hub id or dir)")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
tokenizer = AutoTokenizer.from_pretrained(args.target)
drafter = BlockDiffusionDrafter.from_pretrained(args.drafter, dtype=dtype, policy=args.policy).to(device).eval()

messages = [{"role": "user", "content": "Implement binary search in Python and explain it briefly."}]
inputs = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True, enable_thinking=False
).to(device)
out = target.generate(
    **inputs, assistant_model=drafter, max_new_tokens=512, do_sample=False, return_dict_in_generate=True
)
print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
print(out.speculation_stats.to_dict())
