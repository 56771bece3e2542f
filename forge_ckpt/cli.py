"""`forge-ckpt`: look into checkpoint folders from the shell.

forge-ckpt list FOLDER          steps, committed or not, size, components; quarantined steps
forge-ckpt inspect STEP_FOLDER  manifest, components, tensor shapes and dtypes
forge-ckpt verify STEP_FOLDER   every file against its size and crc32c (exit 1 if any fails)
forge-ckpt gc FOLDER            remove uncommitted steps (takes the folder's lease)
forge-ckpt export STEP_FOLDER OUT --format safetensors   the model weights for HF tooling
forge-ckpt copy STEP_FOLDER DEST_FOLDER   a committed step into another folder, committed there

FOLDER is a local path or `s3://bucket/prefix` (endpoint and credentials from the AWS
environment: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...); STEP_FOLDER is FOLDER/step-N.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from . import commit, layout
from .errors import CheckpointCorruptError, CheckpointError, CheckpointSignatureError
from .lock import Lease
from .signing import Signer
from .storage import Storage, open_storage

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n\n")[0])
console = Console(soft_wrap=True)  # paths and messages stay on one line, greppable
if not console.is_terminal:  # piped or captured: wide tables rather than wrapped cells
    console.width = 200


def _size(store: Storage, prefix: str) -> int:
    return sum(size for _, size in store.walk(prefix))


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _step_of(step_folder: str) -> tuple[Storage, int]:
    """The checkpoint folder's storage and the step number of `.../step-N`."""
    folder, _, name = step_folder.rstrip("/").rpartition("/")
    step = layout.parse_step(name)
    if step is None:
        console.print(f"[red]FAIL[/] {escape(step_folder)} is not a step folder (…/step-N)")
        raise typer.Exit(2)
    return open_storage(folder or "."), step


@app.command("list")
def list_steps(folder: str) -> None:
    """Every step folder: committed or not, size, components; and quarantined steps."""
    store = open_storage(folder)
    table = Table("step", "committed", "size", "components", "created")
    for step in layout.all_steps(store):
        size = _mb(_size(store, layout.step_name(step)))
        try:
            m = layout.read_committed(store, step)
            comps = ", ".join(f"{k}×{c.replicas}" for k, c in m.components.items())
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created))
            table.add_row(str(step), "[green]yes", size, comps, created)
        except CheckpointCorruptError as e:
            table.add_row(str(step), f"[red]no[/] ({escape(e.problem)})", size, "", "")
    console.print(table)
    for name in layout.quarantined(store):
        size = _mb(_size(store, f"{layout.QUARANTINE}/{name}"))
        console.print(f"[yellow]quarantined[/] {layout.QUARANTINE}/{name} ({size}): damaged, "
                      "passed over by fallback; inspect or delete it")  # fmt: skip


def _committed_or_exit(store: Storage, step: int) -> layout.Manifest:
    """The step's manifest; with FORGE_CKPT_SIGNING_KEY / FORGE_CKPT_VERIFY_KEYS set, its
    signature is checked too."""
    try:
        return layout.read_committed(store, step, Signer.from_config())
    except (CheckpointCorruptError, CheckpointSignatureError) as e:
        console.print(f"[red]FAIL[/] {escape(str(e))}")
        raise typer.Exit(1) from None


@app.command()
def verify(step_folder: str) -> None:
    """Check every file of a committed step against the manifest; exit 1 on any problem."""
    store, step = _step_of(step_folder)
    manifest = _committed_or_exit(store, step)
    sub = store.sub(layout.step_name(step))
    bad = 0
    for rec in manifest.files:
        try:
            sub.verify(rec.path, rec)
            _open_safely(sub, rec)
            console.print(f"[green]ok[/]   {rec.path} ({_mb(rec.size)}, crc32c {rec.crc32c})")
        except CheckpointCorruptError as e:
            bad += 1
            console.print(f"[red]FAIL[/] {escape(rec.path)}: {escape(e.problem)}")
    summary = f"{len(manifest.files) - bad} of {len(manifest.files)} files intact"
    console.print(summary if not bad else f"[red]{summary}")
    if bad:
        raise typer.Exit(1)


def _open_safely(store: Storage, rec: Any) -> None:
    """A checksum proves nothing against someone who rewrote the manifest too: decode what a
    load would decode (DCP metadata through the allowlist, actor file headers), never running
    anything, so a planted pickle is reported here instead of at load."""
    from . import serialization
    from .dcp_metadata import load_metadata

    if rec.path == ".metadata":
        load_metadata(store.read(rec.path), store.where(rec.path))
    elif rec.path.endswith(".msgpack"):
        serialization.describe_from(store, rec.path)


@app.command()
def inspect(step_folder: str) -> None:
    """Manifest, components and the shapes and dtypes of what each file holds."""
    from . import serialization

    store, step = _step_of(step_folder)
    manifest = _committed_or_exit(store, step)
    sub = store.sub(layout.step_name(step))
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
            try:
                if rec.path.endswith(".msgpack"):
                    sub.verify(rec.path, rec)
                    _tree(leaf, serialization.describe_from(sub, rec.path))
                elif rec.path == ".metadata":
                    _dcp_tree(leaf, sub, rec)  # a pickle: only opened through the allowlist
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


def _dcp_tree(node: Tree, store: Storage, rec: Any) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp_metadata import load_metadata

    meta = load_metadata(store.read_verified(rec.path, rec), store.where(rec.path))
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
    store = open_storage(folder)
    lease = Lease(store, ttl_s=60.0)
    try:
        lease.acquire()
    except CheckpointError as e:
        console.print(f"[red]{escape(str(e))}")
        raise typer.Exit(1) from None
    try:
        removed = commit.remove_uncommitted(store)
    finally:
        lease.release()
    console.print(
        f"removed {len(removed)} uncommitted step(s): {removed}" if removed else "nothing to remove"
    )


class ExportFormat(str, Enum):
    safetensors = "safetensors"


@app.command()
def export(
    step: Annotated[
        str, typer.Argument(metavar="STEP", help="FOLDER/step-N; or N / latest with --folder")
    ],
    out: Annotated[
        str, typer.Argument(metavar="OUT", help="output folder (local or s3://); empty")
    ],
    fmt: Annotated[ExportFormat, typer.Option("--format")] = ExportFormat.safetensors,
    folder: Annotated[str | None, typer.Option(help="the checkpoint folder of STEP")] = None,
    max_shard_size: Annotated[str, typer.Option(help="2GB, 500MB, 1GiB or bytes")] = "2GB",
    dtype: Annotated[str | None, typer.Option(help="convert floats, e.g. bfloat16")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an earlier export in OUT")] = False,
) -> None:
    """The trainer's model weights (no optimizer, LR or RNG) of a committed step, as sharded
    safetensors with model.safetensors.index.json; exit 1 if the step or a file is bad."""
    from .export import export_safetensors, parse_dtype, parse_size

    del fmt  # the only format so far; naming it keeps command lines explicit and future-proof
    try:
        limit = parse_size(max_shard_size)
        to = None if dtype is None else parse_dtype(dtype)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    store, n = _export_source(step, folder)
    try:
        done = export_safetensors(
            store, n, out, max_shard_size=limit, dtype=to, overwrite=overwrite,
            signer=Signer.from_config(),
        )  # fmt: skip
    except CheckpointError as e:
        console.print(f"[red]FAIL[/] {escape(str(e))}")
        raise typer.Exit(1) from None
    for name in done.files:
        console.print(f"[green]wrote[/] {escape(name)}")
    console.print(f"step {done.step}: {done.tensors} tensors, {_mb(done.total_size)} "
                  f"in {len(done.files) - 1} shard(s) to {escape(out)}")  # fmt: skip


def _export_source(step: str, folder: str | None) -> tuple[Storage, int]:
    """STEP as a step folder, or as N / 'latest' of --folder."""
    if folder is None:
        return _step_of(step)
    store = open_storage(folder)
    if step == "latest":
        steps = layout.committed_steps(store)
        if not steps:
            console.print(f"[red]FAIL[/] {escape(folder)} has no committed step")
            raise typer.Exit(1)
        return store, steps[-1]
    if not step.isdigit():
        raise typer.BadParameter(f"{step!r}: with --folder, STEP is a step number or 'latest'")
    return store, int(step)


@app.command()
def copy(
    step_folder: Annotated[str, typer.Argument(metavar="SRC_STEP", help="FOLDER/step-N")],
    dest: Annotated[str, typer.Argument(metavar="DEST_FOLDER", help="a checkpoint folder")],
    overwrite: Annotated[bool, typer.Option(help="replace step-N if DEST has it")] = False,
    workers: Annotated[int, typer.Option(min=1, help="files copied at once")] = 4,
) -> None:
    """Copy a committed step into another checkpoint folder (local or s3://), every file
    checked against the manifest, committed there like a save (docs/copy.md); exit 1 if the
    step or a file is bad, DEST is leased by a live job or already has the step."""
    from .transfer import copy_progress, copy_step

    store, step = _step_of(step_folder)
    try:
        with copy_progress(console) as progress:
            done = copy_step(store, step, dest, overwrite=overwrite, workers=workers,
                             progress=progress)  # fmt: skip
    except (CheckpointError, ValueError, OSError) as e:
        console.print(f"[red]FAIL[/] {escape(str(e))}")
        raise typer.Exit(1) from None
    console.print(f"committed step {done.step} at {escape(done.dest)}: {done.files} files, "
                  f"{_mb(done.nbytes)} in {done.seconds:.1f}s")  # fmt: skip


def main() -> None:
    app()


if __name__ == "__main__":
    main()
