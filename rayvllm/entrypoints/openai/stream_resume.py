"""What lets a streamed response move to another replica mid-stream.

Behind the router ingress (router_ingress.py), a replica tags each event of
a resumable stream with how far the stream has come (`ProgressEvent`); the
ingress folds the tags into a `StreamResume`, and if the replica dies, asks
another for the same route with it: that replica's engine continues the
request from the tokens and text the client has (`ResumePoint`), under the
same response id, so the client reads one unbroken stream. Ray-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayvllm.messages.resume import ResumePoint

__all__ = ["ProgressEvent", "StreamResume"]


class ProgressEvent(str):
    """An SSE event (the text itself, as Starlette sends it) that also says
    what it carries: the stream's new `token_ids`, its text's length in
    characters once this event is sent, the prompt's cached tokens, and
    whether it is the choice's last (its finish reason)."""

    token_ids: tuple[int, ...]
    text_chars: int
    num_cached_tokens: int
    finished: bool

    def __new__(
        cls, event: str, token_ids: tuple[int, ...], text_chars: int, num_cached_tokens: int, finished: bool
    ) -> ProgressEvent:
        tagged = super().__new__(cls, event)
        tagged.token_ids = token_ids
        tagged.text_chars = text_chars
        tagged.num_cached_tokens = num_cached_tokens
        tagged.finished = finished
        return tagged


@dataclass
class StreamResume:
    """A resumable stream as its client has it (one prompt, one choice).

    Invariant: `output_token_ids` and `text_chars` cover exactly the events
    the client was sent, so a replica resuming at them neither repeats nor
    skips one. `num_cached_tokens` is the first replica's (the usage the
    client is told reflects the prefill that served its prompt). Once the
    client has the finish reason (`finished`) nothing is left to generate:
    such a stream does not move (its client has every token; only the
    usage chunk and [DONE] are missing, and it gets an error event instead).
    """

    response_id: str
    created: int
    output_token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0
    num_cached_tokens: int = 0
    finished: bool = False

    def advance(self, token_ids: tuple[int, ...], text_chars: int, num_cached_tokens: int, finished: bool) -> None:
        """Fold in what the events just sent carried."""
        self.output_token_ids.extend(token_ids)
        self.text_chars = text_chars
        self.num_cached_tokens = max(self.num_cached_tokens, num_cached_tokens)
        self.finished = self.finished or finished

    def point(self) -> ResumePoint:
        return ResumePoint(tuple(self.output_token_ids), self.text_chars)
