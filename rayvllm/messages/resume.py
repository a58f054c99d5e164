"""`ResumePoint`: where a request's stream stands when it moves to another engine."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ResumePoint"]


@dataclass(frozen=True)
class ResumePoint:
    """A stream as its client already has it, for an engine to continue.

    `output_token_ids`: every token the client was sent; the new engine
    takes them as the request's output so far (recomputed as context,
    counted against max_tokens and penalties, a seeded generator advanced
    past them), so the tokens that follow are the ones an undisturbed run
    makes. `text_chars`: how many characters of their text the client was
    sent; text held back (a possible stop string's start, a partial
    character) is sent by the new engine, so no character is lost or repeated.
    """

    output_token_ids: tuple[int, ...]
    text_chars: int
