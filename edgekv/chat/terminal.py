"""`edgekv chat`: the terminal front end (the prompt, slash commands, the stats line, --json)."""
from __future__ import annotations

import json
import os
import sys
from statistics import median

from edgekv.chat.session import ChatSession
from edgekv.errors import EdgeKVError
from edgekv.runtime.assemble import open_runtime
from edgekv.runtime.stats import kv_line, ring_note, stats_line, stats_record
from edgekv.runtime.grammar_cli import grammar_from_args
from edgekv.runtime.grammar_constraint import compile_grammar
from edgekv.runtime.grammar_tokenizer import tokenizer_for
from edgekv.runtime.reasoning import CLOSE, OPEN, ReasoningSplitter, split_reply
from edgekv.runtime.sampling import defaults_of, sampling_from

HELP = """commands:
  /help            this help
  /reset           forget the conversation (keeps the system prompt)
  /undo            forget the last exchange (the cache is truncated, not recomputed)
  /system TEXT     set a new system prompt (resets the conversation)
  /stats           the last reply's cache and speed, and the session's totals
  /save FILE       save the conversation and its KV cache (over nothing but its own saved chats)
  /save! FILE      the same, over any regular file
  /load FILE       load a saved conversation (made with this bundle only)
  /load! FILE      the same, for a file from an older edgekv that did not record its bundle's weights
  /quit            exit (Ctrl-D too); Ctrl-C stops a reply, or cancels a /save or /load"""


def stats_report(s: ChatSession) -> str:
    """/stats: the last turn's line and the session's totals."""
    return f"last turn: {session_stats(s)}\n{session_totals(s)}"


def session_totals(s: ChatSession) -> str:
    """Every turn completed since the chat started (undone, reset and /load-replaced ones too: they
    ran; stopped ones not): turns, tokens, the KV's peak, TTFT and decode-speed medians."""
    if not s.turns:
        return "session: no turn completed yet"
    stats, mib = [st for st, _ in s.turns], 2 ** 20
    rates = [st.decode_tps for st in stats if st.decode_s > 0]  # a one-token reply has no decode step
    decode = f"decode median {median(rates):.1f} tok/s" if rates else "no decode steps"
    return (f"session: {len(stats)} turn{'s' if len(stats) > 1 else ''} | prefill {sum(st.prompt_tokens for st in stats)} "
            f"tok, decode {sum(st.new_tokens for st in stats)} tok | TTFT median "
            f"{median(st.ttft_s for st in stats) * 1000:.0f} ms | {decode} | KV peak "
            f"{max(b for _, b in s.turns) / mib:.2f} / {s.cache.nbytes / mib:.2f} MiB")


def session_stats(s: ChatSession) -> str:
    """The last completed turn's stats line, or, before any turn since the start or a /load, what
    the cache holds."""
    dropped = f" | {s.dropped_turns} old turn(s) dropped" if s.dropped_turns else ""
    if s.last is not None:
        return stats_line(s.last, s.cache, s.seq) + dropped
    since = " since /load" if s.loaded_from else ""
    return (f"(no turn yet{since}) | {kv_line(s.cache, s.seq)} | position {s.seq.pos}" + ring_note(s.seq) + dropped)


def cmd_chat(args, explain=EdgeKVError.explain) -> int:
    """`explain` turns a library error into the line to show (the CLI names its flags)."""
    grammar = grammar_from_args(args)  # a bad --json-schema is refused before the model loads
    with open_runtime(args.bundle, args.ctx, args.backend, args.threads) as rt:
        return chat_loop(args, rt, explain, compiled_grammar(rt.bundle, grammar))


def compiled_grammar(bundle, grammar):
    """The grammar compiled once against the bundle's tokenizer (an error at start-up, as
    generate's), or None; each turn takes a fresh copy (ChatSession)."""
    if grammar is None:
        return None
    return compile_grammar(tokenizer_for(bundle), grammar)


def chat_loop(args, rt, explain, reply_grammar=None) -> int:
    # one conversation: a pool of --ctx cells, no prefix cache (the conversation's cells are its own)
    batcher = rt.batcher(parallel=1, max_queue=1, max_prefixes=0, windowed=True)  # Gemma 3: the local layers' window only
    thinking = getattr(args, "thinking", "show")
    codec = rt.codec.with_thinking(False) if thinking == "off" else rt.codec
    params = sampling_from(args, rt.bundle.manifest)  # unset flags: the model's defaults, as serve's
    session = ChatSession(rt.bundle, codec, batcher, params, args.system, args.max_new_tokens, args.context,
                          reply_grammar)
    interactive = sys.stdin.isatty() and not args.json
    if args.system or args.prompt_cache:
        note = session.warm_system(args.prompt_cache)
        if interactive or args.prompt_cache:
            print(f"({note})", file=sys.stderr)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"edgekv chat — {rt.bundle.manifest.get('name', rt.bundle.path.name)}, KV {rt.bundle.scheme.name}, "
              f"ctx {batcher.capacity}. /help for commands, Ctrl-D to quit.", file=sys.stderr)
        print(f"sampling: {defaults_of(rt.bundle.manifest, args).line()}", file=sys.stderr)
    dim = ("\033[2m", "\033[0m") if sys.stderr.isatty() else ("", "")
    # bytes that are not UTF-8 come through as surrogates: such a line is refused, not fatal
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /quit to exit)", file=sys.stderr)
            continue
        if not is_utf8(line):
            print("error: that line is not valid UTF-8; it was skipped", file=sys.stderr, flush=True)
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            try:
                if handle_command(session, line, explain) == "quit":
                    return 0
            except KeyboardInterrupt:  # a command ends; the chat does not
                print("\n(interrupted; Ctrl-D or /quit to exit)", file=sys.stderr, flush=True)
            continue
        out = sys.stdout
        printer = ReplyPrinter(out, show_reasoning=thinking == "show")
        try:
            text, st = session.reply(line, printer.write if not args.json else None)
            printer.finish()
        except EdgeKVError as e:  # the turn was rolled back: the conversation is as before it
            if not args.json:
                printer.finish()  # no dimming left on
                out.write("\n")  # end a reply that had started streaming
                out.flush()
            print(f"error: {explain(e)}", file=sys.stderr, flush=True)
            continue
        if reply_grammar is not None and st.stop_reason not in ("stop", "interrupted"):
            print(f"error: the reply ended by {st.stop_reason} before its JSON was complete: it is cut short "
                  "(raise --max-new-tokens or --ctx)", file=sys.stderr, flush=True)
        if args.json:
            part = split_reply(text)
            said = {"text": part.content, "reasoning": part.reasoning} if part.reasoning else {"text": text}
            print(json.dumps({"user": line, **said, **stats_record(st, session.cache, session.seq),
                              "dropped_turns": session.dropped_turns, "context": args.context}), flush=True)
        else:
            out.write("\n")
            out.flush()
            if st.stop_reason == "interrupted":  # nothing was said: no stats of it
                print("[stopped] (the turn is discarded; the conversation is as before it)", file=sys.stderr, flush=True)
            else:
                print(f"{dim[0]}{session_stats(session)}{dim[1]}", file=sys.stderr, flush=True)


class ReplyPrinter:
    """A streamed reply on `out`: its <think> part dimmed (a terminal) or between its tags (a
    pipe), or not printed; the answer as it comes (edgekv/runtime/reasoning.py splits them)."""

    def __init__(self, out, show_reasoning: bool):
        self.out, self.show = out, show_reasoning
        self.split = ReasoningSplitter()
        tty = hasattr(out, "isatty") and out.isatty()
        self.marks = ("\033[2m", "\033[0m") if tty else (OPEN, CLOSE + "\n")
        self.in_reasoning = False

    def write(self, piece: str) -> None:
        self._emit(self.split.push(piece))

    def finish(self) -> None:
        self._emit(self.split.flush())
        self._end_reasoning()

    def _emit(self, part) -> None:
        if part.reasoning and self.show:
            if not self.in_reasoning:
                self.out.write(self.marks[0])
                self.in_reasoning = True
            self.out.write(part.reasoning)
        if part.content:
            self._end_reasoning()
            self.out.write(part.content)
        self.out.flush()

    def _end_reasoning(self) -> None:
        if self.in_reasoning:
            self.out.write(self.marks[1])
            self.in_reasoning = False


def is_utf8(line: str) -> bool:
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def handle_command(s: ChatSession, line: str, explain=EdgeKVError.explain):
    cmd, _, arg = line.partition(" ")
    arg = arg.strip()
    err = sys.stderr
    try:
        if cmd in ("/quit", "/exit"):
            return "quit"
        if cmd == "/help":
            print(HELP, file=err)
        elif cmd == "/reset":
            s.reset()
            print("(conversation forgotten)", file=err)
        elif cmd == "/undo":
            print("(last exchange forgotten)" if s.undo() else "(nothing to undo)", file=err)
        elif cmd == "/system":
            if not arg:
                print(f"(system prompt: {s.system!r}; /system TEXT sets it)", file=err)
            else:
                s.set_system(arg)
                print("(system prompt set; conversation reset)", file=err)
        elif cmd == "/stats":
            print(stats_report(s), file=err)
        elif cmd in ("/save", "/save!"):
            if not arg:
                raise EdgeKVError(f"{cmd} FILE")
            print(save_command(s, arg, replace_any=cmd == "/save!"), file=err)
        elif cmd in ("/load", "/load!"):
            if not arg:
                raise EdgeKVError(f"{cmd} FILE")
            print(load_command(s, arg, trust_unrecorded=cmd == "/load!"), file=err)
        else:
            print(f"unknown command {cmd}; /help lists the commands", file=err)
    except EdgeKVError as e:
        print(f"error: {explain(e)}", file=err)
    return None


def save_command(s: ChatSession, path: str, replace_any: bool) -> str:
    """/save: Ctrl-C cancels it (the file is written to a temporary name and renamed at the end:
    until then nothing is replaced, and the temporary file is removed)."""
    before = file_identity(path)
    try:
        s.save(path, replace_any)
    except KeyboardInterrupt:
        if file_identity(path) == before:  # else it came after the rename: the new file is whole
            return f"(/save cancelled: {path} {'is unchanged' if before else 'was not written'})"
    return f"(saved to {path})"


def load_command(s: ChatSession, path: str, trust_unrecorded: bool) -> str:
    """/load: Ctrl-C cancels it (ChatSession.load is all or nothing)."""
    try:
        exchanges, cached = s.load(path, trust_unrecorded)
    except KeyboardInterrupt:
        return "(/load cancelled: the conversation is as it was)"
    return f"(loaded {path}: {exchanges} exchange(s), {cached} cached tokens)"


def file_identity(path: str):
    """What tells a replaced file from the one there before (a rename brings another inode)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
