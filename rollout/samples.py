"""What a pool is asked for (`Request`) and what it gives back (`Sample`), token by token."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from weightfabric.fabric.errors import BadRequestError


@dataclass(frozen=True)
class Request:
    """One prompt to generate from.

    Args:
        prompt: the prompt's token ids.
        max_tokens: at most this many output tokens.
        temperature: 0 is greedy (the only setting under which a migrated request's
            continuation is what an engine would produce for its prompt and kept tokens).
        top_p, top_k, seed: sampling as vLLM's ``SamplingParams``.
        ignore_eos: generate ``max_tokens`` whatever is sampled.
        logprobs: also return each sampled token's log-probability.
        group: the prompt group (for the length predictor: GRPO's samples of a prompt).
        rid: the request's id (default: given by the pool).
    """

    prompt: Sequence[int]
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    group: str | None = None
    rid: str | None = None

    def check(self, max_model_len: int | None) -> None:
        """Refuse a malformed request, or one longer than the engines' context.

        Raises:
            BadRequestError: naming the field.
        """
        who = f"request {self.rid!r}" if self.rid is not None else "a request"
        if not self.prompt or not all(isinstance(t, int) and t >= 0 for t in self.prompt):
            raise BadRequestError(f"{who}: prompt must be a non-empty list of token ids >= 0")
        if not (isinstance(self.max_tokens, int) and self.max_tokens > 0):
            raise BadRequestError(f"{who}: max_tokens must be an int > 0, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise BadRequestError(f"{who}: temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise BadRequestError(f"{who}: top_p must be in (0, 1], got {self.top_p!r}")
        if max_model_len is not None and len(self.prompt) + self.max_tokens > max_model_len:
            raise BadRequestError(
                f"{who}: prompt ({len(self.prompt)} tokens) + max_tokens ({self.max_tokens}) "
                f"exceeds the engines' context of {max_model_len} tokens")

    def sampling(self) -> dict[str, Any]:
        """The sampling fields an engine needs (sent with every attempt)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "seed": self.seed, "ignore_eos": self.ignore_eos, "logprobs": self.logprobs}


@dataclass
class Sample:
    """A finished request: its tokens, and which weight version and engine made each.

    ``versions[i]`` is the version of the weights that produced ``tokens[i]`` (0: the
    checkpoint the engine started from); ``spans`` lists ``(engine, first token index)``
    each time another engine continued the request (a migration).
    """

    rid: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[tuple[str, int]] = field(default_factory=list)
    finish_reason: str | None = None
    group: str | None = None
    migrations: int = 0
    restarts: int = 0
    submitted_at: float = 0.0
    finished_at: float = 0.0

    @property
    def oldest_version(self) -> int | None:
        """The oldest version among the tokens (None without tokens)."""
        return min(self.versions) if self.versions else None

    @property
    def engines(self) -> list[str]:
        """The engines that generated it, in order."""
        return [engine for engine, _ in self.spans]


__all__ = ["Request", "Sample"]
