import os
import subprocess

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def unprivileged() -> list[str]:
    """A command prefix under which file permissions bind. Root ignores them, so for root
    it is a user namespace (``unshare --user``) where the process keeps its files but
    loses root's override; an ordinary user needs none."""
    if os.geteuid() != 0:
        return []
    prefix = ["unshare", "--user"]
    try:
        works = subprocess.run(prefix + ["true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        works = False
    if not works:
        pytest.skip("root ignores file permissions, and `unshare --user` cannot drop that here")
    return prefix
