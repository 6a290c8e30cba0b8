"""The split attention kernels' logic on the CPU (flashdraft/model/split_attention.py), run by Triton's
interpreter (TRITON_INTERPRET=1, in a child process: the variable takes effect when the kernels are
defined): fp32 attention against a dense per-head reference, for one query and a block, ragged rows,
head dims that are not powers of two or are below 16, masks with holes, and a width past the combine's
chunk count (chunks doubled); and the order rule, bit for bit: a wider cache of masked columns, and a
token decoded alone rather than first in a block, give the same output. The GPU numbers (bf16, compiled,
replayed from a CUDA graph) are tests/model/test_split_attention_gpu.py's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")  # the test extra installs it; the kernels run where it is
ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import torch
    from flashdraft.model.split_attention import split_attention
    from tests.model.attention_reference import dense_attention as reference

    def inputs(rows, heads, kv, dim, queries, width, seed=0, holes=True):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(rows, heads, queries, dim, generator=g)
        k = torch.randn(rows, kv, width, dim, generator=g)
        v = torch.randn(rows, kv, width, dim, generator=g)
        starts = torch.randint(0, width - queries, (rows, 1), generator=g)
        positions = starts + torch.arange(queries)
        allowed = (torch.arange(width) <= positions[..., None])[:, None]
        if holes:
            gaps = torch.rand(allowed.shape, generator=g) < 0.2
            gaps[..., 0] = False
            allowed[0] &= ~gaps[0]
        return q, k, v, allowed

    def additive(allowed):
        return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))

    for shape in [(1, 9, 3, 64, 1, 100), (2, 9, 3, 64, 8, 300), (3, 8, 8, 32, 4, 130),
                  (2, 4, 2, 80, 3, 70), (2, 8, 2, 8, 3, 40), (1, 2, 1, 256, 2, 2100)]:
        q, k, v, allowed = inputs(*shape)
        scale = shape[3] ** -0.5
        out = split_attention(q, k, v, additive(allowed), scale)
        error = float((out.double() - reference(q, k, v, allowed, scale)).abs().max())
        assert out.shape == (shape[0], shape[4], shape[1], shape[3]) and error < 1e-5, (shape, error)

    # a wider cache whose extra columns are masked: the same bits
    q, k, v, allowed = inputs(16, 9, 3, 64, 8, 200, holes=False)  # 16 rows: many thread blocks already
    narrow = split_attention(q, k, v, additive(allowed), 0.125)
    wide_k, wide_v = torch.randn(16, 3, 448, 64), torch.randn(16, 3, 448, 64)
    wide_k[:, :, :200], wide_v[:, :, :200] = k, v
    wide_allowed = torch.zeros(16, 1, 8, 448, dtype=torch.bool)
    wide_allowed[..., :200] = allowed
    wide = split_attention(q, wide_k, wide_v, additive(wide_allowed), 0.125)
    assert torch.equal(wide, narrow), float((wide - narrow).abs().max())

    # one token decoded alone: the bits it gets as the first token of a block. The first, not a later one:
    # the interpreter's tl.dot is numpy's BLAS, whose bits for a row can depend on the row's place in the
    # tile (OpenBLAS 0.3.31's Haswell kernel on an AVX2 CPU: 34 of 64 places differ from place 0), so the
    # token keeps its rows here; the GPU test moves it (tests/model/test_split_attention_gpu.py).
    alone = split_attention(q[:, :, :1], k, v, additive(allowed[:, :, :1]), 0.125)
    assert torch.equal(alone[:, 0], narrow[:, 0]), float((alone[:, 0] - narrow[:, 0]).abs().max())
    print("interpreted: ok")
    """
)


def test_split_attention_kernels_interpreted_on_the_cpu():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "interpreted: ok" in run.stdout, run.stderr[-3000:]
