"""Block-diffusion (DFlash) speculative decoding with a per-request block size, as a Hub `custom_generate` repo:

    out = target.generate(**inputs, custom_generate="<this repo>", trust_remote_code=True, assistant_model=drafter)

`drafter` is a `hf_blockpilot.BlockDiffusionDrafter` (e.g. `BlockDiffusionDrafter.from_pretrained(
"z-lab/Qwen3-4B-DFlash-b16")`); `draft_controller=` optionally steers the width per round. The decoding loop is
hf-blockpilot's (`hf_blockpilot.generate`, reached through Transformers' callable `custom_generate`); streamers,
stop strings and every other `generate` argument work as with `generate(assistant_model=drafter)`.
"""

from hf_blockpilot.routing import generate_with_drafter


def generate(model, assistant_model=None, drafter=None, **kwargs):
    return generate_with_drafter(
        model, assistant_model=assistant_model if assistant_model is not None else drafter, **kwargs
    )
