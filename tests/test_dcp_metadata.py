"""`load_metadata` reads every `.metadata` DCP really writes, and refuses anything else.

Real files come from `dcp.save` in the situations forge_ckpt meets (plain model + AdamW, every
dtype, non-tensor values, TorchTitan's flattened state, a 2-rank FSDP2 save on gloo); the
result must equal what DCP's own `pickle.loads` gives. Hostile files must fail with
`CheckpointCorruptError` naming the file and the refused global, before any payload runs.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md

from forge_ckpt.dcp.metadata import allowed_globals, load_metadata
from forge_ckpt.errors import CheckpointCorruptError

SCENARIOS = ["adamw", "dtypes", "non_tensor", "torchtitan", "fsdp2_2rank"]
MD = "torch.distributed.checkpoint.metadata"
POSIX_PATH = f"{pathlib.PosixPath.__module__}.PosixPath"  # pathlib._local on Python 3.13+

# What the real saves refer to (dtypes aside): the empirical allowlist, pinned.
EXPECTED_NON_DTYPE_GLOBALS = {
    POSIX_PATH,
    "torch.Size",
    "torch.serialization._get_layout",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    *(
        f"{MD}.{n}"
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


# ---------------------------------------------------------------- real saves


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _step(model: nn.Module, *optimizers: Any) -> None:
    model(torch.randn(4, 8)).sum().backward()
    for opt in optimizers:
        opt.step()


def _adamw_state() -> dict[str, Any]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _savable_dtypes() -> list[torch.dtype]:
    """Every dtype DCP can save here: not bit-packed, sub-byte integer or quantized ones."""
    sub_byte = {f"{p}int{n}" for p in ("", "u") for n in range(1, 8)}
    found = set()
    for value in vars(torch).values():
        name = str(value).removeprefix("torch.")
        if isinstance(value, torch.dtype) and not name.startswith(("bit", "qint", "quint")):
            if name not in sub_byte:
                found.add(value)
    return sorted(found, key=str)


def _dtype_state() -> dict[str, Any]:
    state = {str(d): torch.zeros(3, dtype=d) for d in _savable_dtypes()}
    state["channels_last"] = torch.zeros(1, 2, 3, 4).to(memory_format=torch.channels_last)
    state["scalar"] = torch.tensor(1.5)
    state["empty"] = torch.zeros(0, 5)
    return state


def _non_tensor_state() -> dict[str, Any]:
    return {
        "int": 3,
        "str": "x",
        "float": 1.5,
        "none": None,
        "bytes": b"raw",
        "list": [1, 2, "a"],
        "tuple": (1, 2),
        "set": {1, 2},
        "nested": {"a": 1, "b": [torch.ones(2)], "c": {"d": "e"}},
    }


def _torchtitan_state() -> dict[str, Any]:
    """Model FQNs at the top level plus `optimizer`/`lr_scheduler`, as CheckpointManager saves."""
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    model = _model()
    config = default_adamw(lr=1e-2)
    config.implementation = "for-loop"
    optimizers = config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=5).build(
        optimizers=optimizers, training_steps=40
    )
    _step(model, optimizers, schedulers)
    state: dict[str, Any] = dict(ModelWrapper([model]).state_dict())
    state.update(optimizer=optimizers, lr_scheduler=schedulers, train_state={"step": 1})
    return state


FSDP_WORKER = """
import os, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp, torch.nn as nn

def worker(rank, world, folder):
    dist.init_process_group("gloo", init_method="file://" + folder + ".store",
                            rank=rank, world_size=world)
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "extra": {"rank": rank}}, checkpoint_id=folder)
    dist.barrier()
    dist.destroy_process_group()
    # Skip C++ static destructors: about 1 exit in 12 aborts with "terminate called without an
    # active exception" on this torch/gloo, after a complete save (the CI failure of stop 20).
    os._exit(0)

if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1]), nprocs=2, join=True)
"""


def _save_fsdp2(folder: Path) -> None:
    script = folder.parent / "fsdp2_worker.py"
    script.write_text(textwrap.dedent(FSDP_WORKER))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(folder)], capture_output=True, text=True, env=env,
        timeout=600,  # two processes importing torch on a busy 2-core machine
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


BUILDERS = {
    "adamw": _adamw_state,
    "dtypes": _dtype_state,
    "non_tensor": _non_tensor_state,
    "torchtitan": _torchtitan_state,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folder of each real save, made once per module."""
    root = tmp_path_factory.mktemp("dcp")
    folders = {}
    for name, build in BUILDERS.items():
        folders[name] = root / name
        dcp.save(build(), checkpoint_id=folders[name], no_dist=True)
    folders["fsdp2_2rank"] = root / "fsdp2" / "ckpt"
    folders["fsdp2_2rank"].parent.mkdir()
    _save_fsdp2(folders["fsdp2_2rank"])
    return folders


def _trusted_globals(data: bytes) -> set[str]:
    """Globals a trusted file refers to (test-only: it unpickles with the full unpickler)."""
    seen: set[str] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add(f"{module}.{name}")
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return seen


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_real_metadata_equals_dcp_unpickle(saved: dict[str, Path], scenario: str) -> None:
    path = saved[scenario] / ".metadata"
    data = path.read_bytes()
    ours, trusted = load_metadata(data, str(path)), pickle.loads(data)
    assert type(ours) is dcp_md.Metadata
    assert ours.state_dict_metadata == trusted.state_dict_metadata
    assert ours.storage_data == trusted.storage_data
    assert ours.planner_data == trusted.planner_data
    assert ours.storage_meta == trusted.storage_meta and ours.version == trusted.version
    assert repr(ours) == repr(trusted)
    assert load_metadata(memoryview(data), "m") == load_metadata(bytearray(data), "b") == ours


def test_real_saves_need_exactly_the_allowlist(saved: dict[str, Path]) -> None:
    per_scenario = {s: _trusted_globals((saved[s] / ".metadata").read_bytes()) for s in SCENARIOS}
    union = set().union(*per_scenario.values())
    assert union <= set(allowed_globals())
    assert {g for g in union if not _is_dtype_global(g)} == EXPECTED_NON_DTYPE_GLOBALS
    assert {f"torch.{str(d)[6:]}" for d in _savable_dtypes()} <= per_scenario["dtypes"]
    # 2-rank FSDP2 (DTensor shards) refers to nothing beyond a 1-process save.
    assert per_scenario["fsdp2_2rank"] <= per_scenario["adamw"] | per_scenario["non_tensor"]
    fsdp = load_metadata((saved["fsdp2_2rank"] / ".metadata").read_bytes(), "fsdp")
    assert len(fsdp.state_dict_metadata["model.0.weight"].chunks) == 2


def _is_dtype_global(name: str) -> bool:
    module, _, attr = name.rpartition(".")
    return module == "torch" and isinstance(getattr(torch, attr, None), torch.dtype)


class _SafeReader(FileSystemReader):
    """How forge_ckpt plugs `load_metadata` into DCP: same as `read_metadata`, minus pickle."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        path = Path(self.path) / ".metadata"
        metadata = load_metadata(path.read_bytes(), str(path))
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def test_dcp_loads_through_the_safe_metadata(saved: dict[str, Path]) -> None:
    expected = _adamw_state()
    target = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    dcp.load(target, storage_reader=_SafeReader(saved["adamw"]), no_dist=True)
    for key, value in expected["model"].items():
        assert torch.equal(target["model"][key], value), key


# ---------------------------------------------------------------- hostile files


class _Payload:
    """Pickles as a call of `func(*args)`: what an attacker writes into `.metadata`."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def _refused(data: bytes, tmp_path: Path, global_name: str) -> CheckpointCorruptError:
    path = str(tmp_path / "step-3" / "__trainer__" / ".metadata")
    with pytest.raises(CheckpointCorruptError) as info:
        load_metadata(data, path)
    assert info.value.path == path and path in str(info.value)
    assert f"refers to {global_name}, which is not part of DCP's metadata format" in str(info.value)
    return info.value


def _py2_name(name: str, protocol: int) -> str:
    """What protocols 0-2 write for a global (pickle's `fix_imports` uses Python 2 names)."""
    py2 = {"builtins.exec": "__builtin__.exec", "builtins.eval": "__builtin__.eval"}
    py2["subprocess.Popen"] = "commands.Popen"
    return py2.get(name, name) if protocol < 3 else name


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_code_running_payloads_never_run(tmp_path: Path, protocol: int) -> None:
    canary = tmp_path / "CANARY"
    system = f"{os.system.__module__}.system"
    cases = [
        (_Payload(os.system, f"touch {canary}"), system),
        (_Payload(exec, f"open({str(canary)!r}, 'w').close()"), "builtins.exec"),
        (_Payload(eval, f"open({str(canary)!r}, 'w')"), "builtins.eval"),
        (_Payload(subprocess.Popen, ["touch", str(canary)]), "subprocess.Popen"),
    ]
    for payload, name in cases:
        _refused(pickle.dumps(payload, protocol=protocol), tmp_path, _py2_name(name, protocol))
    assert not canary.exists()


@pytest.fixture()
def real_metadata(tmp_path: Path) -> dcp_md.Metadata:
    dcp.save(_adamw_state(), checkpoint_id=tmp_path / "ok", no_dist=True)
    return pickle.loads((tmp_path / "ok" / ".metadata").read_bytes())


@pytest.mark.parametrize("where", ["storage_data", "planner_data", "state_dict", "storage_meta"])
def test_payload_nested_in_valid_metadata_never_runs(
    tmp_path: Path, real_metadata: dcp_md.Metadata, where: str
) -> None:
    canary = tmp_path / "CANARY"
    payload = _Payload(os.system, f"touch {canary}")
    md = real_metadata
    if where == "storage_data":
        md.storage_data[next(iter(md.storage_data))] = payload
    elif where == "planner_data":
        md.planner_data["extra"] = ("a", [payload])
    elif where == "state_dict":
        next(iter(md.state_dict_metadata.values())).chunks.append(payload)
    else:
        md.storage_meta.modules = [payload]  # type: ignore[union-attr]
    for protocol in (2, 4, 5):
        _refused(pickle.dumps(md, protocol=protocol), tmp_path, f"{os.system.__module__}.system")
    assert not canary.exists()


def test_tensor_pickled_into_metadata_is_refused(
    tmp_path: Path, real_metadata: dcp_md.Metadata
) -> None:
    real_metadata.planner_data["t"] = torch.ones(2)
    _refused(pickle.dumps(real_metadata), tmp_path, "torch._utils._rebuild_tensor_v2")


def test_old_protocol_copy_of_real_metadata_is_refused(
    tmp_path: Path, real_metadata: dcp_md.Metadata
) -> None:
    """Protocols 0/1 rebuild objects through copyreg._reconstructor, which DCP never writes."""
    for protocol in (0, 1):
        _refused(
            pickle.dumps(real_metadata, protocol=protocol), tmp_path, "copy_reg._reconstructor"
        )


FORBIDDEN = [
    "os.system",
    "posix.system",
    "builtins.eval",
    "builtins.exec",
    "builtins.getattr",
    "builtins.__import__",
    "builtins.open",
    "__builtin__.eval",
    "__builtin__.getattr",
    "copyreg._reconstructor",
    "copy_reg._reconstructor",
    "copyreg.__newobj__",
    "subprocess.Popen",
    "functools.partial",
    "pickle.loads",
    "torch.load",
    "torch.tensor",
    "torch.Tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch.storage._load_from_bytes",
    "torch.serialization.load",
    "torch.serialization._get_restore_location",
    "collections.OrderedDict",
    "builtins.set",
    "pathlib.Path",
    "torch.Size.__new__",
    f"{MD}.os",  # a module attribute of an allowed module is still refused
    f"{MD}.torch",
    f"{MD}.field",
    f"{MD}.Metadata.__init__",
    "torch.distributed.checkpoint.filesystem.pickle",
    "torch.distributed.checkpoint.filesystem.FileSystemReader",
    "torch.distributed.checkpoint.filesystem._StoragePrefix",
]


@pytest.mark.parametrize("global_name", FORBIDDEN)
def test_forbidden_globals_are_refused(tmp_path: Path, global_name: str) -> None:
    """Refused however the name is split into module and qualname, in text and binary form."""
    for module, name in _splits(global_name):
        text = f"c{module}\n{name}\n(S'touch {tmp_path}/CANARY'\ntR.".encode()  # protocol 0
        _refused(text, tmp_path, f"{module}.{name}")
        binary = b"\x80\x04" + _stack_global(module, name) + b")R."
        _refused(binary, tmp_path, f"{module}.{name}")
    assert not (tmp_path / "CANARY").exists()


def _splits(global_name: str) -> list[tuple[str, str]]:
    """Ways to spell a dotted global as (module, qualname), e.g. `torch` + `Size.__new__`."""
    parts = global_name.split(".")
    return [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(1, len(parts))]


def _stack_global(module: str, name: str) -> bytes:
    out = b""
    for text in (module, name):
        raw = text.encode()
        out += b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE
    return out + b"\x93"  # STACK_GLOBAL


def test_allowed_callables_cannot_be_misused() -> None:
    """Each callable the allowlist admits checks its arguments; misuse is a corrupt file."""
    path_module = POSIX_PATH.rpartition(".")[0]
    bad = [
        (b"ctorch\nSize\n(S'os'\ntR.", "tuple of ints"),
        (b"ctorch\nSize\n((F1.5\nttR.", "tuple of ints"),
        (b"ctorch.serialization\n_get_layout\n(S'__class__'\ntR.", "unknown torch layout"),
        (b"ctorch.serialization\n_get_layout\n((ltR.", "unknown torch layout"),
        (f"c{MD}\n_MEM_FORMAT_ENCODING\n(S'X'\n(lp0\ntR.".encode(), "positional argument"),
        (f"c{MD}\n_MEM_FORMAT_ENCODING\n(I7\ntR.".encode(), "not a valid"),
        (f"c{path_module}\nPosixPath\n(I1\ntR.".encode(), "must be strings"),
        (b"ctorch\nfloat32\n(S'x'\ntR.", "not callable"),
        (b"\x80\x02ctorch\nSize\n)\x81.", "must be a type"),  # NEWOBJ: wrappers aren't classes
        # Plant `__setstate__` in an instance dict, then BUILD again: that can only call an
        # allowed (checked) callable, never anything new.
        (
            f"\x80\x02c{MD}\nStorageMeta\n)\x81}}X\x0c\x00\x00\x00__setstate__ctorch\nSize\n"
            "sbX\x02\x00\x00\x00osb.".encode("latin-1"),
            "tuple of ints, not str",
        ),
    ]
    for data, problem in bad:
        with pytest.raises(CheckpointCorruptError, match=problem) as info:
            load_metadata(data, "bad/.metadata")
        assert info.value.path == "bad/.metadata", data


def test_persistent_ids_are_refused() -> None:
    class WithPid(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return "storage-0" if isinstance(obj, list) else None

    buf = io.BytesIO()
    WithPid(buf, protocol=4).dump(dcp_md.Metadata(state_dict_metadata={}, planner_data=[1]))
    with pytest.raises(CheckpointCorruptError, match="persistent id"):
        load_metadata(buf.getvalue(), "p/.metadata")
    with pytest.raises(CheckpointCorruptError, match="persistent id"):
        load_metadata(b"Pstorage\n.", "p/.metadata")


@pytest.mark.parametrize(
    "value",
    [{"a": 1}, None, [], "Metadata", dcp_md.StorageMeta(), dcp_md.BytesStorageMetadata()],
    ids=repr,
)
def test_result_must_be_metadata(value: Any) -> None:
    with pytest.raises(CheckpointCorruptError, match="not a Metadata"):
        load_metadata(pickle.dumps(value), "r/.metadata")


# ---------------------------------------------------------------- damaged files


def _only_corrupt_or_metadata(data: bytes) -> None:
    try:
        result = load_metadata(data, "d/.metadata")
    except CheckpointCorruptError as exc:
        assert exc.path == "d/.metadata"
    else:
        assert isinstance(result, dcp_md.Metadata)


def test_truncated_metadata_is_corrupt(saved: dict[str, Path]) -> None:
    data = (saved["adamw"] / ".metadata").read_bytes()
    cuts = [*range(0, len(data), 37), *range(len(data) - 40, len(data))]
    for cut in cuts:
        with pytest.raises(CheckpointCorruptError):
            load_metadata(data[:cut], "t/.metadata")
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        load_metadata(data[: len(data) // 2], "t/.metadata")
    with pytest.raises(CheckpointCorruptError, match="trailing bytes"):
        load_metadata(data + data, "t/.metadata")


def test_garbage_is_corrupt(tmp_path: Path) -> None:
    rng = random.Random(17)
    torch.save({"w": torch.ones(2)}, tmp_path / "zip")
    samples = [
        b"",
        b"\x00",
        b"garbage",
        b"\x80\x05",
        b"\x80\x04\x95",
        b"{}",
        b"(((((((((((((((",
        b"]" * 100_000,  # deep nesting without a STOP
        (tmp_path / "zip").read_bytes(),  # a torch.save zip file
        *(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) for _ in range(300)),
    ]
    for data in samples:
        with pytest.raises(CheckpointCorruptError):
            load_metadata(data, "g/.metadata")


@contextlib.contextmanager
def _address_space_cap(extra: int = 3 << 30) -> Iterator[None]:
    """Cap this process's address space for a moment, so a hostile memo index fails with
    MemoryError instead of really allocating gigabytes on the test machine."""
    resource = pytest.importorskip("resource")
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs /proc to size the cap")
    size_kb = int(
        next(x for x in status.read_text().splitlines() if x.startswith("VmSize:")).split()[1]
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size_kb * 1024 + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_huge_memo_index_is_corrupt_not_a_crash() -> None:
    """LONG_BINPUT with index 2**31 makes the C unpickler allocate ~16 GiB: a denial of service
    (not code execution) that forge_ckpt's checksums must stop; here it surfaces as corrupt."""
    with _address_space_cap(), pytest.raises(CheckpointCorruptError, match="MemoryError"):
        load_metadata(b"\x80\x04Nr\x00\x00\x00\x80.", "m/.metadata")


def test_mutated_real_metadata_never_leaks_another_error(saved: dict[str, Path]) -> None:
    data = (saved["torchtitan"] / ".metadata").read_bytes()
    rng = random.Random(1234)
    with _address_space_cap():  # a mutation can create a huge memo index (see above)
        for _ in range(400):
            mutated = bytearray(data)
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            _only_corrupt_or_metadata(bytes(mutated))
