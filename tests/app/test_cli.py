"""The command line: `minillm generate` streams the same text the engine produces; --help needs no torch."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import app.cli
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


def test_serve_refuses_bad_flags_before_granian_starts(default_model_dir, monkeypatch, capsys) -> None:
    """A bad flag ends `minillm serve` at once, with status 2 and the line `minillm generate` prints,
    rather than a server that listens but never gets ready."""
    import granian

    monkeypatch.setattr(granian, "Granian", lambda *args, **kwargs: pytest.fail("Granian started"))
    for flags in (["--model", "/no/such/model"], ["--model", str(default_model_dir), "--kv-cache-memory", "lots"]):
        assert main(["generate", *flags, "--max-tokens", "1", "hi"]) == 2
        expected = capsys.readouterr().err
        assert main(["serve", *flags]) == 2
        assert capsys.readouterr().err == expected and expected.startswith("minillm: ") and expected.count("\n") == 1
    for flags, says in ((["--tool-call-parser", "nope"], "hermes, mistral, llama3, generic"),
                        (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
                        (["--device", "gpu"], "--device must be"), (["--log-level", "loud"], "--log-level must be")):
        assert main(["serve", "--model", str(default_model_dir), *flags]) == 2
        assert says in capsys.readouterr().err


def test_quantize_writes_a_model_that_generates(default_model_dir, tmp_path, capsys) -> None:
    """`minillm quantize` end to end on the embedded model (round-to-nearest: AWQ's search takes a
    minute on 30 layers; tests/engine/quantization/ runs it on a tiny model)."""
    out = tmp_path / "int4"
    assert main(["quantize", "--model", str(default_model_dir), "--method", "rtn", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["group_size"] == 32  # the blocks of the Q4_1 GGUF it came from
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert main(["generate", "--model", str(out), "--temperature", "0", "--max-tokens", "8", "--kv-cache-memory",
                 "64MiB", "What is the capital of France?"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_quantize_awq_with_few_calibration_tokens(tiny_model_dir, default_model_dir, tmp_path, capsys) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir("tiny-llama3", vocab_size=49152)[0], src)
    shutil.copy(default_model_dir / "tokenizer.json", src)
    shutil.copy(default_model_dir / "tokenizer_config.json", src)
    assert main(["quantize", "--model", str(src), "--method", "awq", "--group-size", "32", "--calibration-tokens",
                 "64", "--out", str(tmp_path / "q")]) == 0
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    (tmp_path / "mine.txt").write_text("Four score and seven years ago our fathers brought forth on this continent. " * 4)
    assert main(["quantize", "--model", str(src), "--method", "fp8-gptq", "--calibration-text",
                 str(tmp_path / "mine.txt"), "--out", str(tmp_path / "p")]) == 0
    assert main(["quantize", "--model", str(src), "--method", "awq", "--calibration-text",
                 str(tmp_path / "none.txt"), "--out", str(tmp_path / "s")]) == 2
    assert "none.txt is not a file" in capsys.readouterr().err
    assert main(["quantize", "--model", str(src), "--group-size", "48", "--out", str(tmp_path / "r")]) == 2
    assert "group size 48" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"], ["quantize", "--help"]])
def test_help_imports_no_torch_and_shows_defaults(argv: list[str]) -> None:
    """--help answers without importing torch (seconds of start-up), and every flag shows its default."""
    check = (f"import sys, app.cli\n"
             f"try:\n    app.cli.main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
             f"assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    entries: list[str] = []  # each option's help, its wrapped lines joined
    for line in done.stdout.splitlines():
        if line.startswith("  -"):
            entries.append(line)
        elif entries and line.startswith("    "):
            entries[-1] += " " + line.strip()
    assert entries
    for entry in entries:
        if not entry.lstrip().startswith(("-h, --help", "--out")):  # --out is required: it has no default
            assert "(default" in entry, entry


def test_serves_process_imports_neither_torch_nor_the_app(default_model_dir) -> None:
    """`minillm serve`'s own process checks the flags and starts Granian without importing torch,
    xgrammar or the app: Granian forks its worker from this process, which imports them itself, beside
    the grammar worker's fork server (and starts CUDA, which a fork must not inherit)."""
    check = f"""if True:
        import sys, granian, app.cli
        def started(*args, **kwargs):  # where Granian would fork its worker
            sys.exit(", ".join(m for m in ("torch", "xgrammar", "transformers", "app.server") if m in sys.modules) or 0)
        granian.Granian = started
        app.cli.main(["serve", "--model", {str(default_model_dir)!r}, "--tool-call-parser", "hermes"])
        sys.exit("Granian never started")
    """
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr


def test_tool_call_parser_names_are_the_formats() -> None:
    from app.settings import TOOL_CALL_PARSERS
    from app.tools import TOOL_FORMATS

    assert TOOL_CALL_PARSERS == tuple(TOOL_FORMATS)


def test_quantize_defaults_match_the_engine() -> None:
    """The parser's quantize defaults are plain values (no torch for --help); they must be the engine's."""
    from engine.quantization import CALIBRATION_TOKENS, METHODS, TUNE_STEPS

    assert app.cli.QUANTIZE_METHODS == tuple(METHODS)
    assert app.cli.CALIBRATION_TOKENS == CALIBRATION_TOKENS
    assert app.cli.TUNE_STEPS == TUNE_STEPS
