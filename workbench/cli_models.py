"""`hcw models`, `show`, `train-tiny`, `random-model` and `bench replay`: the commands about models."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import typer

from workbench.cli_app import DTYPE_HELP, app, engine_config, fail


@app.command()
def models(as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """The built-in models (loadable by name, nothing downloaded): parameters, layers, what one
    sequence's state costs per token and whatever its length, and the layer kinds."""
    from workbench.catalog import builtins, table

    found = builtins()
    typer.echo(json.dumps({"models": found}) if as_json else table(found), nl=as_json)


@app.command()
def show(
    model: str = typer.Argument(..., help="a built-in model's name (`hcw models`) or a model folder"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """One model from its config.json (its weights are not loaded): type, parameters, layer kinds
    and order, sizes, tokenizer and chat template, and its state's bytes by state kind."""
    from workbench.catalog import describe, details

    try:
        found = describe(model)
    except ValueError as e:  # ConfigError: no such folder or name, a config hcw cannot run
        fail(str(e))
    typer.echo(json.dumps(found) if as_json else details(found), nl=as_json)


@app.command("train-tiny")
def train_tiny(
    out: Path = typer.Option(..., "--out", help="folder for the weights, config and loss log"),
    minutes: float = typer.Option(88.0, "--minutes", min=0.1, help="time bound (a slow machine stops early)"),
    steps: int = typer.Option(2200, "--steps", min=1, help="the run's length in steps"),
    seed: int = typer.Option(0, "--seed"),
    hidden: int = typer.Option(128, "--hidden", min=32),
    seq_len: int = typer.Option(2048, "--seq-len", min=64, help="final length (the curriculum starts shorter)"),
    batch_size: int = typer.Option(3, "--batch", min=1, help="final batch (doubled per halved length)"),
    halvings: int = typer.Option(5, "--halvings", min=0, help="curriculum steps: each halves the length"),
    lr: float = typer.Option(2e-3, "--lr", min=0.0),
    init_from: Path | None = typer.Option(None, "--init-from", help="continue from this model folder's weights"),
    arch: str = typer.Option("hcw_hybrid", "--arch",
                             help="hcw_hybrid (hcw-tiny: every layer kind) or qwen3_5 (3 GDN : 1 full attention)"),
) -> None:
    """Train hcw-tiny (every layer kind), or a Qwen3.5-architecture model with --arch qwen3_5, on
    the synthetic recall data, on this machine's CPU."""
    from workbench.tiny.train import TrainConfig, train

    engine_config()  # the kernel choice (HCW_KERNELS, HCW_NATIVE) for training and its evaluation

    if hidden % 32 or (arch == "qwen3_5" and hidden % 64):
        fail("--hidden must be a multiple of 32 (of 64 for qwen3_5)")
    if arch not in ("hcw_hybrid", "qwen3_5"):
        fail(f"--arch must be hcw_hybrid or qwen3_5, not {arch!r}")
    summary, _ = train(TrainConfig(hidden=hidden, seq_len=seq_len, batch_size=batch_size, steps=steps,
                                minutes=minutes, seed=seed, halvings=halvings, lr=lr, arch=arch), out,
                       progress=lambda line: typer.echo(line, err=True), init_from=init_from)
    typer.echo(json.dumps({k: v for k, v in summary.items() if k != "config"}))


@app.command("random-model")
def random_model(
    out: Path = typer.Argument(..., help="folder to write config.json + model.safetensors into"),
    hidden: int = typer.Option(256, "--hidden", min=64),
    layers: int = typer.Option(8, "--layers", min=1),
    attn_every: int = typer.Option(4, "--attn-every", min=1, help="one full-attention layer every N layers"),
    seed: int = typer.Option(0, "--seed"),
    mixed: bool = typer.Option(False, "--mixed", help="every layer kind in one model"),
) -> None:
    """Write a random-weight hybrid (byte tokenizer) for trying the engine out: Qwen3.5-style, or
    with --mixed an hcw_hybrid with every layer kind (GDN, full, sliding, CSA, HCA)."""
    from engine.model.random_init import hcw_hybrid_dict, qwen3_5_text_dict, write_random_model

    if hidden % 64:
        fail("--hidden must be a multiple of 64")
    if mixed:
        raw = hcw_hybrid_dict(hidden=hidden)
    else:
        raw = qwen3_5_text_dict(hidden=hidden, layers=layers, attn_every=attn_every)
    write_random_model(out, raw, seed=seed)
    typer.echo(json.dumps({"model": str(out), "model_type": raw["model_type"], "hidden": hidden,
                           "layers": raw["num_hidden_layers"]}))


bench = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Measurements that need a model (scripts in benchmarks/ cover the rest).")
app.add_typer(bench, name="bench")


@bench.command("replay")
def bench_replay(
    model: str = typer.Option("hcw-tiny", "--model", help="model folder, or a built-in model's name"),
    prefix_lengths: str = typer.Option("8192,16384,32768", "--prefix-lengths", help="comma-separated token counts"),
    budgets: str = typer.Option("0.01,0.02,0.05,0.1,0.2,adaptive", "--budgets",
                                help="fractions of the prefix, token counts, and/or 'adaptive'"),
    tolerance: float = typer.Option(1e-3, "--tolerance", help="adaptive: the certified bound each layer keeps under"),
    tasks: int = typer.Option(4, "--tasks", min=1, help="needle tasks per prefix length"),
    sketch_every: int = typer.Option(0, "--sketch-every", help="measure each approximate policy again with int8 "
                                     "GDN sketches kept every N segments of the context (0: not)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    write_docs: bool = typer.Option(False, "--write-docs", help="write the table and plot into docs/"),
    dtype: str = typer.Option("fp32", "--dtype", help=DTYPE_HELP),
) -> None:
    """Tail-Replay vs full prefill: quality and TTFT by prefix length and replay budget (a progress
    bar counts the tasks on stderr when it is a terminal and --json is not given)."""
    from workbench.bench_replay import markdown, parse_budgets, plot, run_bench
    from workbench.progress import bar, wanted

    try:
        engine = engine_config(dtype)
        lengths = [int(x) for x in prefix_lengths.split(",") if x.strip()]
        if not lengths or min(lengths) < 64:
            raise ValueError("--prefix-lengths: give token counts of at least 64")
        with bar(len(lengths) * tasks, "tasks", wanted(as_json)) as counter:
            report = run_bench(model, lengths, parse_budgets(budgets, tolerance, sketch_every), tasks,
                               progress=None if as_json else lambda line: typer.echo(line, err=True),
                               counter=counter, engine=engine)
    except ValueError as e:  # ConfigError is one
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(report))
    else:
        typer.echo(markdown(report))
    if write_docs:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ lives beside the packages
        from benchmarks.report import DOC, write_section

        name = re.sub(r"[^A-Za-z0-9.]+", "-", Path(model).name).strip("-")  # one section per model
        image = DOC.parent / "img" / f"replay-{name}.png"
        image.parent.mkdir(exist_ok=True)
        plot(report, image)
        write_section(f"replay-{name}", f"Tail-Replay on {name}: fidelity, quality and TTFT by budget "
                      "(`hcw bench replay`)", markdown(report) + f"\n\n![replay on {name}](img/{image.name})")


@app.command()
def quantise(
    model: str = typer.Argument(..., help="a built-in model's name (`hcw models`) or a model folder"),
    out: Path = typer.Argument(..., help="the folder to write (new, or empty)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Write MODEL with int8 weights (a float32 scale per row and group of 32, llama.cpp's q8_0
    idea) as a new folder that loads with --dtype int8 without quantising again: its weights are
    read from the file as they are (at Qwen3.5-0.8B's shape 0.1-0.4 s against 1.3-1.6 s). The
    quantisation is --dtype int8's at load, so the two load the same weights."""
    import time

    from engine.model.loader import save_int8
    from workbench.progress import bar, wanted

    t0 = time.perf_counter()
    try:
        with bar(None, "quantise", wanted(as_json)) as steps:  # a bar of weights on stderr at a terminal
            summary = save_int8(model, out, progress=steps)
    except ValueError as e:  # ConfigError, WeightsError: no such model, damaged weights, out not empty
        fail(str(e))
    except OSError as e:  # reading the source or writing out: the file says which
        fail(f"quantise stopped: {e.strerror or e}" + (f" ({e.filename})" if e.filename else ""), code=1)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    mib = 1 << 20
    typer.echo(json.dumps(summary) if as_json else
               f"wrote {out}: {summary['bytes'] / mib:,.1f} MiB of weights (from {summary['source_bytes'] / mib:,.1f} MiB) "
               f"in {summary['seconds']:.1f} s; load it with --dtype int8")
