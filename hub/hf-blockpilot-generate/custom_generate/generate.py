"""Block-diffusion (DFlash) speculative decoding with a per-request block size, as a Hub `custom_generate` repo:

    out = target.generate(**inputs, custom_generate="<this repo>", trust_remote_code=True, assistant_model=drafter)

`drafter` is a `hf_blockpilot.BlockDiffusionDrafter` (e.g. `BlockDiffusionDrafter.from_pretrained(
"z-lab/Qwen3-4B-DFlash-b16")`); `draft_controller=` optionally steers the width per round. The decoding loop is
hf-blockpilot's (`hf_blockpilot.generate`, reached through Transformers' callable `custom_generate`).
"""

import hf_blockpilot


def generate(model, assistant_model=None, drafter=None, draft_controller=None, streamer=None, **kwargs):
    if streamer is not None:
        raise ValueError(
            "this custom_generate repo does not stream: call generate(assistant_model=drafter, streamer=...) after "
            "`import hf_blockpilot` instead"
        )
    return model.generate(
        custom_generate=hf_blockpilot.generate,
        drafter=assistant_model if assistant_model is not None else drafter,
        draft_controller=draft_controller,
        **kwargs,
    )
