"""The command line: `minillm generate` streams the same text the engine produces."""
from __future__ import annotations

import pytest

from app.cli import main
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def test_generate_prints_the_engines_text(default_model_dir, capsys) -> None:
    prompt = "Name a primary colour."
    assert main(["generate", "--model", str(default_model_dir), "--temperature", "0", "--max-tokens", "12",
                 "--kv-cache-memory", "64MiB", prompt]) == 0
    printed = capsys.readouterr()
    [expected] = LLMEngine(EngineConfig(model=str(default_model_dir), kv_cache_memory="64MiB")).generate(
        [[{"role": "user", "content": prompt}]], SamplingParams(temperature=0, max_tokens=12)
    )
    assert printed.out == expected.text + "\n" and expected.text
    assert "tokens]" in printed.err


def test_bad_flags_give_a_clear_error(default_model_dir, capsys) -> None:
    assert main(["generate", "--model", "/no/such/model", "hi"]) == 2
    assert "/no/such/model" in capsys.readouterr().err
    assert main(["generate", "--model", str(default_model_dir), "--top-p", "3", "hi"]) == 2
    assert "top_p" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
