"""Shared test setup: where kernels run, tolerances, hostile inputs.

On CPU every kernel runs in Pallas interpret mode (the same kernel code, outputs start as NaN so unwritten rows
fail); on a GPU the same tests run compiled, after the device memory the outputs will land in has been filled with
NaN. One tolerance table: :data:`pallas_attn.testing.TOLERANCES`.
"""

from __future__ import annotations

import gc
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn.core import backend
from pallas_attn.testing import TOLERANCES  # noqa: F401  (the one tolerance table)

# The Mosaic GPU interpreter runs a kernel's warpgroups as threads, each executing its own XLA program whose
# callbacks wait on the kernel's barriers. With asynchronous dispatch those programs queue on the CPU client's
# worker pool, as many workers as cores: on a 2-core machine two warpgroups can hold both workers waiting for two
# that never start, a deadlock. Run them inline, each on its own thread; set before JAX starts its CPU client
# (tests/test_no_triton.py's child process does the same).
jax.config.update("jax_cpu_enable_async_dispatch", False)
ON_GPU = backend.on_gpu()


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs compiled)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop JAX's compiled programs after each test module. Every compiled CPU program keeps a few memory maps;
    the whole suite in one process compiles thousands, and past the kernel's vm.max_map_count (65,530) XLA
    segfaults inside a compile."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's id: fresh data per test, reproducible per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def poison_device_memory(nbytes: int = 1 << 28) -> None:
    """Fill soon-to-be-reused device memory with NaN (GPU only): the allocator hands these bytes to the next
    outputs, so a row the kernel forgets to write reads as NaN instead of stale data."""
    if ON_GPU:
        junk = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
        junk.block_until_ready()
        del junk


@pytest.fixture(autouse=True)
def _poison_before_each_test():
    poison_device_memory()
    yield
