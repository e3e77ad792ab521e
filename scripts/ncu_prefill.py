"""Run the Mosaic prefill on one causal request twice, for a profiler or a SASS dump (GPU only):

    ncu --section WarpStateStats --section SourceCounters --kernel-name regex:mosaic --launch-skip 1 \
        --launch-count 1 -o prefill python3 scripts/ncu_prefill.py 8192 wgs=2
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=dump python3 scripts/ncu_prefill.py 4096   # then tools/ptx_schedule.py

The second argument: the kernel's tuning knobs, as in ``probe_prefill_mosaic.py``'s VARIANTS.
"""
import functools
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from pallas_attn import prefill_mosaic  # noqa: E402
from probe_prefill_mosaic import inputs, knobs  # noqa: E402

n = int(sys.argv[1])
kw = knobs(sys.argv[2]) if len(sys.argv) > 2 else {}
q, k, v, cu, _ = inputs([n], 128, causal=True)
fn = jax.jit(functools.partial(prefill_mosaic.varlen_attention_mosaic, max_seqlen=n, causal=True, scale=128 ** -0.5,
                               return_lse=False, interpret=False, **kw))
for _ in range(2):
    jax.block_until_ready(fn(q, k, v, cu))
