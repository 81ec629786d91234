"""AWQ's 4-bit packing, its repacking into the runtime layout, and their dequantization (torch only)."""
from __future__ import annotations

import pytest
import torch

from kernels.int4_layout import (
    AWQ_ORDER, AWQ_REVERSE_ORDER, dequantize_awq, dequantize_int4, pack_awq, pack_int4, repack_awq, unpack_awq,
    unpack_int4,
)


def test_pack_unpack_round_trip() -> None:
    values = torch.randint(0, 16, (5, 48), generator=torch.Generator().manual_seed(0))
    packed = pack_awq(values)
    assert packed.dtype == torch.int32 and packed.shape == (5, 6)
    assert torch.equal(unpack_awq(packed), values.int())
    assert torch.equal(pack_awq(torch.full((1, 8), 15)), torch.tensor([[-1]], dtype=torch.int32))  # bit 31 set


def test_packing_follows_awq_order_literally() -> None:
    values = torch.randint(0, 16, (3, 16), generator=torch.Generator().manual_seed(1))
    packed = pack_awq(values)
    assert all(AWQ_ORDER[AWQ_REVERSE_ORDER[j]] == j for j in range(8))
    for r in range(3):
        for c in range(2):
            word = 0
            for i in range(8):  # nibble i holds column AWQ_ORDER[i] of the pack
                word |= int(values[r, 8 * c + AWQ_ORDER[i]]) << (4 * i)
            assert packed[r, c].item() & 0xFFFFFFFF == word
            for j in range(8):  # column j sits in nibble AWQ_REVERSE_ORDER[j]
                assert (word >> (4 * AWQ_REVERSE_ORDER[j])) & 0xF == values[r, 8 * c + j]


def test_dequantize_is_q_minus_zero_times_scale_per_group() -> None:
    gen = torch.Generator().manual_seed(2)
    k, n, group = 6, 8, 2
    q, z = torch.randint(0, 16, (k, n), generator=gen), torch.randint(0, 16, (k // group, n), generator=gen)
    s = torch.rand(k // group, n, generator=gen).half()
    w = dequantize_awq(pack_awq(q), pack_awq(z), s, group)
    assert w.dtype == torch.float16
    for i in range(k):
        for j in range(n):
            assert w[i, j].item() == ((q[i, j] - z[i // group, j]).half() * s[i // group, j]).item()


def test_runtime_packing_puts_k_in_natural_nibble_order() -> None:
    values = torch.randint(0, 16, (3, 24), generator=torch.Generator().manual_seed(5))
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (3, 3)
    assert torch.equal(unpack_int4(packed), values.int())
    for c in range(3):
        assert (packed[1, c].item() >> 4 * 5) & 0xF == values[1, 8 * c + 5]  # k = 8c + j in nibble j


@pytest.mark.parametrize(("in_features", "out_features", "group_size"), [(256, 40, 32), (576, 24, 64), (1024, 16, 128)])
def test_repacked_awq_dequantizes_to_the_same_weights(in_features, out_features, group_size) -> None:
    gen = torch.Generator().manual_seed(in_features)
    q = torch.randint(0, 16, (in_features, out_features), generator=gen)
    z = torch.randint(0, 16, (in_features // group_size, out_features), generator=gen)
    s = torch.rand(in_features // group_size, out_features, generator=gen).half()
    weight, zeros, scales = repack_awq(pack_awq(q), pack_awq(z), s)
    assert weight.shape == (out_features, in_features // 8) and weight.dtype == torch.int32
    assert zeros.shape == scales.shape == (out_features, in_features // group_size)
    assert zeros.dtype == scales.dtype == torch.float16
    assert torch.equal(unpack_int4(weight), q.t().int())
    assert torch.equal(dequantize_int4(weight, zeros, scales, group_size),
                       dequantize_awq(pack_awq(q), pack_awq(z), s, group_size).t())
