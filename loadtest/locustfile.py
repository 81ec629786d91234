"""Load test for minillm, or any OpenAI-compatible server: streaming chat users with a realistic mix
of prompt lengths, completions users, and a step-ramp load shape.

    make loadtest HOST=http://127.0.0.1:8000 USERS=32 RUN_TIME=5m      # headless, CSV + HTML reports
    .venv/bin/locust -f loadtest/locustfile.py --host http://127.0.0.1:8000   # web UI on :8089

Besides the HTTP rows (whose response time is the whole request, to the stream's last byte), each
streamed reply reports its time to first token as a row of type TTFT (one per prompt size) and each
gap between content chunks as a row of type ITL. ITL is per chunk: a server that puts several tokens
in one chunk (minillm does when it holds text back for a stop string) shows the gap between chunks.
The Aggregated row mixes all of these; read the typed rows.
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from typing import Any

from locust import HttpUser, LoadTestShape, between, events, task

# Prompt sizes in words (about 1.3 tokens each) and how often each comes, by default: mostly short
# questions, some pasted paragraphs, a few long documents to summarise.
PROMPT_WORDS = {"short": 12, "medium": 150, "long": 1200}
DEFAULT_MIX = "short:50,medium:35,long:15"

log = logging.getLogger("loadtest")

_TOPICS = ["a paged KV cache", "continuous batching", "the water cycle", "a hash table", "inflation",
           "photosynthesis", "the printing press", "plate tectonics", "compound interest", "jazz"]
_QUESTIONS = ["Explain {t} to a new colleague.", "What are the main trade-offs of {t}?",
              "Give three surprising facts about {t}.", "How would you teach {t} in ten minutes?"]
_SUBJECTS = ["The committee", "Every engineer", "The old report", "A careful reader", "Our team",
             "The first draft", "The village council", "Most students"]
_VERBS = ["reviewed", "described", "questioned", "measured", "rebuilt", "explained", "compared", "tested"]
_OBJECTS = ["the budget for the coming year", "how the scheduler admits new requests",
            "the river that floods every spring", "the cost of keeping old machines running",
            "the results of the last experiment", "the long delays at the harbour"]
_CLAUSES = ["before the meeting ended", "although nobody had asked", "after a long winter",
            "because the numbers did not add up", "while the rain kept falling"]


def make_prompt(size: str, rng: random.Random) -> str:
    """A user message of about PROMPT_WORDS[size] words: a question, after a document if long."""
    question = rng.choice(_QUESTIONS).format(t=rng.choice(_TOPICS))
    sentences: list[str] = []
    words = len(question.split())
    while words < PROMPT_WORDS[size]:
        sentences.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                         f"{rng.choice(_CLAUSES)}.")
        words += len(sentences[-1].split())
    if not sentences:
        return question
    paragraphs = [" ".join(sentences[i:i + 6]) for i in range(0, len(sentences), 6)]
    return "Read this:\n\n" + "\n\n".join(paragraphs) + f"\n\n{question}"


def parse_mix(text: str) -> dict[str, float]:
    """'short:50,medium:35,long:15' -> weights by prompt size."""
    mix = {}
    for part in text.split(","):
        size, _, weight = part.partition(":")
        if size.strip() not in PROMPT_WORDS:
            raise ValueError(f"--prompt-mix: unknown size {size!r} (sizes: {', '.join(PROMPT_WORDS)})")
        mix[size.strip()] = float(weight or 1)
    return mix


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    parser.add_argument("--model", default="", help="model name to send (default: the server's first in /v1/models)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--prompt-mix", default=DEFAULT_MIX, help="weights of the prompt sizes (short, medium, long)")
    parser.add_argument("--api-key", default="", env_var="LOCUST_API_KEY", help="sent as a Bearer token")
    parser.add_argument("--step-users", type=int, default=0, help="users added per step (default: a quarter of -u)")
    parser.add_argument("--step-time", type=float, default=30.0,
                        help="seconds per step of the ramp, at most (shorter where -t needs it: -u is reached by "
                             "half of the run)")


def report(environment: Any, kind: str, name: str, seconds: float) -> None:
    """One sample of a streaming measurement, as its own row in locust's statistics."""
    environment.events.request.fire(request_type=kind, name=name, response_time=seconds * 1000,
                                    response_length=0, exception=None, context={})


class OpenAIUser(HttpUser):
    abstract = True
    wait_time = between(0.5, 2.0)  # a person reading the reply before the next message
    _model: str | None = None  # the served model's name, asked once per process

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.rng = random.Random()
        self.mix = parse_mix(options.prompt_mix)
        self.max_tokens = options.max_tokens
        if options.api_key:
            self.client.headers["Authorization"] = f"Bearer {options.api_key}"
        if options.model:
            OpenAIUser._model = options.model
        elif OpenAIUser._model is None:
            OpenAIUser._model = self.client.get("/v1/models").json()["data"][0]["id"]

    def prompt(self) -> tuple[str, str]:
        """(size, text) drawn from the prompt mix."""
        size = self.rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
        return size, make_prompt(size, self.rng)


class ChatStreamUser(OpenAIUser):
    """Streams chat completions, reporting TTFT (by prompt size) and ITL as rows of their own."""

    weight = 3

    @task
    def chat(self) -> None:
        size, text = self.prompt()
        body = {"model": self._model, "messages": [{"role": "user", "content": text}],
                "max_tokens": self.max_tokens, "temperature": 0.7, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            last: float | None = None
            done, received = False, 0
            for line in resp.iter_lines(chunk_size=None):
                received += len(line) + 1
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    resp.failure(f"error in stream: {event['error'].get('message')}")
                    return
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        report(self.environment, "TTFT", f"chat {size}", now - start)
                    else:
                        report(self.environment, "ITL", "chat", now - last)
                    last = now
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            resp.request_meta["response_length"] = received
            if done:
                resp.success()
            else:
                resp.failure("stream ended without data: [DONE]")


class CompletionUser(OpenAIUser):
    """Plain (non-streamed) text completions of the same prompt mix."""

    weight = 1

    @task
    def complete(self) -> None:
        _, text = self.prompt()
        body = {"model": self._model, "prompt": text, "max_tokens": self.max_tokens, "temperature": 0.7}
        with self.client.post("/v1/completions", json=body, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
            elif not isinstance((resp.json().get("choices") or [{}])[0].get("text"), str):
                resp.failure("no choices[0].text in the reply")


class StepRamp(LoadTestShape):
    """Adds --step-users users every --step-time seconds up to -u users, then holds them until -t
    (or until stopped): how latency degrades as load grows, a step at a time. With -t the steps are
    shortened where needed so that -u users run for the second half of the run at least."""

    use_common_options = True  # -u, -r and -t set the ramp's top, spawn rate and length
    _plan: tuple[int, int, float] | None = None

    def plan(self) -> tuple[int, int, float]:
        """(top users, users added per step, seconds per step); says what it will do, once."""
        if self._plan is None:
            options = self.runner.environment.parsed_options
            top = options.num_users or 1
            step = min(top, options.step_users or max(1, top // 4))
            steps = math.ceil(top / step)
            step_time = options.step_time
            if options.run_time and steps > 1:
                step_time = min(step_time, options.run_time / 2 / (steps - 1))
            self._plan = top, step, step_time
            length = f" of the {options.run_time} s run" if options.run_time else ""
            log.info("step ramp: %d more users every %.1f s up to %d users, all %d from %.1f s%s",
                     step, step_time, top, top, (steps - 1) * step_time, length)
        return self._plan

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        run_time = self.get_run_time()
        if options.run_time and run_time >= options.run_time:
            return None
        top, step, step_time = self.plan()
        users = min(top, step * (1 + int(run_time // step_time)))
        return users, options.spawn_rate or float(step)
