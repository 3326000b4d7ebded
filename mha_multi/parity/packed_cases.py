"""The parity cases of packed sequences: several sequences a row, attending only within their own.

Two to five sequences a row and padding at the end (a negative id), causal
and not, with rotary positions that restart at each sequence, grouped heads,
ALiBi, a window and lengths beside them (docs: "Packed sequences").
"""

from __future__ import annotations

from mha_multi.parity.cases import CaseConfig

__all__ = ["PACKED_CASES", "PACKED_SEGMENT_IDS"]

#: Three sequences and padding in the first row, five in the second.
PACKED_SEGMENT_IDS = [[0, 0, 0, 1, 1, 2, 2, -1], [0, 0, 1, 2, 3, 4, 4, -1]]

_PACKED = {"batch": 2, "num_queries": 8, "num_keys": 8, "segment_ids": PACKED_SEGMENT_IDS}

PACKED_CASES = (
    CaseConfig(
        "packed",
        **_PACKED,
        bias=True,
        description="packed sequences: three and five a row, padding at the end",
    ),
    CaseConfig(
        "packed_causal_rotary",
        **_PACKED,
        causal=True,
        num_kv_heads=2,
        options={"rotary": {"theta": 100.0}},
        description="packed causal sequences, rotary positions restarting at each, grouped heads",
    ),
    CaseConfig(
        "packed_alibi_window",
        **_PACKED,
        causal=True,
        valid_lens=[6, 8],
        options={"alibi": True, "window": 2, "rotary": {"theta": 50.0, "interleaved": True}},
        description="packed causal sequences with ALiBi, a window of 2, rotary and lengths",
    ),
)
