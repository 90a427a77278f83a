"""The fused decode-attention kernel (kernels/decode_step/rope_attention.py): rotary embedding, cache write, attention.

Against float64: the rotary embedding written out by hand (rotate_half of each head), the new key and
value put into a copy of the cache at ``pos``, softmax attention with repeated KV heads under the
mask; the kernel's cache must differ from the old one at ``pos`` only, and ``pos`` must move by one.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import countdown.kernels as K  # noqa: E402
from countdown.kernels.decode_step import rope_attention as _rope_attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison():
    with K.overrides(poison_outputs=True):
        yield


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def _reference(qkv, cos, sin, k_cache, v_cache, pos, keep, scale, H):
    B, KVH, T, D = k_cache.shape
    x = qkv.double().view(B, H + 2 * KVH, D)
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    q = x[:, :H] * c + _rotate_half(x[:, :H]) * s
    k_new = (x[:, H:H + KVH] * c + _rotate_half(x[:, H:H + KVH]) * s).to(k_cache.dtype)  # stored rounded
    v_new = x[:, H + KVH:].to(v_cache.dtype)
    k, v = k_cache.clone(), v_cache.clone()
    k[:, :, pos], v[:, :, pos] = k_new, v_new
    g = H // KVH
    kk, vv = (t.double().nan_to_num(0.0).repeat_interleave(g, 1) for t in (k, v))  # NaN only where masked
    att = (q[:, :, None, :] @ kk.transpose(-1, -2))[:, :, 0] * scale
    att = att.masked_fill(~keep[:, None, :], float("-inf"))
    return (torch.softmax(att, -1)[:, :, None, :] @ vv)[:, :, 0], k, v


def _angles(B, D, pos):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = (torch.tensor(pos, dtype=torch.float64).view(-1, 1) + torch.arange(B).view(-1, 1) * 0) * inv
    emb = torch.cat([ang, ang], -1).expand(B, D)
    return emb.cos().float(), emb.sin().float()


@pytest.mark.parametrize("B,H,KVH,T,D,pos,config", [
    (2, 8, 2, 70, 64, 41, dict(BLOCK_N=32, SPLITS=3)),    # pos inside the middle split
    (1, 4, 4, 33, 32, 0, dict(BLOCK_N=16)),               # the first token: only the new key counts
    (3, 6, 2, 129, 80, 128, dict(BLOCK_N=32, SPLITS=2)),   # D not a power of two; pos the cache's last slot
    (1, 8, 1, 300, 16, 150, dict(BLOCK_N=16, SPLITS=19)),  # many splits
    (2, 4, 2, 100, 32, 60, dict(BLOCK_N=16, SPLITS=1)),    # one split: the merge still runs (pos += 1)
    (1, 16, 2, 90, 32, 70, dict(BLOCK_N=16, SKIP_MASKED=False)),  # masked keys read, not counted
], ids=["gqa4", "first", "odd-last", "many-splits", "one-split", "read-masked"])
def test_kernel_against_float64(B, H, KVH, T, D, pos, config):
    torch.manual_seed(T + pos)
    qkv = torch.randn(B, (H + 2 * KVH) * D)
    k_cache, v_cache = torch.randn(B, KVH, T, D), torch.randn(B, KVH, T, D)
    k_cache[:, :, pos + 1:], v_cache[:, :, pos + 1:] = float("nan"), float("nan")  # never filled
    k_cache[:, :, pos], v_cache[:, :, pos] = float("nan"), float("nan")              # stale: must not be read
    keep = torch.arange(T)[None, :] <= pos
    keep = keep.expand(B, T).clone()
    if B > 1:
        keep[1, :pos // 2] = False  # a left-padded row
    cos, sin = _angles(B, D, pos)
    scale = 1 / math.sqrt(D)
    ref, k_ref, v_ref = _reference(qkv, cos, sin, k_cache, v_cache, pos, keep, scale, H)
    for mask in (keep, torch.where(keep, 0.0, float("-inf"))):
        kc, vc = k_cache.clone().to(DEV), v_cache.clone().to(DEV)
        p = torch.tensor(pos, device=DEV)
        out = _rope_attention.rope_decode_attention(qkv.to(DEV), cos.to(DEV), sin.to(DEV), kc, vc, p, mask.to(DEV),
                                                    scale, H, config).cpu()
        assert out.shape == (B, H, D) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        for got, want in ((kc.cpu(), k_ref), (vc.cpu(), v_ref)):
            other = torch.arange(T) != pos  # every other slot untouched, bit for bit; slot pos the new key / value
            torch.testing.assert_close(got[:, :, other], want[:, :, other], rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(got[:, :, pos], want[:, :, pos], rtol=1e-6, atol=1e-6)
        assert int(p) == pos + 1


def test_cos_sin_broadcast_over_the_batch_and_a_strided_qkv():
    B, H, KVH, T, D, pos = 2, 4, 2, 40, 32, 17
    torch.manual_seed(0)
    wide = torch.randn(B, (H + 2 * KVH) * D + 8)
    qkv = wide[:, 8:]  # row stride larger than the row
    k_cache, v_cache = torch.randn(B, KVH, T, D), torch.randn(B, KVH, T, D)
    keep = (torch.arange(T)[None, :] <= pos).expand(B, T)
    cos, sin = _angles(1, D, pos)
    ref, _, _ = _reference(qkv, cos.expand(B, D), sin.expand(B, D), k_cache, v_cache, pos, keep, 0.2, H)
    p = torch.tensor([pos], device=DEV)
    out = _rope_attention.rope_decode_attention(qkv.to(DEV), cos.to(DEV), sin.to(DEV), k_cache.to(DEV),
                                                v_cache.to(DEV), p, keep.to(DEV), 0.2, H, dict(BLOCK_N=16)).cpu()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_bad_layouts_are_named():
    B, H, KVH, T, D = 1, 4, 2, 16, 8
    good = dict(qkv=torch.zeros(B, (H + 2 * KVH) * D), cos=torch.zeros(B, D), sin=torch.zeros(B, D),
                k_cache=torch.zeros(B, KVH, T, D), v_cache=torch.zeros(B, KVH, T, D),
                pos=torch.tensor(3), mask=torch.ones(B, T, dtype=torch.bool), n_heads=H)
    _rope_attention.check(**good)
    for key, bad, words in (("qkv", torch.zeros(B, H * D), "qkv must be"),
                            ("cos", torch.zeros(B, D + 2), "cos must be"),
                            ("pos", torch.tensor([1.0]), "pos must be"),
                            ("mask", torch.ones(B, T + 1, dtype=torch.bool), "mask must be"),
                            ("n_heads", 3, "KVH dividing"),
                            ("k_cache", torch.zeros(B, KVH, T, D - 1), "k_cache and v_cache")):
        with pytest.raises(ValueError, match=words):
            _rope_attention.check(**{**good, key: bad})
