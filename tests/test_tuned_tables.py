"""`pallas-attn bench --sweep --write-tables` writes its winners into pallas_attn/tuned.py, the tables config.py
reads: a round trip through a copy of that module, and the configs it builds."""

from __future__ import annotations

import dataclasses
import runpy
import shutil

import pallas_attn.core.tuned
from benchmarks import sweep
from pallas_attn.core.config import DecodeConfig, PrefillConfig


def _proposal(kernel, table, key, cfg):
    return {"kernel": kernel, "table": table, "key": list(key), "config": dataclasses.asdict(cfg)}


def test_write_tables_round_trip(tmp_path):
    path = tmp_path / "tuned.py"
    shutil.copy(pallas_attn.core.tuned.__file__, path)
    prefill = PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=4)
    decode = DecodeConfig(block_n=128, num_warps=4, num_stages=2)
    written = sweep.write_tables([_proposal("prefill", "PREFILL_TABLE", ("NVIDIA H200", 128), prefill),
                                  _proposal("decode", "DECODE_TABLE", ("NVIDIA H200", 128), decode),
                                  _proposal("ragged", "DECODE_TABLE", ("NVIDIA H200", 128), DecodeConfig(block_n=16))],
                                 path)
    assert len(written) == 2  # the ragged winner shares DECODE_TABLE and is not written
    # a second sweep on another device keeps the first one's entries
    sweep.write_tables([_proposal("prefill", "PREFILL_TABLE", ("NVIDIA B200", 64), PrefillConfig())], path)
    tables = runpy.run_path(str(path))
    assert PrefillConfig(**tables["PREFILL"][("NVIDIA H200", 128)]) == prefill
    assert PrefillConfig(**tables["PREFILL"][("NVIDIA B200", 64)]) == PrefillConfig()
    assert DecodeConfig(**tables["DECODE"][("NVIDIA H200", 128)]) == decode
    assert tables["CHUNK"] == {} and tables["SPARSE"] == {}
    assert tables["__doc__"] == pallas_attn.core.tuned.__doc__  # the module docstring survives the rewrite
