"""Tokenizer (transformers' AutoTokenizer with the model's chat template) and streaming detokenization."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.errors import InvalidRequestError, ModelLoadError


@dataclass
class Chat:
    """Chat messages to render through the model's chat template, with what the template takes
    beside them (transformers' apply_chat_template arguments)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, for templates that describe tools
    add_generation_prompt: bool = True  # open the assistant's turn
    continue_final_message: bool = False  # leave the last (assistant) message open, to be continued


class Tokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_ids: frozenset[int]) -> None:
        self.hf = hf
        self.eos_token_ids = eos_token_ids

    @staticmethod
    def present(path: Path) -> bool:
        """Whether a model directory ships a tokenizer (random-weight test checkpoints do not)."""
        return any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))

    @classmethod
    def from_dir(cls, path: Path) -> "Tokenizer":
        try:
            hf = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # transformers raises many types for a broken directory
            raise ModelLoadError(f"Cannot load the tokenizer in {path}: {e}") from e
        eos: set[int] = set() if hf.eos_token_id is None else {hf.eos_token_id}
        gen_config = Path(path) / "generation_config.json"
        if gen_config.is_file():  # Llama 3 and others stop on several ids
            ids = json.loads(gen_config.read_text()).get("eos_token_id")
            eos |= set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        return cls(hf, frozenset(eos))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens).input_ids)

    @property
    def chat_template(self) -> str:
        """The chat template's text ('' if none): tool-call formats are recognised by what it contains."""
        template = self.hf.chat_template
        return "\n".join(template.values()) if isinstance(template, dict) else (template or "")

    def apply_chat_template(self, chat: Chat | list[dict[str, Any]]) -> list[int]:
        if isinstance(chat, list):
            chat = Chat(chat)
        if not self.has_chat_template:
            raise InvalidRequestError("This model has no chat template; use completions.", param="messages")
        if chat.continue_final_message and (chat.add_generation_prompt or not chat.messages
                                            or chat.messages[-1].get("role") != "assistant"):
            raise InvalidRequestError("continue_final_message needs a final assistant message and "
                                      "add_generation_prompt false.", param="continue_final_message")
        try:
            text = self.hf.apply_chat_template(chat.messages, tools=chat.tools, tokenize=False,
                                               add_generation_prompt=chat.add_generation_prompt,
                                               continue_final_message=chat.continue_final_message)
        except Exception as e:  # a template may reject a message layout (e.g. roles out of order)
            raise InvalidRequestError(f"The chat template rejected these messages: {e}", param="messages") from e
        return list(self.hf(text, add_special_tokens=False).input_ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a sample's tokens into text deltas that are final: no half UTF-8 characters, and no
    text that could still turn out to be the start of a stop string."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.token_ids: list[int] = []
        # Decode a short window: tokens before prefix_offset are final; read_offset ends the text emitted so far.
        self.prefix_offset = 0
        self.read_offset = 0
        self.pending = ""  # decoded, but held back while it may begin a stop string
        self.stop_hit: str | None = None

    def add(self, token_id: int) -> str:
        """Add one token; return the text that became final."""
        self.token_ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)  # noqa: E731
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next byte-fallback token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._release(full[len(prefix) :])

    def _release(self, text: str) -> str:
        if not self.stop:
            return text
        text = self.pending + text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stop_hit = next(s for s in self.stop if text.find(s) == cut)
            self.pending = ""
            return text[:cut]
        # Keep back the longest tail that is a proper prefix of some stop string.
        hold = max((k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """At the end of a sample (not by stop string): the held-back text is final after all,
        including a trailing incomplete character, which decodes to U+FFFD as in a full decode."""
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        text = self._release(full[len(prefix) :])
        text, self.pending = text + self.pending, ""
        return text
