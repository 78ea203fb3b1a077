"""Shared fixtures: the embedded default model's folder, tiny random-weight models of each
supported architecture, and transformers reference models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/oracle.py, tests/tiny_models.py

from tiny_models import tiny_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pdserve.common.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session", params=["llama", "qwen2", "mistral"])
def tiny_model_dir(request, tmp_path_factory, default_model_dir) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tiny"), default_model_dir, request.param)


def pytest_report_header(config) -> str:
    """The CPU and the GEMM path each dtype takes, so a failure can be placed."""
    from pdserve.kernels import invariant_gemm

    return f"pdserve host: {invariant_gemm.describe()}"
