"""Check the built sdist and wheel, then install the wheel into a fresh venv and use it.

    python scripts/check_dist.py [DIST_DIR] [--constraints constraints.txt]

Run by `make dist` after `python -m build` and `twine check`. Checks:
  - the wheel's only top-level package is forge_ckpt (plus its .dist-info), and it holds
    forge_ckpt/py.typed and the LICENSE; its metadata names the license and the extras, and a
    plain install does not pull the app's, S3 or benchmark dependencies;
  - the sdist holds LICENSE, README.md, CHANGELOG.md and pyproject.toml;
  - in a new virtual environment in a temporary folder (torch pinned to the CPU build by
    constraints.txt), `pip install` of the wheel works, `pip check` is clean, and from a folder
    outside the repository `forge-ckpt --help` runs, `import forge_ckpt` finds the installed copy
    with the right `__version__`, and `apps` is not importable.
Prints one line per check and a summary; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "forge_ckpt"
# Dependencies that only an extra may pull: a plain install must not.
EXTRA_ONLY = {"boto3", "matplotlib", "obstore", "pytest", "mypy"}


class Checks:
    def __init__(self) -> None:
        self.results: list[tuple[bool, str, str]] = []

    def check(self, ok: bool, name: str, detail: str = "") -> bool:
        self.results.append((ok, name, detail))
        print(
            f"  [{'ok' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True
        )
        return ok

    @property
    def failed(self) -> list[tuple[bool, str, str]]:
        return [r for r in self.results if not r[0]]


def _one(dist: Path, pattern: str, checks: Checks, what: str) -> Path | None:
    found = sorted(dist.glob(pattern))
    if checks.check(
        len(found) == 1, f"exactly one {what} in {dist}", ", ".join(p.name for p in found) or "none"
    ):
        return found[0]
    return None


def check_wheel(wheel: Path, checks: Checks) -> str:
    """Returns the wheel's version."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = sorted(
            {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        )
        top = sorted({n.split("/")[0] for n in names} - set(dist_info))
        checks.check(
            top == [PACKAGE], "wheel's only top-level package is forge_ckpt", f"top level: {top}"
        )
        checks.check(
            len(dist_info) == 1 and dist_info[0].startswith(f"{PACKAGE}-"),
            "one forge_ckpt-*.dist-info",
            ", ".join(dist_info),
        )
        checks.check(f"{PACKAGE}/py.typed" in names, "wheel holds forge_ckpt/py.typed")
        checks.check(f"{PACKAGE}/__init__.py" in names, "wheel holds forge_ckpt/__init__.py")
        if not dist_info:
            return ""
        di = dist_info[0]
        lic = [n for n in names if n.startswith(f"{di}/") and n.rsplit("/", 1)[-1] == "LICENSE"]
        checks.check(bool(lic), "wheel holds LICENSE", ", ".join(lic))
        meta = email.parser.Parser().parsestr(zf.read(f"{di}/METADATA").decode())
    version = meta["Version"] or ""
    checks.check(
        meta.get("License-Expression") == "BSD-3-Clause",
        "metadata License-Expression is BSD-3-Clause",
        str(meta.get("License-Expression")),
    )
    extras = set(meta.get_all("Provides-Extra") or [])
    checks.check(
        {"s3", "app", "bench", "test"} <= extras, "extras s3, app, bench, test", str(sorted(extras))
    )
    core = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    core_names = {re.split(r"[\s;\[<>=!~(]", r.strip(), maxsplit=1)[0].lower() for r in core}
    leaked = sorted(core_names & EXTRA_ONLY)
    checks.check(
        not leaked, "plain install pulls no extra-only dependency", f"core: {sorted(core_names)}"
    )
    return version


def check_sdist(sdist: Path, checks: Checks) -> None:
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
    root = names[0].split("/")[0]
    for f in ("LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", f"{PACKAGE}/py.typed"):
        checks.check(f"{root}/{f}" in names, f"sdist holds {f}")


def _run(
    cmd: list[str], cwd: Path, env: dict[str, str], checks: Checks, name: str
) -> subprocess.CompletedProcess[str] | None:
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.monotonic() - t0
    ok = p.returncode == 0
    checks.check(ok, name, f"{dt:.1f} s" + ("" if ok else f", exit {p.returncode}"))
    if not ok:
        print("    " + (p.stdout + p.stderr).strip()[-3000:].replace("\n", "\n    "), flush=True)
        return None
    return p


def check_install(wheel: Path, version: str, constraints: Path, checks: Checks) -> None:
    with tempfile.TemporaryDirectory(prefix="forge_ckpt_dist_") as tmp:
        tmp_path = Path(tmp)
        venv, work = tmp_path / "venv", tmp_path / "work"
        work.mkdir()
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
        }
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        py = venv / "bin" / "python"
        if not _run(
            [sys.executable, "-m", "venv", str(venv)], work, env, checks, "create a fresh venv"
        ):
            return
        pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
        install = [*pip, "install", "--quiet", "-c", str(constraints), "torch==2.13.0", str(wheel)]
        if not _run(
            install,
            work,
            env,
            checks,
            f"pip install -c {constraints.name} torch==2.13.0 {wheel.name}",
        ):
            return
        _run([*pip, "check"], work, env, checks, "pip check")
        p = _run(
            [str(venv / "bin" / "forge-ckpt"), "--help"],
            work,
            env,
            checks,
            "forge-ckpt --help (outside the repo)",
        )
        if p:
            checks.check(
                all(c in p.stdout for c in ("list", "inspect", "verify", "gc")),
                "help lists list/inspect/verify/gc",
            )
        code = "import forge_ckpt; print(forge_ckpt.__version__); print(forge_ckpt.__file__)"
        p = _run([str(py), "-c", code], work, env, checks, "import forge_ckpt (outside the repo)")
        if p:
            got_version, got_file = (p.stdout.strip().splitlines() + ["", ""])[:2]
            checks.check(
                got_version == version,
                "forge_ckpt.__version__ matches the wheel",
                f"{got_version} (wheel {version})",
            )
            checks.check(
                Path(got_file).resolve().is_relative_to(venv.resolve()),
                "imported from the venv, not the checkout",
                got_file,
            )
        code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('apps') is not None)"
        _run([str(py), "-c", code], work, env, checks, "apps is not installed")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("dist", nargs="?", default=str(ROOT / "dist"))
    ap.add_argument("--constraints", default=str(ROOT / "constraints.txt"))
    ap.add_argument("--no-install", action="store_true", help="check the archives only")
    args = ap.parse_args()
    dist, constraints = Path(args.dist).resolve(), Path(args.constraints).resolve()
    checks, t0 = Checks(), time.monotonic()

    print(f"check_dist: {dist}", flush=True)
    wheel = _one(dist, f"{PACKAGE}-*.whl", checks, "wheel")
    sdist = _one(dist, f"{PACKAGE}-*.tar.gz", checks, "sdist")
    version = check_wheel(wheel, checks) if wheel else ""
    if sdist:
        check_sdist(sdist, checks)
    if wheel and not args.no_install:
        check_install(wheel, version, constraints, checks)

    failed = checks.failed
    print(
        f"check_dist: {len(checks.results) - len(failed)}/{len(checks.results)} checks passed "
        f"in {time.monotonic() - t0:.0f} s"
        + (f"; FAILED: {', '.join(n for _, n, _ in failed)}" if failed else ""),
        flush=True,
    )
    if not failed:
        print(f"check_dist: OK: {wheel.name if wheel else ''}, {sdist.name if sdist else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
