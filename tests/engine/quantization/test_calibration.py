"""The calibration text and its sequences."""
from __future__ import annotations

from engine.quantization.calibration import calibration_sequences
from engine.tokenizer import Tokenizer


def test_calibration_sequences_read_the_given_text(tiny_with_tokenizer, tmp_path) -> None:
    """The shipped text by default (the Declaration first), or the given file's, cut at max_tokens
    into sequences of up to seq_len."""
    tokenizer = Tokenizer.from_dir(tiny_with_tokenizer)
    shipped = calibration_sequences(tokenizer, 40, seq_len=16)
    assert [len(s) for s in shipped] == [16, 16, 8]
    assert tokenizer.decode(shipped[0]).startswith("In Congress, July 4, 1776.")
    text = tmp_path / "mine.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    mine = calibration_sequences(tokenizer, 1000, seq_len=64, text=text)
    assert [t for s in mine for t in s] == tokenizer.encode(text.read_text())
