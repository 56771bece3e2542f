"""`forge-ckpt`: look into checkpoint folders from the shell.

forge-ckpt list FOLDER          steps, committed or not, size, components
forge-ckpt inspect STEP_FOLDER  manifest, components, tensor shapes and dtypes
forge-ckpt verify STEP_FOLDER   every file against its size and crc32c (exit 1 if any fails)
forge-ckpt gc FOLDER            remove uncommitted steps (takes the folder lock)
"""

from __future__ import annotations

import os
import time
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from . import commit, layout
from .errors import CheckpointCorruptError, CheckpointError
from .lock import FolderLock
from .storage import verify_file

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n\n")[0])
console = Console(soft_wrap=True)  # paths and messages stay on one line, greppable
if not console.is_terminal:  # piped or captured: wide tables rather than wrapped cells
    console.width = 200


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


@app.command("list")
def list_steps(folder: str) -> None:
    """Every step folder: committed or not, size on disk, components."""
    table = Table("step", "committed", "size", "components", "created")
    for step in layout.all_steps(folder):
        path = layout.step_dir(folder, step)
        try:
            m = layout.read_committed(path)
            comps = ", ".join(f"{k}×{c.replicas}" for k, c in m.components.items())
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created))
            table.add_row(str(step), "[green]yes", _mb(_size(path)), comps, created)
        except CheckpointCorruptError as e:
            table.add_row(str(step), f"[red]no[/] ({e.problem})", _mb(_size(path)), "", "")
    console.print(table)


def _committed_or_exit(step_folder: str) -> layout.Manifest:
    try:
        return layout.read_committed(step_folder)
    except CheckpointCorruptError as e:
        console.print(f"[red]FAIL[/] {escape(str(e))}")
        raise typer.Exit(1) from None


@app.command()
def verify(step_folder: str) -> None:
    """Check every file of a committed step against the manifest; exit 1 on any problem."""
    manifest = _committed_or_exit(step_folder)
    bad = 0
    for rec in manifest.files:
        try:
            verify_file(os.path.join(step_folder, rec.path), rec)
            console.print(f"[green]ok[/]   {rec.path} ({_mb(rec.size)}, crc32c {rec.crc32c})")
        except CheckpointCorruptError as e:
            bad += 1
            console.print(f"[red]FAIL[/] {escape(rec.path)}: {escape(e.problem)}")
    summary = f"{len(manifest.files) - bad} of {len(manifest.files)} files intact"
    console.print(summary if not bad else f"[red]{summary}")
    if bad:
        raise typer.Exit(1)


@app.command()
def inspect(step_folder: str) -> None:
    """Manifest, components and the shapes and dtypes of what each file holds."""
    from . import serialization

    manifest = _committed_or_exit(step_folder)
    console.print(
        f"step {manifest.step}  format v{manifest.format_version}  "
        f"{_mb(manifest.nbytes)}  fingerprint {manifest.fingerprint}"
    )
    console.print(f"versions {manifest.versions}  extra {manifest.extra}")
    root = Tree(step_folder)
    for name, comp in manifest.components.items():
        node = root.add(f"[bold]{name}[/] ({comp.kind}, {comp.replicas}×, {comp.seconds:.2f}s)")
        for rec in comp.files:
            leaf = node.add(f"{rec.path}  {_mb(rec.size)}")
            full = os.path.join(step_folder, rec.path)
            try:
                if rec.path.endswith(".msgpack"):
                    verify_file(full, rec)
                    _tree(leaf, serialization.describe(full))
                elif rec.path == ".metadata":
                    verify_file(full, rec)  # a pickle: only opened once it matches the manifest
                    _dcp_tree(leaf, step_folder)
            except CheckpointError as e:
                leaf.add(f"[red]{escape(str(e))}")
    console.print(root)


def _tree(node: Tree, value: Any, depth: int = 0) -> None:
    if isinstance(value, dict) and depth < 6:
        for k, v in list(value.items())[:50]:
            if isinstance(v, (dict, list, tuple)) and v:
                _tree(node.add(str(k)), v, depth + 1)
            else:
                node.add(f"{k}: {_short(v)}")
    elif isinstance(value, (list, tuple)):
        node.add(f"{type(value).__name__} of {len(value)}: {_short(value)}")
    else:
        node.add(_short(value))


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) < 100 else text[:97] + "..."


def _dcp_tree(node: Tree, step_folder: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(step_folder).read_metadata()
    for key, md in sorted(meta.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            node.add(
                f"{key}: tensor({str(md.properties.dtype).removeprefix('torch.')}, {list(md.size)})"
            )
        else:
            node.add(f"{key}: {type(md).__name__}")


@app.command()
def gc(folder: str) -> None:
    """Remove steps that were never committed (leftovers of crashed saves)."""
    lock = FolderLock(folder)
    try:
        lock.acquire()
    except CheckpointError as e:
        console.print(f"[red]{escape(str(e))}")
        raise typer.Exit(1) from None
    try:
        removed = commit.remove_uncommitted(folder)
    finally:
        lock.release()
    console.print(
        f"removed {len(removed)} uncommitted step(s): {removed}" if removed else "nothing to remove"
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
