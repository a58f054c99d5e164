"""bench/cluster.py's workload: chats whose every turn carries the whole
conversation so far, opening with one of a few shared system prompts, the
same for every router it compares."""

from __future__ import annotations

import argparse

from bench_scripts import load_bench_script


def test_every_turn_extends_the_last_and_chats_share_system_prompts() -> None:
    cluster = load_bench_script("cluster.py")
    args = argparse.Namespace(seed=3, sessions=6, turns=3, system_prompts=2, system_len=16, user_len=4, output_len=5)
    chats = cluster.conversations(args, vocab=range(5, 100), decode=None)
    assert chats == cluster.conversations(args, vocab=range(5, 100), decode=None)  # the same for every router
    assert len(chats) == 6 and all(len(turns) == 3 for turns in chats)
    for s, turns in enumerate(chats):
        for (prev, _), (prompt, n) in zip(turns, turns[1:]):
            assert prompt[: len(prev)] == prev and n == len(prompt) == len(prev) + 5 + 4
        assert turns[0][0][:16] == chats[s % 2][0][0][:16]  # chat s opens with system prompt s % 2
    assert chats[0][0][0][:16] != chats[1][0][0][:16]
    assert all(5 <= t < 100 for turns in chats for prompt, _ in turns for t in prompt)
    # As text (the default: the peer's router matches text), each segment
    # decoded on its own: every turn's text begins with the last turn's.
    texts = cluster.conversations(args, vocab=range(5, 100), decode=lambda ids: "".join(f"<{t}>" for t in ids))
    for turns, token_turns in zip(texts, chats):
        for (prev, _), (prompt, n), (ids, m) in zip(turns, turns[1:], token_turns[1:]):
            assert prompt.startswith(prev) and n == m
            assert prompt == "".join(f"<{t}>" for t in ids)
