"""Chat's /stats (issue 43 item 6): the last turn's line beside the session's totals (turns,
tokens, the KV's peak, TTFT and decode medians); a stopped or failed turn is not counted."""
import contextlib
import io
from statistics import median

import pytest

from edgekv.chat import terminal
from edgekv.errors import EdgeKVError
from tests.test_chat import session


def stats_of(s) -> list[str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        terminal.handle_command(s, "/stats")
    return err.getvalue().splitlines()


def test_stats_shows_the_session_totals_beside_the_last_turn(tiny_bundle_int8):
    s = session(tiny_bundle_int8, max_new=8)
    assert stats_of(s)[-1] == "session: no turn completed yet"
    turns = []
    for text, most in (("What is the capital of France?", 8), ("Yes?", 1), ("And of Germany?", 8), ("Trains.", 8)):
        s.max_new = most  # a one-token reply has no decode step: it has no decode speed either
        _, st = s.reply(text)
        turns.append((st, s.cache.used_bytes(s.seq.n)))
    last, total = stats_of(s)
    assert last == "last turn: " + terminal.session_stats(s)
    stats, mib = [st for st, _ in turns], 2 ** 20
    assert stats[1].decode_s == 0 and all(st.decode_s > 0 for st in stats[:1] + stats[2:])
    assert total.startswith("session: 4 turns | ")
    assert f"prefill {sum(st.prompt_tokens for st in stats)} tok, decode {sum(st.new_tokens for st in stats)} tok" \
        in total, total
    assert f"TTFT median {median(st.ttft_s for st in stats) * 1000:.0f} ms" in total, total
    assert f"decode median {median(st.decode_tps for st in stats if st.decode_s > 0):.1f} tok/s" in total, total
    assert f"KV peak {max(b for _, b in turns) / mib:.2f} / {s.cache.nbytes / mib:.2f} MiB" in total, total
    assert sum(st.prompt_tokens for st in stats) > stats[-1].prompt_tokens  # totals, not the last turn again


def test_stopped_and_failed_turns_are_not_counted_undone_ones_are(tiny_bundle_int8, monkeypatch):
    s = session(tiny_bundle_int8, max_new=8)
    s.reply("What is the capital of France?")

    def stop(piece):
        raise KeyboardInterrupt

    assert s.reply("Tell me about robots.", stop)[1].stop_reason == "interrupted"
    monkeypatch.setattr(s.batcher, "run", lambda req: (_ for _ in ()).throw(EdgeKVError("boom")))
    with pytest.raises(EdgeKVError):
        s.reply("And of Germany?")
    monkeypatch.undo()
    assert len(s.turns) == 1 and stats_of(s)[-1].startswith("session: 1 turn | ")
    s.reply("And of Germany?")
    s.undo()  # it ran: the session's totals keep it
    s.reset()
    assert stats_of(s)[-1].startswith("session: 2 turns | ")
