"""bench/host_step.py's smoke run: the stubbed engine decodes its batch (every sequence one token a
step), and the table and the profile print."""
from __future__ import annotations

import re
import statistics
import time

import pytest

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
    for request in engine.requests.values():  # the drafts in flight stand in its tokens: the real ones
        seq = request.sequences[0]
        output = seq.token_ids[seq.num_prompt_tokens:seq.num_real_tokens]
        assert output == request.prompt_token_ids[:len(output)]
    engine.close()


def test_the_simulated_device_and_the_model_that_deviates_keep_outputs_exact() -> None:
    # Where the stub model leaves its cycle, drafts are rejected; steps that go ahead of them roll
    # back. Outputs are the same with and without going ahead, and the device's time is waited for.
    outputs = []
    for overlap in (False, True):
        engine = stubbed_engine(1, method="ngram", device_us=500, deviate=0.1, overlap=overlap)
        if overlap:
            engine.scheduler.lookahead.min_progress = 0.0
            engine.scheduler.lookahead.gate = None
            engine.scheduler.lookahead.record = lambda host, device: None
        [request] = engine.requests.values()
        start = time.perf_counter()
        for _ in range(30):
            engine.step()
        assert time.perf_counter() - start >= 25 * 500e-6  # serial forwards, each waited for once read
        seq = request.sequences[0]
        outputs.append(seq.token_ids[:seq.num_real_tokens])
        assert engine.draft_tokens_total > engine.accepted_draft_tokens_total > 0
        engine.close()
    shorter = min(map(len, outputs))
    assert shorter > 128 + 30 and outputs[0][:shorter] == outputs[1][:shorter]
    assert any(a != b for a, b in zip(outputs[0][128:shorter], outputs[0][128 + 16:shorter]))  # it deviated


def test_the_lookahead_measures_the_hosts_work_and_the_devices_step() -> None:
    # Sequences that the stub model leaves often wait for their steps with drafts; those are timed.
    engine = stubbed_engine(1, method="ngram", device_us=2000, deviate=0.2, overlap=True)
    for _ in range(40):
        engine.step()
    lookahead = engine.scheduler.lookahead
    # The simulated step is 2 ms; a loaded two-core machine (two test workers) stretches the waits.
    assert 1.8e-3 <= lookahead.device < 8e-3 and 0 < lookahead.host < lookahead.device
    assert lookahead.min_progress == pytest.approx(lookahead.device / (lookahead.device + lookahead.host))  # host < device
    engine.close()


def test_the_lookaheads_gate_times_steps_that_went_ahead_and_steps_that_waited() -> None:
    engine = stubbed_engine(1, method="ngram", device_us=300, deviate=0.02, overlap=True)
    lookahead = engine.scheduler.lookahead
    recorded = []
    record = lookahead.gate.record
    lookahead.gate.record = lambda trial, batch, tokens, seconds: (recorded.append((trial, tokens, seconds)),
                                                                  record(trial, batch, tokens, seconds))
    for _ in range(100):
        engine.step()
    went, waited = [r for r in recorded if r[0]], [r for r in recorded if not r[0]]
    assert len(went) >= 4 and len(waited) >= 4
    # Each step is a serial forward of 300 µs: one that waited also took the host's work before it.
    assert min(s for _, _, s in waited) > 300e-6
    assert statistics.median(s for _, _, s in went) < statistics.median(s for _, _, s in waited)
    engine.close()


def test_host_step_smoke_prints_a_row_a_batch_and_the_profile(run_script, capsys) -> None:
    code = run_script("host_step.py", "--batches", "1", "2", "--steps", "3", "--reps", "1", "--profile", "3")
    captured = capsys.readouterr()
    assert code == 0, captured.err[-4000:]
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| ([\d.]+) \| ([\d,]+) \|$", captured.out, re.M)
    assert [b for b, _, _, _ in rows] == ["1", "2"]
    assert all(float(us) > 0 and float(launch) > 0 and int(rate.replace(",", "")) > 0 for _, us, launch, rate in rows)
    assert captured.out.count("steps under cProfile") == 2
