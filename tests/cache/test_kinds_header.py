"""caramba/cache/kinds.h, the kind table as C reads it, against caramba.cache.kinds' table."""

from __future__ import annotations

import re

import pytest
import torch

from caramba.cache import kinds_c
from caramba.cache.kinds import KindSpec, KVCacheKind
from caramba.model import fast_decode


def test_the_checked_in_header_is_the_tables():
    assert kinds_c.PATH.read_text() == kinds_c.header(), \
        "caramba/cache/kinds.h is stale: run `python -m caramba.cache.kinds_c` after changing the kind table"


def _c_array(name: str) -> list[str]:
    text = kinds_c.PATH.read_text()
    body = re.search(rf"{name}\[[^\]]*\] = \{{([^}}]*)\}}", text).group(1)
    return [v.strip().rstrip("f") for v in body.split(",") if v.strip()]


def test_the_header_says_what_each_row_says():
    """Each step kind's bits, flags and code range; the codebook exactly as float32."""
    enum = dict(re.findall(r"KV_(\w+) = (\d+)", kinds_c.PATH.read_text()))
    for kind in KVCacheKind:
        spec = kind.spec
        if spec.step is None:
            assert kind.name not in enum
            continue
        i = int(enum[kind.name])
        assert i == spec.step
        assert int(_c_array("KV_BITS")[i]) == spec.bits
        assert int(_c_array("KV_ZERO_POINT")[i]) == spec.zero_point
        assert int(_c_array("KV_PER_CHANNEL")[i]) == spec.per_channel
        assert float(_c_array("KV_OFFSET")[i]) == spec.offset
        if spec.code_range:
            assert (int(_c_array("KV_LO")[i]), int(_c_array("KV_HI")[i])) == spec.code_range
    levels = torch.tensor([float(v) for v in _c_array("NF4_LEVELS")], dtype=torch.float32)
    assert torch.equal(levels, KVCacheKind.NF4.spec.levels)
    mids = torch.tensor([float(v) for v in _c_array("NF4_MIDPOINTS")], dtype=torch.float32)
    assert torch.equal(mids, KVCacheKind.NF4.spec.midpoints)


def test_python_reads_the_same_ids():
    """fast_decode's kind maps come from the table (no id of its own)."""
    assert fast_decode.KV_FP32 == KVCacheKind.FP32.spec.step
    assert fast_decode.FLOAT_KINDS == {torch.float32: KVCacheKind.FP32.spec.step, torch.float16: KVCacheKind.FP16.spec.step,
                                       torch.bfloat16: KVCacheKind.BF16.spec.step}
    ids = [k.spec.step for k in fast_decode.TOKEN_KINDS] + [k.spec.step for k in fast_decode.CHANNEL_KINDS] \
        + list(fast_decode.FLOAT_KINDS.values())
    assert sorted(ids) == list(range(len(ids)))
    assert all(fast_decode.TOKEN_KINDS[k] == k.spec.step for k in fast_decode.TOKEN_KINDS)


def test_ids_with_a_gap_are_refused(monkeypatch):
    """A new row whose step id leaves a gap (or repeats one) is caught when the header is made."""
    free = max(k.spec.step for k in KVCacheKind if k.spec.step is not None) + 1
    gap = KindSpec("q3_test", bits=4, dtype=torch.uint8, code_range=(0, 7), step=free + 1)

    class Fake:
        name, spec = "Q3_TEST", gap
    monkeypatch.setattr(kinds_c, "KVCacheKind", [*KVCacheKind, Fake])
    with pytest.raises(ValueError, match=f"step ids must be 0..n-1.*Q3_TEST={free + 1}"):
        kinds_c.header()
