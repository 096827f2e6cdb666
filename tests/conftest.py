import pytest
import torch

# Tiny models run fastest on one thread (no barrier waits), and a shared CI core stays free.
torch.set_num_threads(1)

from tests.tiny import save_tiny


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_folder(request, tmp_path_factory):
    """A tiny random-weight model saved as a Hugging Face folder (one per architecture)."""
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))
