"""bench/host_step.py's smoke run: the stubbed engine decodes its batch (every sequence one token a
step), and the table and the profile print."""
from __future__ import annotations

import re

from bench.host_step import stubbed_engine


def test_the_stubbed_engine_decodes_every_sequence_a_token_a_step() -> None:
    engine = stubbed_engine(3)
    before = [len(r.sequences[0].token_ids) for r in engine.requests.values()]
    for _ in range(4):
        engine.step()
    after = [len(r.sequences[0].token_ids) for r in engine.requests.values()]
    assert [a - b for a, b in zip(after, before)] == [4, 4, 4]  # placeholders included: one a step
    for request in engine.requests.values():  # the collected ids carry on the prompt's cycle, then a placeholder
        *collected, last = request.sequences[0].output_token_ids
        assert collected == request.prompt_token_ids[:len(collected)] and len(collected) >= 4 and last < 0
    engine.close()


def test_with_drafts_every_step_verifies_and_confirms_them() -> None:
    engine = stubbed_engine(2, method="ngram")
    before = [len(r.sequences[0].token_ids) for r in engine.requests.values()]
    for _ in range(6):
        engine.step()
    after = [len(r.sequences[0].token_ids) for r in engine.requests.values()]
    assert engine.draft_tokens_total == engine.accepted_draft_tokens_total >= 2 * 5 * 4  # 4 drafts a step, all kept
    assert min(a - b for a, b in zip(after, before)) >= 5 * 5
    for request in engine.requests.values():
        output = request.sequences[0].output_token_ids
        assert output == request.prompt_token_ids[:len(output)]
    engine.close()


def test_host_step_smoke_prints_a_row_a_batch_and_the_profile(run_script, capsys) -> None:
    code = run_script("host_step.py", "--batches", "1", "2", "--steps", "3", "--reps", "1", "--profile", "3")
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|$", captured.out, re.M)
    assert [b for b, _, _ in rows] == ["1", "2"] and all(float(us) > 0 and float(launch) > 0 for _, us, launch in rows)
    assert captured.out.count("steps under cProfile") == 2
