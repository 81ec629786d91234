"""bench/spec_composed.py: its replay of the engine's drafting policy makes the drafts the engine
makes, and its composed run writes the agreed JSON."""
from __future__ import annotations

import json
from pathlib import Path

from bench.spec_composed import PLAIN, WAITED, compose, replay
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import NgramProposer, SuffixProposer

WORKLOADS = json.loads((Path(__file__).resolve().parents[2] / "bench" / "data" / "spec_workloads.json").read_text())


def test_replay_drafts_and_accepts_what_the_engine_does(default_model_dir: Path) -> None:
    chat = WORKLOADS["workloads"]["agent_loop"]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLMEngine(EngineConfig(model=str(default_model_dir), device="cpu"))
    prompt = list(plain.make_request(chat, params).prompt_token_ids)
    text = plain.generate([chat], params)[0].token_ids
    spec = LLMEngine(EngineConfig(model=str(default_model_dir), device="cpu", speculative_method="ngram",
                                  num_speculative_tokens=4))
    for proposer in (NgramProposer(4), SuffixProposer(4)):
        spec.scheduler.proposer = proposer
        before = spec.stats()
        assert spec.generate([chat], params)[0].token_ids == text
        after = spec.stats()
        replayed = replay(type(proposer)(4), prompt, list(text), params.max_tokens)
        assert after.draft_tokens - before.draft_tokens == replayed["drafted"] > 0
        assert after.accepted_draft_tokens - before.accepted_draft_tokens == replayed["accepted"] > 0
        # Each step emits a token and its accepted drafts (the last step's drafts may end with the text).
        assert sum(replayed["steps"].values()) + replayed["accepted"] - replayed["tokens"] in (0, 1)
        assert replayed["tokens"] == len(text) - 1


def test_compose_prices_each_step_by_its_kind() -> None:
    costs = {PLAIN: 1.0, WAITED: 1.5, "4": 2.0}
    assert compose({PLAIN: 2, WAITED: 2, "4": 2}, 12, costs) == 12 / (2 + 3 + 4)


def test_spec_composed_replays_the_references(tmp_path: Path, run_script, capsys, default_model_dir: Path) -> None:
    costs = tmp_path / "costs.json"
    kinds = {PLAIN: 1.0, WAITED: 1.2, **{str(d): 1.2 + 0.1 * d for d in range(1, 5)}}
    costs.write_text(json.dumps({"costs": {"shape": {kind: {"ms": ms} for kind, ms in kinds.items()}}}))
    out = tmp_path / "composed.json"
    code = run_script("spec_composed.py", "--costs", str(costs), "--tokenizer", str(default_model_dir),
                      "--out", str(out))
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "spec_composed" and doc["composed"] and doc["commit"] and doc["texts"] == "references"
    rows = {(r["workload"], r["method"]): r for r in doc["rows"]}
    assert set(rows) == {(w, m) for w in WORKLOADS["workloads"] for m in ("ngram", "suffix")}
    for row in rows.values():
        assert row["speedups"]["shape"] == round(compose(row["steps"], row["tokens"], kinds), 3)
    # The references repeat their prompts, but for the open chat's: its drafts are few and mostly rejected.
    assert rows["grounded_qa", "suffix"]["accepted"] / rows["grounded_qa", "suffix"]["drafted"] > 0.8
    assert rows["agent_loop", "ngram"]["speedups"]["shape"] > 1.5
    assert "| code_edit | ngram |" in captured.out


def test_spec_composed_measure_smoke_prices_every_kind_of_step(tmp_path: Path, run_script, capsys) -> None:
    out = tmp_path / "costs.json"
    code = run_script("spec_composed.py", "--measure", "--device", "cpu", "--shapes", "tiny-llama3", "--batches",
                      "1,2", "--steps", "2", "--rounds", "2", "--out", str(out))
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "spec_costs" and doc["device"] == "cpu" and doc["commit"] and doc["batches"] == [1, 2]
    costs = doc["costs"]
    assert set(costs) == {"tiny-llama3", "tiny-llama3 batch 2"}
    assert set(costs["tiny-llama3"]) == {PLAIN, WAITED, "1", "2", "3", "4"}
    assert set(costs["tiny-llama3 batch 2"]) == {PLAIN, WAITED, "4"}
    assert all(len(v["runs"]) == 2 and v["ms"] > 0 for by_kind in costs.values() for v in by_kind.values())
