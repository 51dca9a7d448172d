"""`hcw` command line: parses arguments and calls one function per command (the chat, generation,
replay and workbench-file commands here; the commands about models in cli_models.py; the app and
what they share in cli_app.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from workbench.cli_app import DB_HELP, DTYPE_HELP, app, engine_config, fail

# ChatOptions' defaults, for `hcw chat --help` without importing the engine (a test holds them equal)
CHAT_DEFAULTS = {"system": "You are a helpful assistant. Remember what the user tells you.", "temperature": 0.8,
                 "top_p": 0.95, "seed": 0}
DETERMINISTIC_HELP = ("bit-exact: prefill one token a step, so the logits never depend on how a prompt was "
                      "chunked or where a cache hit ended (prefill runs at decode's speed)")


@app.command()
def generate(
    model: Path = typer.Option(..., "--model", help="model folder (config.json + safetensors), or a built-in "
                               "model's name (`hcw models`)"),
    prompt: str | None = typer.Option(None, "--prompt", help="prompt text (needs a tokenizer in the folder)"),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="comma-separated token ids"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=0),
    greedy: bool = typer.Option(False, "--greedy", help="argmax decoding"),
    temperature: float = typer.Option(1.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: int | None = typer.Option(None, "--seed"),
    dtype: str = typer.Option("fp32", "--dtype", help=DTYPE_HELP),
    device: str | None = typer.Option(None, "--device", help="cpu | cuda (default: cuda when present)"),
    chunk_size: int | None = typer.Option(None, "--chunk-size", min=1, help="prefill chunk size in tokens "
                                          "(default: 2048 on a GPU, on the CPU fewer as the model is wider)"),
    deterministic: bool = typer.Option(False, "--deterministic", help=DETERMINISTIC_HELP),
    chat: bool = typer.Option(False, "--chat", help="the prompt is a user message: put it through the model's chat "
                              "template, so the model answers it"),
    system: str | None = typer.Option(None, "--system", help="with --chat: a system message before the prompt"),
    verbose: bool = typer.Option(False, "--verbose", help="print timings to stderr as Ollama does: load, prompt "
                                 "eval count and rate, eval count and rate, cached tokens"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming text"),
) -> None:
    """Generate a continuation of a prompt (with --chat, an answer to it), streaming tokens as they come."""
    from workbench.generate import GenerateRequest, run_generate

    if (prompt is None) == (prompt_ids is None):
        fail("give exactly one of --prompt and --prompt-ids")
    ids = None
    if prompt_ids is not None:
        try:
            ids = [int(x) for x in prompt_ids.split(",") if x.strip()]
        except ValueError:
            fail(f"--prompt-ids must be comma-separated integers, got {prompt_ids!r}")
    try:
        engine = engine_config(dtype=dtype, prefill_chunk_size=chunk_size, deterministic=deterministic)
        req = GenerateRequest(model=model, prompt=prompt, prompt_ids=ids, max_new_tokens=max_new_tokens,
                              greedy=greedy, temperature=temperature, top_p=top_p, seed=seed, engine=engine,
                              device=device, as_json=as_json, chat=chat, system=system, verbose=verbose)
        run_generate(req, out=sys.stdout, err=sys.stderr)
    except ValueError as e:
        fail(str(e))


@app.command()
def drill(
    model: Path = typer.Option(..., "--model", help="model folder (config.json + safetensors)"),
    names: list[str] = typer.Option(None, "--drill", help="run only these drills (repeatable)"),
    block_size: int = typer.Option(16, "--block-size", min=1),
    prompt_len: int = typer.Option(96, "--prompt-len", min=2),
    dtype: str = typer.Option("fp32", "--dtype", help=DTYPE_HELP),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Break each kind of cached state on purpose and show the next hit is still exact (a progress
    bar on stderr when it is a terminal and --json is not given)."""
    from workbench.drill import run
    from workbench.progress import wanted

    try:
        silent = run(model, names or None, block_size, prompt_len, dtype, as_json, sys.stdout, wanted(as_json),
                     engine_config(dtype))
    except ValueError as e:
        fail(str(e))
    if silent:
        raise typer.Exit(1)


@app.command()
def replay(
    files: list[Path] = typer.Argument(..., help="scripted sessions (JSONL); see sample_sessions/"),
    model: str | None = typer.Option(None, "--model", help="override the sessions' model (folder or name)"),
    db: Path | None = typer.Option(None, "--db", help="run in this database (default: a temporary one each)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Run scripted chat sessions (turns, branches, edits, restarts, faults) and check their
    expectations; exits 1 when one fails. A progress bar counts the steps on stderr when it is a
    terminal and --json is not given."""
    import sqlite3

    from workbench.options import CHAT_PREFILL_CHUNK
    from workbench.progress import bar, wanted
    from workbench.replay import ScriptError, count_steps, parse, replay_file

    try:
        engine = engine_config(prefill_chunk_most=CHAT_PREFILL_CHUNK)
        total = sum(count_steps(parse(f)) for f in files)  # every file is checked before anything runs
        reports = []
        with bar(total, "steps", wanted(as_json)) as counter:
            for f in files:
                if not as_json:
                    typer.echo(f"{f}:")
                reports.append(replay_file(f, db, model, None if as_json else typer.echo, counter, engine))
    except (ScriptError, ValueError, RuntimeError) as e:  # ConfigError, WeightsError; RuntimeError: a restart failed
        fail(str(e))
    except (sqlite3.DatabaseError, OSError) as e:
        fail(f"cannot open the workbench database {db or '(a temporary one)'}: {e}")
    failed = sum(r["failed"] for r in reports)
    if as_json:
        typer.echo(json.dumps({"files": reports, "failed": failed}))
    else:
        typer.echo(f"{len(files)} session(s), {sum(len(r['steps']) for r in reports)} steps, {failed} failed")
    if failed:
        raise typer.Exit(1)


@app.command("inspect")
def inspect_db(
    db: Path | None = typer.Argument(None, help=DB_HELP),
    verify: bool = typer.Option(False, "--verify", help="re-check every checksum and fingerprint"),
    gc: bool = typer.Option(False, "--gc", help="remove segments no chain can reach"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    session: str | None = typer.Option(None, "--session", help="one conversation (id or unique prefix): "
                                       "its branches and message tree"),
) -> None:
    """Show what the workbench file holds: segments, bytes and compression by state kind, and
    conversations (with their models and branches); with --session, one conversation's branches and
    message tree. The first line names the file read. Exit 1 on any finding (--verify, or a damaged
    conversation) or a file that is not a readable workbench database."""
    from workbench.inspect_cmd import DatabaseUnreadable, inspect

    if session is not None and (verify or gc):
        fail("--session shows one conversation; run --verify and --gc without it")
    try:
        bad = inspect(db, verify, gc, as_json, sys.stdout, session)
    except DatabaseUnreadable as e:
        fail(str(e), 1)
    except ValueError as e:
        fail(str(e))
    if bad:
        raise typer.Exit(1)


@app.command()
def conversations(
    limit: int = typer.Option(20, "-n", "--limit", min=1, help="list at most this many, newest first"),
    query: str | None = typer.Option(None, "-q", "--query", help="only conversations with a message (or title) "
                                     "holding this text, case-insensitively"),
    db: Path | None = typer.Option(None, "--db", help=DB_HELP),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """List the stored conversations, newest first: id, last update, model, branches, messages and
    title (the first user message). Continue one with `hcw chat --session ID` (the latest: `hcw chat
    -c`), write one out with `hcw export ID`."""
    from workbench.history import list_conversations
    from workbench.inspect_cmd import DatabaseUnreadable

    try:
        list_conversations(db, limit, query, as_json, sys.stdout)
    except DatabaseUnreadable as e:
        fail(str(e), 1)
    except ValueError as e:
        fail(str(e))


@app.command()
def export(
    conversation: str = typer.Argument(..., help="conversation id, or a unique prefix of one"),
    branch: str | None = typer.Option(None, "--branch", help="branch name or id prefix (default: the most recently "
                                      "updated branch, the one `hcw chat --session` continues)"),
    fmt: str = typer.Option("md", "--format", help="md (Markdown) | json"),
    db: Path | None = typer.Option(None, "--db", help=DB_HELP),
) -> None:
    """Print one branch of a stored conversation, root first, as Markdown or JSON. Exit 1 when the
    branch's history is damaged (`hcw inspect --session ID` shows what is intact)."""
    from store.conversations import ConversationDamaged
    from workbench.history import export as write_export
    from workbench.inspect_cmd import DatabaseUnreadable

    try:
        write_export(db, conversation, branch, fmt, sys.stdout)
    except (DatabaseUnreadable, ConversationDamaged) as e:
        fail(str(e), 1)
    except KeyError as e:
        fail(e.args[0])
    except ValueError as e:
        fail(str(e))


@app.command()
def chat(
    model: str = typer.Option("hcw-tiny", "--model", help="model folder, or a built-in model's name (`hcw models`)"),
    db: Path | None = typer.Option(None, "--db", help=DB_HELP),
    session: str | None = typer.Option(None, "--session", help="resume a stored conversation (id or prefix; "
                                       "`hcw conversations` lists them)"),
    continue_last: bool = typer.Option(False, "-c", "--continue", help="resume the most recently updated "
                                       "conversation"),
    system: str | None = typer.Option(None, "--system", help="a new conversation's system message (default: "
                                      f"{CHAT_DEFAULTS['system']!r}; '' for none)"),
    reuse: str = typer.Option("exact", "--reuse", help="exact (default: only provably exact reuse) | approximate "
                              "(Tail-Replay within --replay-budget, labelled) | off"),
    replay_budget: str = typer.Option("5%", "--replay-budget", help="approximate: tokens a GDN replay may take, "
                                      "a share of the matched prefix (5%, 0.05), a count (512), or 'adaptive'"),
    replay_tolerance: float | None = typer.Option(None, "--replay-tolerance", help="approximate: per GDN layer the "
                                                  "shortest replay whose certified state-error bound is below this "
                                                  "(default 1e-3 with --replay-budget adaptive)"),
    gdn_sketches: int = typer.Option(0, "--gdn-sketches", help="approximate: every N segments keep an int8 sketch "
                                     "of each GDN state (~1/4 of an exact checkpoint's bytes) where no checkpoint "
                                     "is kept; a replay may restart from one, its certified bound far lower than "
                                     "from zero (0: none)"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, help="tokens an answer may take"),
    sample: bool = typer.Option(False, "--sample", help="temperature/top-p sampling instead of greedy"),
    temperature: float | None = typer.Option(None, "--temperature", help="sampling temperature, > 0 (default "
                                             f"{CHAT_DEFAULTS['temperature']}; turns sampling on)"),
    top_p: float | None = typer.Option(None, "--top-p", help="nucleus sampling's probability mass, in (0, 1] "
                                       f"(default {CHAT_DEFAULTS['top_p']}; turns sampling on)"),
    seed: int | None = typer.Option(None, "--seed", help=f"the sampler's seed (default {CHAT_DEFAULTS['seed']})"),
    plain: bool = typer.Option(False, "--plain", help="line-based REPL (also used when stdin is not a terminal)"),
    as_json: bool = typer.Option(False, "--json", help="plain mode: one JSON object per answer or command"),
    deterministic: bool = typer.Option(False, "--deterministic", help=DETERMINISTIC_HELP),
    dtype: str = typer.Option("fp32", "--dtype", help=DTYPE_HELP),
    verbose: bool = typer.Option(False, "--verbose", help="plain mode: after each answer, Ollama-style stats "
                                 "(load, prompt eval and eval counts and rates, cached tokens) on stderr"),
) -> None:
    """Chat with a model: the Textual workbench on a terminal, a line-based REPL otherwise. Every
    turn is saved in the workbench file (--db; default $HCW_HOME/hcw.db, without HCW_HOME
    ~/.local/share/hcw/hcw.db) as it is answered."""
    from engine.config import ConfigError, ModelConfig
    from engine.model.loader import resolve_model
    from workbench.remote import EngineProcessError, RemoteSession
    from workbench.options import CHAT_PREFILL_CHUNK, ChatOptions, parse_budget
    from workbench.session import ChatSession

    import sqlite3

    # only what was given: the rest keeps ChatOptions' defaults
    given = {k: v for k, v in {"temperature": temperature, "top_p": top_p, "seed": seed}.items() if v is not None}
    if system is not None:
        if session is not None or continue_last:  # a stored conversation keeps the system message it began with
            fail("--system starts a new conversation; --session and --continue resume one whose system "
                 "message is already in its tree")
        given["system"] = system or None  # '': no system message
    try:
        opts = ChatOptions.of(model=model, db=db, session=session, continue_last=continue_last, reuse=reuse,
                              max_new_tokens=max_new_tokens, greedy=not (sample or temperature is not None
                                                                         or top_p is not None),
                              replay_budget=(budget := parse_budget(replay_budget)),
                              replay_tolerance=replay_tolerance if replay_tolerance or budget else 1e-3,
                              sketch_every=gdn_sketches, deterministic=deterministic,
                              engine=engine_config(dtype, prefill_chunk_most=CHAT_PREFILL_CHUNK), **given)
        line_based = plain or as_json or not sys.stdin.isatty()
        if line_based:
            t0 = time.perf_counter()
            chat_session = ChatSession(opts)
            load_ms = 1000 * (time.perf_counter() - t0)
        else:
            # the workbench generates in a process of its own, so that drawing never holds up
            # decoding; the screen is drawn while that process loads the model (what it may still
            # refuse, the app then says and exits 1); a folder that is no model is refused here
            ModelConfig.from_folder(resolve_model(model))
            chat_session = RemoteSession(opts, wait=False)
    except (ConfigError, ValueError, KeyError, EngineProcessError) as e:
        fail(e.args[0] if e.args else str(e))
    except (sqlite3.DatabaseError, OSError) as e:
        fail(f"cannot open the workbench database {db or '(default)'}: {e}")
    if line_based:
        from workbench.plain import run_plain

        raise typer.Exit(run_plain(chat_session, sys.stdin, sys.stdout, as_json,
                                   verbose_load_ms=load_ms if verbose else None))
    from workbench.tui.app import ChatApp

    workbench = ChatApp(chat_session)
    workbench.run()
    raise typer.Exit(workbench.return_code or 0)  # 1 when the engine's process died under it


# the commands about models (and `hcw bench`) and `hcw serve`, registered on `app` as their module is imported
import workbench.cli_models  # noqa: E402,F401
import workbench.cli_serve  # noqa: E402,F401


def main() -> None:
    app()


if __name__ == "__main__":
    main()
