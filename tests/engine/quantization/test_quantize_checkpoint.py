"""quantize_checkpoint's refusals: each argument it cannot act on named before any work is done."""
from __future__ import annotations

import pytest

from engine.errors import ModelLoadError
from engine.models.config import parse_quantization
from engine.quantization import quantize_checkpoint
from tests.engine.quantization.conftest import _float_and_awq_by_hand


def test_quantize_refuses_what_it_cannot_do(tiny_model_dir, tiny_with_tokenizer, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="group size 48 does not fit"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "a", "rtn", group_size=48)
    with pytest.raises(ModelLoadError, match="tune_steps must be 0"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "a", "awq", tune_steps=-1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ModelLoadError, match="not an empty directory"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "full", "rtn")
    with pytest.raises(ModelLoadError, match="has none"):  # AWQ needs a tokenizer for its calibration text
        quantize_checkpoint(str(tiny_model_dir("tiny-llama3")[0]), tmp_path / "b", "awq")
    _, awq_dir = _float_and_awq_by_hand(tiny_model_dir("tiny-llama3")[0], tmp_path)
    with pytest.raises(ModelLoadError, match="already quantized"):
        quantize_checkpoint(str(awq_dir), tmp_path / "c", "rtn")
    with pytest.raises(ModelLoadError, match="leave --group-size out"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "d", "fp8-gptq", group_size=32)
    with pytest.raises(ModelLoadError, match="--lm-head is for int4"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "e", "fp8-gptq", lm_head=True)
    with pytest.raises(ModelLoadError, match="is not a file"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "f", "awq", calibration_text=tmp_path / "missing.txt")
    (tmp_path / "one.txt").write_text("a")
    with pytest.raises(ModelLoadError, match="rtn reads no calibration text"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "f", "rtn", calibration_text=tmp_path / "one.txt")
    with pytest.raises(ModelLoadError, match="at least 2 tokens"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "f", "fp8-gptq", calibration_text=tmp_path / "one.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ModelLoadError, match="cannot read calibration text"):
        quantize_checkpoint(str(tiny_with_tokenizer), tmp_path / "f", "fp8-gptq", calibration_text=tmp_path / "latin1.txt")
    assert not (tmp_path / "f").exists()
    assert parse_quantization(None) is None
