"""Shared fixtures. Tests run on CPU with tiny models; nothing is downloaded."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models: one intra-op thread per process is several times faster than two contending ones on
# a 2-core machine (and subprocesses started by tests inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory):
    """The tiny teacher (real HF Qwen3 directory), built once per test session."""
    from extract.tiny import build_tiny_teacher

    return build_tiny_teacher(tmp_path_factory.mktemp("tiny-teacher"))
