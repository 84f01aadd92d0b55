"""A sequence: one prompt plus the tokens generated for it (a request with n > 1 owns n sequences)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Token state of one output sequence; also the ``KVRequest`` the KV cache manager reads.

    ``all_token_ids`` is the one list of its ids, the prompt's then the outputs': the output state (``state``,
    ``RequestOutputState``) appends each sampled token to it and reads its outputs from it.
    ``num_computed_tokens`` counts tokens whose KV is in the cache. The last sampled token is in
    ``all_token_ids`` but not computed until the next step feeds it to the model.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # already clamped to the context limit
    arrival: int  # order of arrival: earlier runs first, later is preempted first
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None
    adapter_id: str | int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    state: Any = None  # output state (text, stop checks) owned by the engine
    generator: Any = None  # torch.Generator of a seeded request
    grammar: Any = None  # xgrammar.GrammarMatcher of a request with structured outputs
    prompt_scores: Any = None  # PromptScores of the sequence that gathers its request's prompt logprobs

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens

    @property
    def needs_prompt_scores(self) -> bool:
        """Whether prompt positions are still to be scored: until then the prefill computes every position (no
        prefix-cache hit: a cached prefix has no hidden states to score)."""
        return self.prompt_scores is not None and not self.prompt_scores.complete

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
