"""Composed speed-ups of speculative decoding at batch 1: the engine's own proposers and back-off
replayed over texts, step by step, priced by steps measured on the GPU.

Replay (any machine): the target is taken to write a given text greedily, so a draft is accepted
while it equals the text. Step by step the engine's policy (engine/llm_engine.py's step and
engine/scheduler.py's draft limits) decides whether the step waits for the one in flight (a
proposal is likely, or the step before carried drafts), how many drafts it may take, and what the
proposer offers, with speculative.DraftState backing off as it does in the engine. The texts are
bench/data/spec_workloads.json's references (what a model that does each task would answer) or,
with --outputs, a model's own greedy outputs (given the same ids and max_tokens, the replay makes
exactly the drafts the engine makes: tests/bench/test_spec_composed.py). Tokens are the embedded
model's (SmolLM2's tokenizer).

Measure (--measure, on CUDA): an engine step of each kind on random weights of the named shapes:
an overlapped decode (nothing to propose), a decode that waited for the step in flight and found
nothing, and a verify step of d drafts a sequence (each waiting for the step before, as drafts
follow real ids): d = 1..k at batch 1, which prices the replay, and d = k at larger batches (what a
verify step costs beside a batch). Medians of alternating rounds.

Composed: the text's tokens at the overlapped decode's price, against the replayed steps at
theirs. It leaves out what a text cannot say: the target's own tokens are assumed to be the text.

    python3 bench/spec_composed.py --measure --out $OUT/spec-costs.json          # GPU machine
    python3 bench/spec_composed.py --costs spec-costs.json --out composed.json   # here: replay, compose
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.provenance import git_commit  # noqa: E402
from engine.speculative import DraftState, NgramProposer, Proposer, SuffixProposer, accepted  # noqa: E402

WORKLOADS = Path(__file__).resolve().parent / "data" / "spec_workloads.json"
SHAPES = ("llama-3.2-1b", "llama-3.1-8b")
METHODS = {"ngram": NgramProposer, "suffix": SuffixProposer}
PLAIN, WAITED = "decode", "waited decode"


class _Seq:
    """What the proposers and DraftState read of an engine Sequence."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.num_placeholders = 0
        self.drafting: DraftState | None = None

    @property
    def num_real_tokens(self) -> int:
        return len(self.token_ids) - self.num_placeholders


def replay(proposer: Proposer, prompt: list[int], text: list[int], max_tokens: int | None = None) -> dict[str, Any]:
    """The decode steps the engine takes at batch 1 for a target that writes `text` after `prompt`
    (ending it, or stopped by max_tokens; None: no limit): {kind: count} with kinds PLAIN, WAITED
    and the number of drafts, and the drafts made and accepted. The prefill step (the same with and
    without drafts) samples the first token and is not counted."""
    k = proposer.num_tokens
    seq = _Seq(list(prompt) + text[:1])
    seq.num_placeholders = 1  # the prefill's token, in flight
    steps: Counter[str | int] = Counter()
    drafted = confirmed_total = 0
    after_drafts = False
    done = 1
    while done < len(text):
        state = seq.drafting
        # llm_engine.step: it reads the step in flight first when that carried drafts, or when the
        # scheduler may draft (Scheduler.drafting: not skipping, and a proposal likely).
        waits = after_drafts or ((state is None or not state.skip) and proposer.likely(seq))
        if waits:
            seq.num_placeholders = 0
        # Scheduler._draft_limit, then _drafts.
        state = seq.drafting = state or DraftState(k)
        limit = 0
        if state.skip:
            state.skip -= 1
        elif not seq.num_placeholders:
            limit = state.length if max_tokens is None else min(state.length, max_tokens - done - 1)
        drafts = proposer.propose(seq, limit) if limit > 0 else []
        if limit > 0 and not drafts:
            state.record(0, 0, k)
        if drafts:
            sampled = text[done:done + len(drafts) + 1]
            confirmed = accepted(drafts, sampled)
            state.record(len(drafts), confirmed, k)
            seq.token_ids += sampled[:confirmed + 1]
            done += confirmed + 1
            drafted, confirmed_total = drafted + len(drafts), confirmed_total + confirmed
            steps[len(drafts)] += 1
        else:
            seq.token_ids.append(text[done])
            seq.num_placeholders = 1
            done += 1
            steps[WAITED if waits else PLAIN] += 1
        after_drafts = bool(drafts)
    proposer.release(seq)
    return dict(steps={str(kind): n for kind, n in sorted(steps.items(), key=str)}, drafted=drafted,
                accepted=confirmed_total, tokens=len(text) - 1)


def compose(steps: dict[str, int], tokens: int, costs: dict[str, float]) -> float:
    """The speed-up of the replayed steps over `tokens` overlapped decodes, at `costs` (ms a step by kind)."""
    spec = sum(n * costs[kind] for kind, n in steps.items())
    return tokens * costs[PLAIN] / spec


def texts(outputs: Path | None) -> tuple[dict[str, list[dict[str, str]]], dict[str, str]]:
    doc = json.loads(WORKLOADS.read_text())
    if outputs is None:
        return doc["workloads"], doc["references"]
    return doc["workloads"], json.loads(outputs.read_text())


def replay_all(k: int, outputs: Path | None, tokenizer_dir: str) -> list[dict[str, Any]]:
    from engine.model_store import resolve_model
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model(tokenizer_dir))
    eos = min(tokenizer.eos_token_ids)
    workloads, answers = texts(outputs)
    rows = []
    for name, chat in workloads.items():
        prompt = tokenizer.apply_chat_template(chat)
        text = tokenizer.encode(answers[name], add_special_tokens=False) + [eos]
        for method, cls in METHODS.items():
            rows.append(dict(workload=name, method=method, **replay(cls(k), prompt, text)))
    return rows


class _Drafts(Proposer):
    """Fixed proposals for --measure: `count` drafts at every step (0: none, though one is `likely`,
    so the step waits), or never likely (an overlapped decode)."""

    def __init__(self, count: int | None, num_tokens: int) -> None:
        self.count, self.num_tokens = count, num_tokens

    def likely(self, seq) -> bool:
        return self.count is not None

    def propose(self, seq, limit: int) -> list[int]:
        return [seq.token_ids[-1]] * min(self.count or 0, limit)


def measure(shapes: list[str], batches: list[int], k: int, steps: int, rounds: int, device: str) -> dict[str, Any]:
    """ms an engine step of each kind per shape and batch, every sequence alike: PLAIN, WAITED and
    1..k drafts at batch 1 (what the replay needs), PLAIN, WAITED and k drafts at larger batches
    (what the verify step costs beside a batch). Medians of `rounds` alternating rounds of `steps`
    steps."""
    import torch

    from bench.gpu import release
    from bench.graph_ab import timed_steps
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    record = DraftState.record
    DraftState.record = lambda self, drafted, confirmed, most: None  # every step as asked: no back-off
    results: dict[str, Any] = {}
    try:
        for shape in shapes:
            engine = LLMEngine(EngineConfig(model=f"random:{shape}", device=device,
                                            kv_cache_memory="24GiB" if device.startswith("cuda") else None,
                                            max_num_seqs=max(batches), speculative_method="ngram",
                                            num_speculative_tokens=k, speculative_max_batch=max(batches),
                                            speculative_gate=False))
            engine.warm_up()
            for batch in batches:
                counts = range(1, k + 1) if batch == 1 else (k,)
                kinds: dict[str, _Drafts] = {PLAIN: _Drafts(None, k), WAITED: _Drafts(0, k),
                                              **{str(d): _Drafts(d, k) for d in counts}}
                params = SamplingParams(temperature=0, max_tokens=(steps + 5) * (k + 1) * len(kinds) * rounds + 64,
                                        ignore_eos=True)
                for i in range(batch):
                    engine.add_request([(7 * i + j) % 1000 + 1 for j in range(128)], params)
                times: dict[str, list[float]] = {kind: [] for kind in kinds}
                for r in range(rounds):
                    for kind in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
                        engine.scheduler.proposer = kinds[kind]
                        times[kind].append(timed_steps(engine, steps))
                for request_id in list(engine.requests):  # a step still in flight for them is dropped later
                    engine.abort(request_id)
                key = shape if batch == 1 else f"{shape} batch {batch}"
                results[key] = {kind: dict(ms=round(statistics.median(t), 4), runs=[round(x, 4) for x in t])
                                for kind, t in times.items()}
                print(f"{key}: " + ", ".join(f"{kind} {v['ms']:.3f}" for kind, v in results[key].items()) + " ms",
                      file=sys.stderr, flush=True)
            engine.close()
            del engine
            release(torch.device(device))
    finally:
        DraftState.record = record
    name = torch.cuda.get_device_name() if device.startswith("cuda") else device
    return dict(bench="spec_costs", device=name, date=datetime.date.today().isoformat(), commit=git_commit(),
                num_speculative_tokens=k, steps=steps, rounds=rounds, batches=batches, costs=results)


def batch_one(costs: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    """--measure's step prices at batch 1 by shape (ms by kind): what the replay is priced by."""
    return {shape: {kind: v["ms"] for kind, v in by_kind.items()}
            for shape, by_kind in (costs["costs"].items() if costs else []) if " batch " not in shape}


def table(rows: list[dict[str, Any]], costs: dict[str, Any] | None) -> str:
    shapes = list(batch_one(costs))
    lines = ["| workload | method | tokens | steps (decode / waited / with drafts) | acceptance | "
             + " | ".join(f"x {s} (composed)" for s in shapes) + " |",
             "|---|---|---:|---|---:|" + "---:|" * len(shapes)]
    for row in rows:
        steps = row["steps"]
        with_drafts = sum(n for kind, n in steps.items() if kind not in (PLAIN, WAITED))
        acceptance = f"{row['accepted'] / row['drafted']:.2f}" if row["drafted"] else "none"
        cells = [f"{row['speedups'][s]:.2f}" for s in shapes]
        lines.append(f"| {row['workload']} | {row['method']} | {row['tokens']} | {steps.get(PLAIN, 0)} / "
                     f"{steps.get(WAITED, 0)} / {with_drafts} | {acceptance} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true", help="price each kind of step on CUDA (no replay)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batches", default="1,8,64", help="--measure's batch sizes (the replay is priced at batch 1)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--device", default="cuda", help="--measure's device (cpu: a smoke run)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--costs", type=Path, help="--measure's JSON, to compose the replay with")
    parser.add_argument("--outputs", type=Path, help="JSON {workload: text} replayed instead of the references")
    parser.add_argument("--tokenizer", default="default",
                        help="the replay's tokenizer: a model directory, or the embedded model's")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.measure:
        doc = measure(args.shapes.split(","), [int(b) for b in args.batches.split(",")], args.num_speculative_tokens,
                      args.steps, args.rounds, args.device)
        print(json.dumps(doc["costs"], indent=1))
    else:
        costs = json.loads(args.costs.read_text()) if args.costs else None
        rows = replay_all(args.num_speculative_tokens, args.outputs, args.tokenizer)
        for row in rows:
            row["speedups"] = {shape: round(compose(row["steps"], row["tokens"], prices), 3)
                               for shape, prices in batch_one(costs).items()}
        doc = dict(bench="spec_composed", date=datetime.date.today().isoformat(), commit=git_commit(),
                   num_speculative_tokens=args.num_speculative_tokens, texts=str(args.outputs or "references"),
                   costs=costs, composed=True, rows=rows)
        print(table(rows, costs))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
