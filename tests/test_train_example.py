"""examples/train_packed_lm.py: a small model trained on packed documents with varlen_attention's forward and
backward kernels follows the same model trained with dense masked attention, step by step."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_packed_lm.py"


def test_loss_curve_matches_dense_attention():
    spec = importlib.util.spec_from_file_location("train_packed_lm", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclass looks its module up
    spec.loader.exec_module(example)
    result = example.train(steps=4, log=lambda line: None)
    for curve in result["loss"].values():
        assert len(curve) == 4 and all(math.isfinite(x) for x in curve)
    assert result["max_relative_difference"] < 1e-5, result["relative_difference"]
