"""Tokenizer (transformers' AutoTokenizer with the model's chat template) and streaming detokenization."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase, TokenizersBackend

from engine.errors import InvalidRequestError, ModelLoadError

# Private-use characters wrapped around each control token spelled in a message or tool, so that the
# rendered chat tells the template's own control tokens from a client's (transformers' markers, too).
# Not transformers' sanitize_control_tokens: it leaves dict keys unmarked, and a tool call's argument
# names are the client's text that templates render with tojson.
MARK_START, MARK_END = "\U000f0000", "\U000f0001"


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
        # Control tokens, as transformers' sanitize_control_tokens picks them: the special tokens and the
        # added ones the chat template writes, not whitespace (templates hold it as text). Spelled in a
        # message, each is text, as OpenAI encodes it. Longest first: a token wins over those it holds.
        template = self.chat_template
        controls = sorted((t.content for t in hf.added_tokens_decoder.values()
                           if (t.special or t.content in template) and not t.content.isspace()), key=len, reverse=True)
        self._controls = re.compile("|".join(map(re.escape, controls)) or "(?!)")
        # A marked control token (its spelling captured), or a lone marker that a template split off.
        self._marked = re.compile(f"{MARK_START}({self._controls.pattern}){MARK_END}|[{MARK_START}{MARK_END}]")
        self._newline_ids = self.encode("\n", add_special_tokens=False)
        self._spellings: dict[str, list[int]] = {}  # a control token's spelling -> its ids as text
        # The Rust tokenizer directly where transformers' decode adds nothing to it: the detokenizer
        # steps it on every sampled token (IncrementalDetokenizer), and transformers' Python layers
        # around a decode cost 3x. None: decode through transformers.
        backend = getattr(hf, "backend_tokenizer", None)
        plain = type(hf)._decode is TokenizersBackend._decode
        self.backend = backend if backend is not None and plain and not hf.clean_up_tokenization_spaces else None

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
            text = self.hf.apply_chat_template(self._mark(chat.messages), tools=self._mark(chat.tools), tokenize=False,
                                               add_generation_prompt=chat.add_generation_prompt,
                                               continue_final_message=chat.continue_final_message)
        except Exception as e:  # a template may reject a message layout (e.g. roles out of order)
            raise InvalidRequestError(f"The chat template rejected these messages: {e}", param="messages") from e
        return self._encode_marked(text)

    def _mark(self, value: Any) -> Any:
        """Messages or tools with each control token they spell wrapped in markers; dict keys too (a
        call's argument names and a schema's property names reach the template as much as values)."""
        if isinstance(value, str):
            # Markers a client sent are dropped, so none can wrap (and so disarm) the template's own tokens.
            value = value.replace(MARK_START, "").replace(MARK_END, "")
            return self._controls.sub(lambda m: MARK_START + m[0] + MARK_END, value)
        if isinstance(value, dict):
            return {self._mark(k): self._mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._mark(v) for v in value]
        return value

    def _encode_marked(self, text: str) -> list[int]:
        """A chat rendered from marked inputs: the template's control tokens as tokens, the marked ones
        as plain text. A lone marker is dropped but still splits the text, so the text on either side
        cannot join into a control token."""
        pieces = self._marked.split(text)  # text, marked token (None: a lone marker), text, ...
        ids = self.encode(pieces[0], add_special_tokens=False)
        for i, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += self._spelled(piece) if i % 2 == 1 else self._encode_piece(piece, as_text=False)
        return ids

    def _spelled(self, token: str) -> list[int]:
        """A control token's spelling as plain text (kept: there are only so many)."""
        ids = self._spellings.get(token)
        if ids is None:
            ids = self._encode_piece(token, as_text=True)
            if self.hf.convert_tokens_to_ids(token) in ids:
                raise InvalidRequestError(f"The messages spell the control token {token!r}, which this tokenizer "
                                          "cannot encode as text.", param="messages")
            self._spellings[token] = ids
        return ids

    def _encode_piece(self, piece: str, as_text: bool) -> list[int]:
        """A piece from inside a chat (as_text: with no added token matched). Encoded after a newline,
        which is then removed: SentencePiece adds a space at the start of a string, not inside one."""
        ids = self._encode_text("\n" + piece) if as_text else self.encode("\n" + piece, add_special_tokens=False)
        n = len(self._newline_ids)
        if ids[:n] == self._newline_ids:
            return ids[n:]
        return self._encode_text(piece) if as_text else self.encode(piece, add_special_tokens=False)

    def _encode_text(self, text: str) -> list[int]:
        """Text as plain text: the tokenizer's pipeline without its added tokens, special or not."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer: split_special_tokens skips the special ones
            return list(self.hf(text, add_special_tokens=False, split_special_tokens=True).input_ids)
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        splits = [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
        return [token.id for split in splits for token in backend.model.tokenize(split)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.backend is not None:
            return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
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
        # The same window kept by the Rust decoder, where it decodes as transformers does: one call a
        # token instead of two decodes and their slices, on every sampled token.
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if tokenizer.backend is not None else None

    def add(self, token_id: int) -> str:
        """Add one token; return the text that became final."""
        self.token_ids.append(token_id)
        text = None
        if self._stream is not None:
            try:
                text = self._stream.step(self.tokenizer.backend, token_id)
            except Exception:  # the window's text no longer starts with its prefix (odd bytes): decode it here from now on
                self._stream = None
            else:
                if text is None:
                    return ""  # an incomplete character: wait for the next byte-fallback token
        if text is None:
            prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
            full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                return ""  # an incomplete character: wait for the next byte-fallback token
            text = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._release(text)

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
