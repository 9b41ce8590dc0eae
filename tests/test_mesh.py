"""Runs tests/mesh/ (sharded decoding and training, the 2-process jax.distributed step, the
memory plan, SmolLM2 on a mesh) in a pytest process of its own with 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``): JAX fixes its device count when its
backend starts, and simulating 8 devices in this process would slow every other test.

To run them directly: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/mesh``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import pytest
from conftest import EIGHT_DEVICES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_mesh_tests_in_an_8_device_process():
    if jax.device_count() >= 8:
        pytest.skip("this process has 8 devices already: tests/mesh/ is collected here directly")
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + EIGHT_DEVICES).strip())
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/mesh"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0, f"tests/mesh failed in its 8-device process:\n{r.stdout[-8000:]}\n{r.stderr[-2000:]}"
    m = re.search(r"(\d+) passed", summary)
    assert m and int(m.group(1)) >= 25, f"tests/mesh ran too few tests: {summary}"
