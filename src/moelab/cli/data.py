"""`moelab data prepare` and `moelab data show`: tokenize a config's domains once into a token store, and read
one back.

    moelab data prepare experiments/my-data.yaml --out stores/web        # rerun after a kill to resume
    moelab data prepare --preset tiny --data my-data.yaml --out s3://bucket/stores/web
    moelab data show stores/web --json                                   # verify, then sources and token counts
    moelab train --preset tiny --data my-data.yaml --set data.store=stores/web
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moelab.cli.common import ConfigArg, DataOpt, JsonOpt, PresetOpt, SetOpt, err_console, out_console, resolve_config

__all__ = ["data_app", "prepare", "show"]

data_app = typer.Typer(no_args_is_help=True, help="Token stores: prepare a config's data once, read it from disk or a bucket.")


@data_app.command()
def prepare(
    config: ConfigArg = None,
    preset: PresetOpt = None,
    data: DataOpt = None,
    sets: SetOpt = None,
    out: Annotated[str, typer.Option(help="The store: a folder, or an s3:// / gs:// URL.")] = "stores/data",
    shard_tokens: Annotated[int, typer.Option(help="Tokens per shard (the last shard of a split holds the rest).")]
    = 1 << 24,
    json_out: JsonOpt = False,
) -> None:
    """Tokenize every domain of the config's data section into a token store (sharded .npy arrays, a manifest).

    Resumes after a kill without redoing finished shards; does nothing on a finished store. Train on it with
    `--set data.store=STORE`.
    """
    from rich.progress import Progress, TextColumn

    from moelab.data.store import prepare as prepare_store

    cfg = resolve_config(config, preset, sets, data)
    started = time.perf_counter()
    with Progress(TextColumn("[bold]prepare[/] {task.fields[status]}"), console=err_console, transient=False) as bar:
        task = bar.add_task("prepare", status="reading sources")

        def on_progress(tokens: int, read: int) -> None:
            rate = tokens / max(time.perf_counter() - started, 1e-9)
            bar.update(task, status=f"{tokens:,} tokens  {read / 1e6:,.1f} MB read  {rate:,.0f} tokens/s")

        manifest = prepare_store(cfg.data, out, shard_tokens=shard_tokens, on_progress=on_progress)
    _print_store(out, manifest, json_out)


@data_app.command()
def show(
    store: Annotated[str, typer.Argument(help="A token store: a folder or an s3:// / gs:// URL.")],
    verify: Annotated[bool, typer.Option("--verify", help="Re-hash every shard, whatever the verification cache "
                                                          "says.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Verify a token store and list its sources and token counts.

    Always: the manifest's structure and store hash, every shard's size, and the SHA-256 of every shard whose
    size, mtime, inode or ctime changed since it was last verified. With --verify: every shard's SHA-256.
    """
    from moelab.data.store import open_store

    opened = open_store(store, rehash=verify)
    _print_store(store, opened.manifest, json_out)


def _print_store(location: str, manifest: dict, json_out: bool) -> None:
    rows = {name: {split: d["splits"][split]["num_tokens"] for split in d["splits"]}
            for name, d in manifest["domains"].items()}
    if json_out:
        print(json.dumps({"store": location, "store_hash": manifest["store_hash"], "tokens": rows,
                          "domains": {name: d["sources"] for name, d in manifest["domains"].items()}}))
        return
    table = Table("domain", "train tokens", "held-out tokens", "sources", title=f"{location}  {manifest['store_hash'][:12]}")
    for name, d in manifest["domains"].items():
        sources = ", ".join(Path(s["path"]).name for s in d["sources"][:3]) + (" ..." if len(d["sources"]) > 3 else "")
        table.add_row(name, f"{rows[name]['train']:,}", f"{rows[name]['heldout']:,}", sources)
    out_console.print(table)
