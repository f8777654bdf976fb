"""The fused-attention calls of shared.kernels.sdpa: a fresh chunk padded to its bucket attends exactly as
unpadded, and the buckets are a small fixed set (so cuDNN plans each once per thread)."""

import pytest
import torch

from shared.kernels import sdpa


def test_buckets_are_few_aligned_and_cover_every_length():
    sizes = sdpa.buckets(8192)
    assert len(sizes) == 20 and sizes == sorted(set(sizes)) and sizes[-1] == 8192
    for n in range(1, 20_000, 7):
        b = sdpa.bucket(n)
        assert b >= n and b % 128 == 0
        assert b <= max(128, n * 2 ** 0.25 + 128)  # at most a fourth of a doubling (and the alignment) more
        if n <= 8192:
            assert b == min(size for size in sizes if size >= n)  # the tightest bucket of the set


def cpu_kernel(q, k, v, causal):
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[:2]
    return out, lse


@pytest.mark.parametrize("n,heads,kv_heads", [(1, 2, 2), (130, 4, 2), (1030, 4, 1)])
def test_a_padded_causal_chunk_equals_the_unpadded_one(n, heads, kv_heads):
    """The rows after the chunk are zeros a causal query never sees: output and log-sum-exps are the
    unpadded call's (the padding is what lets cuDNN plan once per bucket)."""
    gen = torch.Generator().manual_seed(n)
    # laid out [1, n, H, D] as the projections leave them, viewed [1, H, n, D]
    q = torch.randn(1, n, heads, 16, generator=gen).transpose(1, 2)
    k, v = (torch.randn(1, n, kv_heads, 16, generator=gen).transpose(1, 2) for _ in range(2))
    got, got_lse = sdpa.padded(q, k, v, cpu_kernel)
    want, want_lse = sdpa.reference(q, k, v, causal=True, with_lse=True)
    assert got.shape == want.shape and got_lse.shape == want_lse.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse.float(), want_lse, rtol=1e-5, atol=1e-5)


def test_on_cpu_both_calls_are_the_reference_and_nothing_is_warmed():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 50, 16, generator=gen)
    k, v = (torch.randn(2, 2, 70, 16, generator=gen) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(sdpa.flash(q, k, v), want)
    out, lse = sdpa.flash(q, k, v, with_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert lse.shape == (2, 4, 50)
    assert sdpa.warm(torch.device("cpu"), torch.float32, 4, 2, 16, 8192) == 0


def test_recurring_shapes_move_to_cudnn_once_flash_did_a_plans_worth_of_work(monkeypatch):
    """cuDNN cannot run here: its call and the flash call are recorded in its place, to check the policy
    alone — a shape goes to cuDNN once the flash kernel has done PROMOTE_FLOPS at it (a big shape at
    once, a small one after several calls), a thread promotes at most MAX_PROMOTED shapes, and a shape
    cuDNN refuses stays on flash."""
    calls = []
    monkeypatch.setattr(sdpa, "_half", lambda q: True)
    monkeypatch.setattr(sdpa, "usable", lambda *a: True)
    monkeypatch.setattr(sdpa, "flash", lambda q, k, v: calls.append(("flash", q.shape[0])))
    monkeypatch.setattr(sdpa, "MAX_PROMOTED", 3)
    monkeypatch.setattr(sdpa, "_sightings", sdpa._Sightings())
    flops = lambda batch: 4 * batch * 2 * 8 * 8 * 4  # noqa: E731  [batch, 2 heads, 8, 4 dims]
    monkeypatch.setattr(sdpa, "PROMOTE_FLOPS", 3 * flops(1))

    def cudnn(q, k, v, causal):
        if q.shape[0] == 9:
            raise RuntimeError("not supported")
        calls.append(("cudnn", q.shape[0]))
        return q, None
    monkeypatch.setattr(sdpa, "_cudnn", cudnn)
    for batch in (1, 1, 1, 1, 1, 4, 4, 9, 9, 9, 2, 2, 2, 3, 3):
        x = torch.zeros(batch, 2, 8, 4)
        sdpa.recurring(x, x, x)
    assert calls == [("flash", 1), ("flash", 1), ("flash", 1), ("cudnn", 1), ("cudnn", 1),  # three calls' work
                     ("flash", 4), ("cudnn", 4),  # a big shape: one call's work is enough
                     ("flash", 9), ("flash", 9), ("flash", 9),  # promoted, cuDNN refused it: flash for good
                     ("flash", 2), ("flash", 2), ("cudnn", 2),  # the refused shape's place
                     ("flash", 3), ("flash", 3)]  # three of three promoted: none left
