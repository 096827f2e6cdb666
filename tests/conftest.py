import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# Tiny models run fastest on one thread (no barrier waits), and a shared CI core stays free.
torch.set_num_threads(1)

from tests.tiny import save_tiny


def _scratch_home() -> None:
    """Run the suite on a scratch `$SPECDEC_HOME` so tests never write measurements or caches into the user's store.

    The pulled models, their GGUFs and the compiled kernels are shared by links (read as they are; a test that pulls a
    missing model fills the user's store, as `specdec pull` would). Tests that need an empty store set their own."""
    user = Path(os.environ.get("SPECDEC_HOME") or "~/.cache/specdec").expanduser()
    scratch = Path(tempfile.mkdtemp(prefix="specdec-test-home-"))
    for shared in ("models", "gguf", "kernels"):
        try:
            (user / shared).mkdir(parents=True, exist_ok=True)
            (scratch / shared).symlink_to(user / shared, target_is_directory=True)
        except OSError:  # an unwritable user store: the tests build what they need in the scratch one
            pass
    os.environ["SPECDEC_HOME"] = str(scratch)
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)  # unlinks the links, never what they point to


_scratch_home()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_folder(request, tmp_path_factory):
    """A tiny random-weight model saved as a Hugging Face folder (one per architecture)."""
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))
