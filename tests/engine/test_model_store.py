"""The model store: the default model converts once into a loadable Hugging Face directory."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import model_store
from engine.errors import ModelLoadError
from engine.model_store import (
    COMPLETE_MARKER,
    DEFAULT_MODEL,
    GGUF_BLOCK,
    ensure_default_model,
    models_dir,
    resolve_model,
    source_block_size,
)

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_default_model_loads_with_transformers(default_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(default_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)
    assert ids["input_ids"][0] == tokenizer.bos_token_id == 1
    assert ids["input_ids"].count(tokenizer.eos_token_id) == 2  # one <|im_end|> per message


def test_default_model_layout(default_model_dir: Path) -> None:
    names = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", COMPLETE_MARKER} <= names

    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True

    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)

    with safe_open(default_model_dir / "model.safetensors", framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"F32"}


def test_second_call_does_not_convert_again(default_model_dir: Path) -> None:
    marker_mtime = (default_model_dir / COMPLETE_MARKER).stat().st_mtime_ns
    start = time.monotonic()
    assert ensure_default_model(default_model_dir, progress=False) == default_model_dir
    assert time.monotonic() - start < 1.0
    assert (default_model_dir / COMPLETE_MARKER).stat().st_mtime_ns == marker_mtime


def test_resolve_default_uses_models_dir(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINILLM_MODELS_DIR", str(default_model_dir.parent))
    assert models_dir() == default_model_dir.parent
    assert resolve_model(DEFAULT_MODEL) == default_model_dir


def test_models_dir_defaults_to_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINILLM_MODELS_DIR", raising=False)
    assert models_dir() == Path.home() / ".cache" / "minillm" / "models"


def test_wrong_checksum_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_store, "GGUF_SHA256", "0" * 64)
    target = tmp_path / "default"
    (tmp_path / ".default.tmp-killed").mkdir()  # left by a converter that was killed
    with pytest.raises(ModelLoadError) as info:
        ensure_default_model(target, progress=False)
    assert "0" * 64 in info.value.message
    assert "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" in info.value.message
    assert not target.exists()
    # Neither the orphan nor a half-written directory of our own is left behind.
    assert [p.name for p in tmp_path.iterdir()] == ["default.lock"]


def test_the_kernels_package_clash_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers >= 5.25 imports the PyPI package `kernels`, whose name our kernels/ package takes.
    def clash(*args, **kwargs):
        raise ImportError("cannot import name 'CUDAProperties' from 'kernels' (/src/kernels/__init__.py)")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", clash)
    with pytest.raises(ModelLoadError, match="pip uninstall kernels"):
        model_store._load_gguf(tmp_path / "model.gguf", progress=False)


def test_a_directory_we_did_not_write_is_not_taken_or_deleted(tmp_path: Path) -> None:
    target = tmp_path / "default"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "notes.txt").write_text("mine")  # no conversion writes this: someone else's directory
    with pytest.raises(ModelLoadError, match=f"{target}.*notes.txt"):
        ensure_default_model(target, progress=False)
    assert (target / "config.json").exists() and (target / "notes.txt").exists()


def test_a_conversion_cut_short_is_removed_and_done_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "default"
    target.mkdir()  # half-written, without the marker: a copy or a conversion that was cut off
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"\0" * 64)
    orphan = tmp_path / ".default.tmp-killed"  # a converter killed mid-write
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"\0" * 64)
    seen: list[list[str]] = []

    def convert(into: Path, progress: bool) -> None:  # stands in for the 30 s dequantization
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        into.mkdir()
        (into / COMPLETE_MARKER).write_text("{}")

    monkeypatch.setattr(model_store, "_convert", convert)
    assert ensure_default_model(target, progress=False) == target
    assert seen == [["default.lock"]]  # both leftovers were gone before converting again
    assert [p.name for p in target.iterdir()] == [COMPLETE_MARKER]


def test_waits_for_a_concurrent_conversion(tmp_path: Path) -> None:
    target = tmp_path / "default"
    other = FileLock(str(tmp_path / "default.lock"))
    other.acquire()  # stands in for another process mid-conversion
    result: list[Path] = []
    waiter = threading.Thread(target=lambda: result.append(ensure_default_model(target, False)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not target.exists()
    target.mkdir()
    (target / COMPLETE_MARKER).write_text("{}")
    other.release()
    waiter.join(timeout=5)
    assert result == [target]


def test_resolve_existing_directory_is_itself(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path


def test_resolve_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        resolve_model(str(missing))


def test_source_block_size_is_the_embedded_ggufs_for_its_conversion_only(default_model_dir: Path, tmp_path: Path) -> None:
    # Q4_1 quantized the default model's rows in blocks of 32: its conversion says so, other directories do not.
    assert source_block_size(default_model_dir) == GGUF_BLOCK == 32
    assert source_block_size(tmp_path) is None
    (tmp_path / COMPLETE_MARKER).write_text(json.dumps({"source": "other.gguf", "sha256": "0" * 64}))
    assert source_block_size(tmp_path) is None
    (tmp_path / COMPLETE_MARKER).write_text("not json")
    assert source_block_size(tmp_path) is None
