"""Shared test setup: where kernels run, tolerances, hostile inputs.

On CPU every kernel runs in Pallas interpret mode (the same kernel code, outputs start as NaN so unwritten rows
fail); on a GPU the same tests run compiled, after the device memory the outputs will land in has been filled with
NaN. One tolerance table: :data:`pallas_attn.testing.TOLERANCES`.
"""

from __future__ import annotations

import gc
import os
import zlib

# The Mosaic GPU interpreter runs a kernel's warpgroups as threads, each executing its own XLA program whose
# callbacks wait on the kernel's barriers; some of those callbacks run on the CPU client's thread pool, as many
# workers as cores. On a 2-core machine a kernel's outer callback and one warpgroup waiting at a barrier can hold
# both workers while the warpgroup that would release it waits for one: a deadlock, now and then (with
# PJRT_NPROC=1, every time). PJRT_NPROC sizes that pool; it must be set before JAX starts its CPU client, and the
# subprocesses of the tests inherit it.
os.environ.setdefault("PJRT_NPROC", "32")
# The suite runs in several worker processes (pyproject's addopts); on a GPU they share it, so none may take most
# of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_attn.core import backend  # noqa: E402
from pallas_attn.testing import TOLERANCES  # noqa: E402, F401  (the one tolerance table)

# With asynchronous dispatch the warpgroups' programs themselves queue on that pool too: run them inline, each on
# its own thread (tests/test_no_triton.py's child process does the same).
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
