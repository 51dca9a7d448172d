"""`hcw serve`: the OpenAI-compatible server (workbench/serve)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import typer

from workbench.cli_app import DB_HELP, DTYPE_HELP, app, engine_config, fail


@app.command()
def serve(
    model: str = typer.Option("hcw-tiny", "--model", help="model folder, or a built-in model's name (`hcw models`)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (not loopback: needs --api-key)"),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="port (0: any free one, printed at start)"),
    db: Path | None = typer.Option(None, "--db", help=DB_HELP),
    reuse: str = typer.Option("exact", "--reuse", help="exact | approximate | off"),
    max_batch: int = typer.Option(8, "--max-batch", help="requests decoded together"),
    max_queue: int = typer.Option(64, "--max-queue", help="requests waiting for a slot before a 429"),
    max_tokens: int = typer.Option(512, "--max-tokens", help="a request's max_tokens when it gives none"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="HCW_API_KEY",
                                       help="require `Authorization: Bearer KEY` (or set HCW_API_KEY)"),
    insecure_no_auth: bool = typer.Option(False, "--insecure-no-auth", help="serve a non-loopback --host "
                                          "without a key"),
    threads: int | None = typer.Option(None, "--threads", min=1, help="CPU threads for the model (default: one "
                                       "fewer than the cores, at least one: the HTTP side and the clients keep "
                                       "one; on a machine busy with other work, fewer decode faster)"),
    dtype: str = typer.Option("fp32", "--dtype", help=DTYPE_HELP),
) -> None:
    """Serve the model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models),
    with /health and Prometheus /metrics. Every response says what the cache reused: OpenAI's
    usage.prompt_tokens_details.cached_tokens, llama.cpp's timings and an `hcw` object (outcome,
    usable vs logical tokens, the plan per state kind, exact or approximate, reasons). Concurrent
    requests are decoded together. Binds 127.0.0.1 unless told otherwise."""
    from workbench.options import CHAT_PREFILL_CHUNK, ChatOptions
    from workbench.serve.run import check_exposure, serve as run
    from workbench.serve.served import ServeOptions

    try:
        check_exposure(host, api_key, insecure_no_auth)
        chat = ChatOptions.of(model=model, db=db, reuse=reuse, engine=engine_config(dtype, prefill_chunk_most=CHAT_PREFILL_CHUNK))
        opts = ServeOptions(chat, max_batch=max_batch, max_queue=max_queue, max_tokens=max_tokens, api_key=api_key)
    except ValueError as e:
        fail(str(e))
    import torch

    from engine.threads import threads_beside_ui

    before = torch.get_num_threads()
    # a decode step's every op waits for all its threads: one preempted by the HTTP loop or a client
    # stalls the whole step, as beside a UI (engine/threads.py)
    torch.set_num_threads(threads if threads is not None else threads_beside_ui())
    try:
        run(opts, host, port)
    except ValueError as e:  # ConfigError, WeightsError: the model folder
        fail(str(e))
    except OSError as e:
        fail(str(e), code=1)
    except sqlite3.DatabaseError as e:
        fail(f"cannot open the workbench database {db or '(the default one)'}: {e}", code=1)
    finally:
        torch.set_num_threads(before)  # a caller in this process (a test) keeps its own


@app.command()
def top(
    url: str = typer.Argument("http://127.0.0.1:8080", help="the server's address (as `hcw serve` printed it)"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="HCW_API_KEY", help="the server's key, if it "
                                       "needs one"),
) -> None:
    """Watch a running `hcw serve`: its stats, the requests it answers, and for each one the
    validation panel and the segment state table of its prompt, live (q quits)."""
    from workbench.serve.top import TopApp

    if not url.startswith(("http://", "https://")):
        fail(f"URL must start with http:// or https://, got {url!r}")
    TopApp(url, api_key).run()
