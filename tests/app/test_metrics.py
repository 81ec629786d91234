"""The engine's counters as Prometheus families (the HTTP side: tests/app/test_http.py)."""
from __future__ import annotations

from prometheus_client import generate_latest

from app.metrics import Metrics
from engine.llm_engine import EngineStats


def stats(**kw) -> EngineStats:
    return EngineStats(running=1, waiting=0, kv_blocks_used=2, kv_blocks_total=10, kv_bytes_per_block=64,
                       prefix_cache_queries=0, prefix_cache_hits=0, preemptions=0, prompt_tokens=5,
                       computed_prompt_tokens=5, generation_tokens=9, constrained_requests=0,
                       grammar_mask_seconds=0.0, **kw)


def test_speculation_counts_drafts_acceptances_and_emitted_tokens_by_method() -> None:
    text = generate_latest(Metrics("m", lambda: stats(speculative_method="ngram", draft_tokens=12,
                                                      accepted_draft_tokens=7, speculative_tokens=10)).registry).decode()
    assert 'minillm_spec_draft_tokens_total{method="ngram",model="m"} 12.0' in text
    assert 'minillm_spec_accepted_tokens_total{method="ngram",model="m"} 7.0' in text
    assert 'minillm_spec_emitted_tokens_total{method="ngram",model="m"} 10.0' in text
    off = generate_latest(Metrics("m", lambda: stats()).registry).decode()
    assert "minillm_spec_" not in off and "minillm_tokens_generated_total" in off
