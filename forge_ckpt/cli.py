"""`forge-ckpt`: look into checkpoint folders from the shell.

forge-ckpt list FOLDER          steps, committed or not, size, components; quarantined steps
forge-ckpt inspect STEP_FOLDER  manifest, components, tensor shapes and dtypes
forge-ckpt verify STEP_FOLDER   every file against its size and crc32c (exit 1 if any fails)
forge-ckpt gc FOLDER            remove uncommitted steps and stray files (takes the lease)
forge-ckpt export STEP_FOLDER OUT --format safetensors   the model weights for HF tooling
                                [--hf FAMILY:FLAVOR] [--hf-config DIR]   in HF names and layout
forge-ckpt diff STEP_A STEP_B   what differs between two steps, per component and tensor
forge-ckpt copy STEP_FOLDER DEST_FOLDER   a committed step into another folder, committed there

`--json` (list, inspect, verify, export, diff) prints one JSON object instead (schema in
docs/cli.md). Exit codes: 0 ok; 1 a checkpoint problem (not committed, damaged, refused);
2 a usage error; 3 `diff` found differences.

FOLDER is a local path or `s3://bucket/prefix` (endpoint and credentials from the AWS
environment: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...); STEP_FOLDER is FOLDER/step-N.
"""

from __future__ import annotations

import time
from enum import Enum
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from .errors import CheckpointCorruptError, CheckpointError, CheckpointSignatureError
from .steps import commit, layout
from .steps.lock import Lease
from .steps.signing import Signer
from .storage import Storage, open_storage
from .tools import report
from .tools.progress import progress

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n\n")[0])
JsonOpt = Annotated[bool, typer.Option("--json", help="one JSON object on stdout (docs/cli.md)")]
EXIT_DIFFERENT = 3  # `diff`: the steps differ (0: they do not)
console = Console(soft_wrap=True)  # paths and messages stay on one line, greppable
if not console.is_terminal:  # piped or captured: wide tables rather than wrapped cells
    console.width = 200


def _size(store: Storage, prefix: str) -> int:
    return sum(size for _, size in store.walk(prefix))


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _version() -> str:
    try:
        return version("forge_ckpt")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"forge-ckpt {_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="print version"),
    ] = False,
) -> None:
    """Look into checkpoint folders from the shell."""


def _fail(command: str | None, message: str, code: int = 1) -> typer.Exit:
    """Say what is wrong (a JSON error object under --json, else a red line); the caller
    raises the returned Exit."""
    if command is not None:
        typer.echo(report.dumps(command, {"error": message}))
    else:
        console.print(f"[red]FAIL[/] {escape(message)}")
    return typer.Exit(code)


def _step_of(step_folder: str, command: str | None = None) -> tuple[Storage, int]:
    """The checkpoint folder's storage and the step number of `.../step-N`."""
    folder, _, name = step_folder.rstrip("/").rpartition("/")
    step = layout.parse_step(name)
    if step is None:
        raise _fail(command, f"{step_folder} is not a step folder (…/step-N)", 2)
    return open_storage(folder or "."), step


@app.command("list")
def list_steps(folder: str, as_json: JsonOpt = False) -> None:
    """Every step folder: committed or not, size, components; and quarantined steps."""
    store = open_storage(folder)
    rows = [
        report.step_row(store, step, _size(store, layout.step_name(step)))
        for step in layout.all_steps(store)
    ]
    quarantined: list[dict[str, Any]] = [
        {"name": f"{layout.QUARANTINE}/{n}", "size": _size(store, f"{layout.QUARANTINE}/{n}")}
        for n in layout.quarantined(store)
    ]
    if as_json:
        body = {"folder": store.url, "steps": rows, "quarantined": quarantined}
        typer.echo(report.dumps("list", body))
        return
    table = Table("step", "committed", "size", "components", "created")
    for row in rows:
        size = _mb(row["size"])
        if not row["committed"]:
            table.add_row(str(row["step"]), f"[red]no[/] ({escape(row['problem'])})", size, "", "")
            continue
        comps = ", ".join(f"{k}×{c['replicas']}" for k, c in row["components"].items())
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["created"]))
        table.add_row(str(row["step"]), "[green]yes", size, comps, created)
    console.print(table)
    for q in quarantined:
        console.print(f"[yellow]quarantined[/] {q['name']} ({_mb(q['size'])}): damaged, "
                      "passed over by fallback; inspect or delete it")  # fmt: skip


def _committed_or_exit(store: Storage, step: int, command: str | None = None) -> layout.Manifest:
    """The step's manifest; with FORGE_CKPT_SIGNING_KEY / FORGE_CKPT_VERIFY_KEYS set, its
    signature is checked too."""
    try:
        return layout.read_committed(store, step, Signer.from_config())
    except (CheckpointCorruptError, CheckpointSignatureError) as e:
        raise _fail(command, str(e)) from None


@app.command()
def verify(step_folder: str, as_json: JsonOpt = False) -> None:
    """Check every file of a committed step against the manifest; exit 1 on any problem."""
    cmd = "verify" if as_json else None
    store, step = _step_of(step_folder, cmd)
    manifest = _committed_or_exit(store, step, cmd)
    sub = store.sub(layout.step_name(step))
    rows, done = [], 0
    with progress(f"verify step {step}") as advance:
        for rec in manifest.files:
            problem = None
            try:
                sub.verify(rec.path, rec)
                _open_safely(sub, rec)
            except CheckpointCorruptError as e:
                problem = e.problem
            rows.append({**rec.to_dict(), "ok": problem is None, "problem": problem})
            done += rec.size
            advance(done, manifest.nbytes)
            if not as_json:
                console.print(f"[green]ok[/]   {rec.path} ({_mb(rec.size)}, crc32c {rec.crc32c})"
                              if problem is None else
                              f"[red]FAIL[/] {escape(rec.path)}: {escape(problem)}")  # fmt: skip
    bad = sum(not r["ok"] for r in rows)
    if as_json:
        body = {"step_folder": sub.url, "step": step, "ok": not bad, "files": rows}
        typer.echo(report.dumps("verify", body))
    else:
        summary = f"{len(rows) - bad} of {len(rows)} files intact"
        console.print(summary if not bad else f"[red]{summary}")
    if bad:
        raise typer.Exit(1)


def _open_safely(store: Storage, rec: Any) -> None:
    """A checksum proves nothing against someone who rewrote the manifest too: decode what a
    load would decode (DCP metadata through the allowlist, actor file headers), never running
    anything, so a planted pickle is reported here instead of at load."""
    from . import serialization
    from .dcp.metadata import load_metadata

    if rec.path == ".metadata":
        load_metadata(store.read(rec.path), store.where(rec.path))
    elif rec.path.endswith(".msgpack"):
        serialization.describe_from(store, rec.path)


@app.command()
def inspect(step_folder: str, as_json: JsonOpt = False) -> None:
    """Manifest, components and the shapes and dtypes of what each file holds."""
    cmd = "inspect" if as_json else None
    store, step = _step_of(step_folder, cmd)
    manifest = _committed_or_exit(store, step, cmd)
    sub = store.sub(layout.step_name(step))
    if as_json:
        typer.echo(report.dumps("inspect", _inspect_body(sub, manifest)))
        return
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
                contents = _contents(sub, rec)
            except CheckpointError as e:
                leaf.add(f"[red]{escape(str(e))}")
                continue
            if rec.path == ".metadata":
                for key, text in _dcp_lines(contents):
                    leaf.add(f"{key}: {text}")
            elif contents is not None:
                _tree(leaf, contents)
    console.print(root)


def _inspect_body(sub: Storage, manifest: layout.Manifest) -> dict[str, Any]:
    body = report.manifest_body(manifest)
    for name, comp in manifest.components.items():
        for rec, row in zip(comp.files, body["components"][name]["files"], strict=True):
            try:
                row["contents"] = _contents(sub, rec)
            except CheckpointError as e:
                row["error"] = str(e)
    return body


def _contents(sub: Storage, rec: Any) -> Any:
    """What one file holds: an actor file's decoded header (tensors as text), the DCP
    metadata's entries ({"dtype", "shape"} per tensor, {"type"} otherwise), else None."""
    from . import serialization

    if rec.path.endswith(".msgpack"):
        sub.verify(rec.path, rec)
        return serialization.describe_from(sub, rec.path)
    if rec.path == ".metadata":  # a pickle: only opened through the allowlist
        return _dcp_entries(sub, rec)
    return None


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


def _dcp_entries(store: Storage, rec: Any) -> dict[str, dict[str, Any]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp.metadata import load_metadata

    meta = load_metadata(store.read_verified(rec.path, rec), store.where(rec.path))
    out: dict[str, dict[str, Any]] = {}
    for key, md in sorted(meta.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            dtype = str(md.properties.dtype).removeprefix("torch.")
            out[key] = {"dtype": dtype, "shape": list(md.size)}
        else:
            out[key] = {"type": type(md).__name__}
    return out


def _dcp_lines(entries: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    return [
        (k, f"tensor({e['dtype']}, {e['shape']})" if "dtype" in e else e["type"])
        for k, e in entries.items()
    ]


@app.command()
def gc(folder: str) -> None:
    """Remove steps that were never committed (leftovers of crashed saves) and files in
    committed steps that their manifest does not name (late writes of aborted saves)."""
    store = open_storage(folder)
    lease = Lease(store, ttl_s=60.0)
    try:
        lease.acquire()
    except CheckpointError as e:
        console.print(f"[red]{escape(str(e))}")
        raise typer.Exit(1) from None
    try:
        removed = commit.remove_uncommitted(store)
        strays = commit.remove_strays(store, Signer.from_config())
    finally:
        lease.release()
    if removed:
        console.print(f"removed {len(removed)} uncommitted step(s): {removed}")
    if strays:
        console.print(f"removed {len(strays)} stray file(s) of late writes: {strays}")
    if not removed and not strays:
        console.print("nothing to remove")


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
    hf: Annotated[
        str | None,
        typer.Option(
            help="Hugging Face names and layout: TorchTitan FAMILY:FLAVOR, e.g. llama3:8B"
        ),
    ] = None,
    hf_config: Annotated[
        str | None, typer.Option(help="copy config.json and tokenizer files of this HF folder")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """The trainer's model weights (no optimizer, LR or RNG) of a committed step, as sharded
    safetensors with model.safetensors.index.json; exit 1 if the step or a file is bad."""
    from .tools.export import export_safetensors, parse_dtype, parse_size

    del fmt  # the only format so far; naming it keeps command lines explicit and future-proof
    cmd = "export" if as_json else None
    try:
        limit = parse_size(max_shard_size)
        to = None if dtype is None else parse_dtype(dtype)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    store, n = _export_source(step, folder, cmd)
    try:
        with progress(f"export step {n}") as advance:
            done = export_safetensors(
                store, n, out, max_shard_size=limit, dtype=to, overwrite=overwrite,
                signer=Signer.from_config(), hf=hf, hf_config=hf_config, progress=advance,
            )  # fmt: skip
    except CheckpointError as e:
        raise _fail(cmd, str(e)) from None
    if as_json:
        body = {"step": done.step, "out": out, "files": done.files, "tensors": done.tensors,
                "total_size": done.total_size, "hf_model": done.hf, "assets": done.assets}  # fmt: skip
        typer.echo(report.dumps("export", body))
        return
    for name in [*done.assets, *done.files]:
        console.print(f"[green]wrote[/] {escape(name)}")
    names = f" ({escape(done.hf)} names)" if done.hf else ""
    console.print(f"step {done.step}: {done.tensors} tensors{names}, {_mb(done.total_size)} "
                  f"in {len(done.files) - 1} shard(s) to {escape(out)}", highlight=False)  # fmt: skip


def _export_source(step: str, folder: str | None, command: str | None) -> tuple[Storage, int]:
    """STEP as a step folder, or as N / 'latest' of --folder."""
    if folder is None:
        return _step_of(step, command)
    store = open_storage(folder)
    if step == "latest":
        steps = layout.committed_steps(store)
        if not steps:
            raise _fail(command, f"{folder} has no committed step")
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
    from .steps.transfer import copy_progress, copy_step

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


@app.command()
def diff(
    step_a: Annotated[str, typer.Argument(metavar="STEP_A", help="FOLDER/step-N")],
    step_b: Annotated[str, typer.Argument(metavar="STEP_B", help="FOLDER/step-M (any folder)")],
    show_all: Annotated[bool, typer.Option("--all", help="list unchanged entries too")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Per component and per tensor, array or value: unchanged, changed (largest absolute
    difference), added or removed. Exit 0 if the steps are the same, 3 if they differ."""
    from .tools.diff import UNCHANGED, diff_steps

    cmd = "diff" if as_json else None
    (store_a, a), (store_b, b) = _step_of(step_a, cmd), _step_of(step_b, cmd)
    try:
        result = diff_steps(store_a, a, store_b, b, Signer.from_config())
    except CheckpointError as e:
        raise _fail(cmd, str(e)) from None
    if as_json:
        typer.echo(report.dumps("diff", result.to_dict()))
    else:
        table = Table("component", "file", "key", "status", "shape", "dtype", "max |a-b|")
        for c in result.components:
            counts = ", ".join(f"{n} {k}" for k, n in c.counts().items() if n)
            table.add_row(f"[bold]{escape(c.name)}", "", "", _styled(c.status), "", "", counts)
            for row in c.entries:
                if row.status == UNCHANGED and not show_all:
                    continue
                shape = _pair(row.shape_a, row.shape_b)
                delta = "" if row.max_abs_diff is None else f"{row.max_abs_diff:.6g}"
                table.add_row("", escape(row.file or ""), escape(row.key), _styled(row.status),
                              shape, _pair(row.dtype_a, row.dtype_b), delta)  # fmt: skip
        console.print(table)
        console.print("the steps are the same" if result.same else "[yellow]the steps differ")
    if not result.same:
        raise typer.Exit(EXIT_DIFFERENT)


def _styled(status: str) -> str:
    colour = {"unchanged": "green", "changed": "yellow"}.get(status, "red")
    return f"[{colour}]{status}[/]"


def _pair(a: Any, b: Any) -> str:
    """'x' when both sides agree, 'x -> y' when they do not."""
    if a is None and b is None:
        return ""
    return str(a) if a == b else f"{a} -> {b}"


def main() -> None:
    app()


if __name__ == "__main__":
    main()
