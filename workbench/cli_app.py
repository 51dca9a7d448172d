"""The `hcw` typer app, its `--version`, and `fail`: what every command module of the CLI shares."""

from __future__ import annotations

import os

import typer

# rich_markup_mode=None: click's help layout, in which a flag reads as a flag (typer's rich panels
# show every one as taking a <bool>) and a docstring's line breaks are joined into paragraphs
app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                  help="hcw: hybrid cache workbench for hybrid-attention language models.")


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import version

        typer.echo(f"hcw {version('hcw')}")
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                            help="print hcw's version and exit")) -> None:
    """hcw: hybrid cache workbench for hybrid-attention language models."""


def fail(message: str, code: int = 2) -> None:
    """The one-line error a command ends with (exit 2: bad input; 1: the work failed)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


# store/db.py's default_home(), in words
DB_HELP = ("workbench file: conversations and cached segments (default: $HCW_HOME/hcw.db, else "
           "$XDG_DATA_HOME/hcw/hcw.db, else ~/.local/share/hcw/hcw.db)")


# --dtype, where a command loads a model
DTYPE_HELP = "fp32 | bf16 | fp16 | int8 (the projections int8 with a scale per group of 32, the rest and all compute fp32)"


def engine_config(dtype: str = "fp32", **given):
    """The EngineConfig a command runs with, the HCW_KV / HCW_KERNELS / HCW_NATIVE / HCW_STATIC
    variables mapped onto it; the command hands it to what it runs (EngineConfig.bind sets the KV
    layout on the model it loads). The kernel choice is also made for the whole process. A bad
    value (a variable's, or the dtype) ends the command with one line, exit 2."""
    from engine.config import ConfigError, parse_dtype
    from engine.engine_config import EngineConfig
    from kernels import dispatch

    try:
        config = EngineConfig.from_env(os.environ, dtype=parse_dtype(dtype), **given)
    except ConfigError as e:
        fail(str(e))
    dispatch.select(config.kernels, config.native)
    return config
