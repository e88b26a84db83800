"""Can several rows of a bfloat16 verify cost less than as many one-row products, and still round as one row?

    python scripts/bf16_rows_bench.py --out runs/bf16-rows.json

Builds the package's `kernels/bf16_rows.cpp` (`hf_blockpilot.row_kernel`; needs a C++ compiler and ninja),
which computes each row's outputs with the operations of PyTorch's one-row CPU bfloat16 kernel in the same
order, but converts each weight row to float32 once for all rows. Then, on this machine:
1. exactness: every output of 16-row products against `F.linear` of each row alone, per SmolLM2-135M weight shape
   (and two shapes with remainders), three input scales, for the kernel's lane widths 8 (AVX2) and 16 (AVX-512);
2. speed of one linear: `F.linear` vs the kernel for 1 / 4 / 16 rows;
3. the embedded target in bfloat16: an n-token forward after a prefill with every linear of more than one row on
   the kernel, logits checked equal to the stock forward, time in one-token steps (stock attention, not the exact
   path's slot-wise attention: `hf-blockpilot calibrate` times that path as `generate` runs it). Prints a table
   and writes JSON. Offline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from hf_blockpilot.cli import build_parser
from hf_blockpilot.cli._common import load_models
from hf_blockpilot.data import chat_inputs
from hf_blockpilot.device_calibration import cpu_description
from hf_blockpilot.row_kernel import SWITCH, extension

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (100, 100), (64, 40)]


def median_ms(run, repeats: int = 15) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def exactness(kernel) -> dict[str, int]:
    generator = torch.Generator().manual_seed(0)
    mismatches = {}
    for out, inp in SHAPES:
        weight = torch.randn(out, inp, generator=generator).to(torch.bfloat16)
        for scale in (1.0, 8.0, 0.125):
            x = (scale * torch.randn(16, inp, generator=generator)).to(torch.bfloat16)
            alone = torch.cat([F.linear(x[i : i + 1], weight) for i in range(16)])
            for width in (8, 16):
                key = f"{out}x{inp}, width {width}"
                wrong = int((kernel.linear_rows(x, weight, width) != alone).sum())
                mismatches[key] = mismatches.get(key, 0) + wrong
    return mismatches


def linear_speed(kernel, width: int) -> dict[str, dict[str, float]]:
    speed = {}
    for out, inp in SHAPES[:5]:
        weight = torch.randn(out, inp).to(torch.bfloat16)
        for rows in (1, 4, 16):
            x = torch.randn(rows, inp).to(torch.bfloat16)
            speed[f"{out}x{inp}, {rows} rows"] = {
                "stock_ms": median_ms(lambda x=x, weight=weight: F.linear(x, weight)),
                "kernel_ms": median_ms(lambda x=x, weight=weight: kernel.linear_rows(x, weight, width)),
            }
    return speed


def model_speed(kernel, width: int, prompt: str) -> dict[str, dict[str, float]]:
    cli = build_parser().parse_args(["generate", prompt, "--dtype", "bfloat16"])
    target, tokenizer, _ = load_models(cli, prompts=[prompt])
    ids = chat_inputs(tokenizer, prompt, target.device)
    use_kernel = {"on": False}

    def forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if use_kernel["on"] and rows > 1 and module.bias is None:
            return kernel.linear_rows(x.reshape(rows, -1), module.weight, width).reshape(*x.shape[:-1], -1)
        return F.linear(x, module.weight, module.bias)

    for module in target.modules():  # this script's own model: nothing else sees the change
        if type(module) is torch.nn.Linear:
            module.forward = partial(forward, module)
    cache = DynamicCache(config=target.config)
    length = ids.shape[1]
    tokens = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(1))

    def step(n: int, on: bool) -> torch.Tensor:
        use_kernel["on"] = on
        positions = torch.arange(length, length + n)[None]
        out = target(input_ids=tokens[:, :n], cache=cache, position_ids=positions, logits_to_keep=n, use_cache=True)
        cache.crop(-n)
        return out.logits

    times: dict[tuple[int, bool], list[float]] = {}
    with torch.no_grad():
        target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        equal = {n: bool(torch.equal(step(n, True), step(n, False))) for n in (2, 4, 8)}
        for _ in range(9):  # every configuration once a round, so a drift of the host's speed moves all alike
            for n in (1, 2, 4, 8):
                for on in (False, True):
                    start = time.perf_counter()
                    step(n, on)
                    times.setdefault((n, on), []).append(time.perf_counter() - start)
    one = statistics.median(times[(1, False)])
    return {
        f"{n} tokens": {
            "stock_steps": statistics.median(times[(n, False)]) / one,
            "kernel_steps": statistics.median(times[(n, True)]) / one,
            "logits_equal": equal.get(n, True),
        }
        for n in (1, 2, 4, 8)
    } | {"one_token_step_ms": one * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bf16-rows.json")
    parser.add_argument("--prompt", default="Write a Python function that checks whether a string is a palindrome.")
    args = parser.parse_args()
    kernel = extension()
    if kernel is None:
        raise SystemExit(f"the kernel is switched off ({SWITCH}=0) or could not be built: see the warning above")
    name, flags = cpu_description()
    width = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
    result = {
        "machine": " ".join([name, *flags]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mismatches_of_16_rows": exactness(kernel),
        "linear_ms": linear_speed(kernel, width),
        "target_forward": model_speed(kernel, width, args.prompt),
    }
    for key, wrong in result["mismatches_of_16_rows"].items():
        print(f"exactness {key}: {wrong} outputs differ from one-row F.linear")
    for key, row in result["linear_ms"].items():
        print(f"linear {key}: stock {row['stock_ms']:.3f} ms, kernel {row['kernel_ms']:.3f} ms")
    forward = result["target_forward"]
    print(f"target forward, one-token step {forward['one_token_step_ms']:.1f} ms")
    for key, row in forward.items():
        if isinstance(row, dict):
            print(
                f"  {key}: stock {row['stock_steps']:.2f} steps, kernel {row['kernel_steps']:.2f}, "
                f"logits equal {row['logits_equal']}"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
