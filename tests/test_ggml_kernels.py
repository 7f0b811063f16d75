"""The ggml kernels (swarmnode.runtime.ggml.kernels) against ggml's semantics, written here in numpy.

dequantize must equal gguf.quants.dequantize (numpy's copy of ggml's dequantize_row_*) bit for bit.
matmul must equal ggml-cpu's mul_mat: activations quantized to the weight's vec_dot_type
(quantize_row_q8_0/q8_1 as the x86 AVX2 build does them, quantize_row_q8_K_ref), exact integer dot
products per block, scaled by the fp16-rounded scales; the reference below computes that in float64.
Outputs must not depend on the batch or the thread count, bit for bit.
"""

from __future__ import annotations

import ctypes
import platform
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K
from gguf.quants import dequantize as gguf_dequantize

from swarmnode.runtime.ggml import kernels
from swarmnode.runtime.ggml.formats import (
    FORMATS,
    GGMLType,
    UnsupportedFormatError,
    is_quantized,
    row_bytes,
    tensor_bytes,
)

ALL_TYPES = list(GGMLType)
N = 33  # odd, so the two threads get unequal shares

# where each type keeps its fp16 scales (byte offsets in a block)
_SCALE_FIELDS = {
    GGMLType.Q4_0: (0,), GGMLType.Q8_0: (0,), GGMLType.Q5_0: (0,),
    GGMLType.Q4_1: (0, 2), GGMLType.Q5_1: (0, 2),
    GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
}


def _k(t: GGMLType) -> int:
    return FORMATS[t].block_elems * 2 if t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else 96


def random_weight(t: GGMLType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """(n, row_bytes) uint8 of valid blocks: random bytes, fp16 scales in ±0.05 (floats for F32/F16/BF16)."""
    rng = np.random.default_rng(seed + int(t))
    if t == GGMLType.F32:
        return rng.standard_normal((n, k), dtype=np.float32).view(np.uint8)
    if t == GGMLType.F16:
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    if t == GGMLType.BF16:
        f = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32)).to(torch.bfloat16)
        return f.view(torch.int16).numpy().view(np.uint8)
    fmt = FORMATS[t]
    blocks = rng.integers(0, 256, (n * k // fmt.block_elems, fmt.block_bytes), dtype=np.uint8)
    for off in _SCALE_FIELDS[t]:
        scale = rng.uniform(-0.05, 0.05, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8)
    return blocks.reshape(n, row_bytes(t, k))


def random_x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32) * rng.uniform(0.1, 10.0, (m, 1)).astype(np.float32)
    if m > 1:
        x[1, :256] = 0.0  # an all-zero block (d = 0) in both the 32 and the 256 activation blocks
    return torch.from_numpy(x)


# ----------------------------------------------------------------- numpy reference of ggml's semantics
def _f16(a: np.ndarray) -> np.ndarray:
    return a.view(np.float16).astype(np.float32)


def unpack(t: GGMLType, w: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Weight blocks as (q, sc, bias, sub): integer values q (rows, blocks, sub-blocks, sub) and per-sub-block
    float scale sc and per-sub-block bias coefficient, so that W = sc*q + bias per sub-block."""
    n = w.shape[0]
    b = w.reshape(n * k // FORMATS[t].block_elems, FORMATS[t].block_bytes)
    nb = b.shape[0]
    if t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0):
        d = _f16(b[:, :2].copy())
        m = _f16(b[:, 2:4].copy()) if t in (GGMLType.Q4_1, GGMLType.Q5_1) else np.zeros_like(d)
        if t == GGMLType.Q8_0:
            q = b[:, 2:].view(np.int8).astype(np.int64)
        else:
            o = {GGMLType.Q4_0: 2, GGMLType.Q4_1: 4, GGMLType.Q5_0: 6, GGMLType.Q5_1: 8}[t]
            qs = b[:, o:o + 16].astype(np.int64)
            q = np.concatenate([qs & 15, qs >> 4], axis=1)
            if t in (GGMLType.Q5_0, GGMLType.Q5_1):
                qh = b[:, o - 4:o].copy().view(np.uint32).astype(np.int64)
                q |= ((qh >> np.arange(32)) & 1) << 4
            q -= {GGMLType.Q4_0: 8, GGMLType.Q5_0: 16}.get(t, 0)
        return q.reshape(nb, 1, 32), d.reshape(nb, 1), m.reshape(nb, 1), 32
    if t in (GGMLType.Q4_K, GGMLType.Q5_K):
        d, dmin = _f16(b[:, :2].copy()), _f16(b[:, 2:4].copy())
        sc, mn = Q4_K.get_scale_min(b[:, 4:16].copy())
        off = 48 if t == GGMLType.Q5_K else 16
        qs = b[:, off:off + 128].astype(np.int64).reshape(nb, 4, 1, 32) >> np.array([0, 4]).reshape(1, 1, 2, 1)
        q = (qs & 15).reshape(nb, 8, 32)
        if t == GGMLType.Q5_K:
            q |= ((b[:, 16:48].astype(np.int64).reshape(nb, 1, 32) >> np.arange(8).reshape(1, 8, 1)) & 1) << 4
        return q, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), 32
    # Q6_K
    ql, qh = b[:, :128].astype(np.int64), b[:, 128:192].astype(np.int64)
    sc, d = b[:, 192:208].view(np.int8).astype(np.float32), _f16(b[:, 208:210].copy())
    parts = []
    for h in range(2):
        lo, hi, hb = ql[:, 64 * h:64 * h + 32], ql[:, 64 * h + 32:64 * h + 64], qh[:, 32 * h:32 * h + 32]
        parts += [(lo & 15) | ((hb & 3) << 4), (hi & 15) | (((hb >> 2) & 3) << 4),
                  (lo >> 4) | (((hb >> 4) & 3) << 4), (hi >> 4) | (((hb >> 6) & 3) << 4)]
    q = np.concatenate(parts, axis=1).reshape(nb, 16, 16) - 32
    return q, d * sc, np.zeros_like(sc), 16


def quantize_x(t: GGMLType, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's activation quantization: (int values (m, blocks, B), scale d (m, blocks), sum term s)."""
    m, k = x.shape
    if t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K):  # quantize_row_q8_K_ref
        xb = x.reshape(m, k // 256, 256)
        mx = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = np.where(mx == 0, 0, np.float32(-127) / mx).astype(np.float32)
            q = np.minimum(np.rint(iscale * xb), 127).astype(np.int64)
            d = np.where(mx == 0, 0, np.float32(1) / iscale).astype(np.float32)
        return q, d[..., 0], np.zeros_like(d[..., 0])
    # quantize_row_q8_0 / q8_1, x86 AVX2 variant: d = amax/127, x * (127/amax) rounded half to even
    xb = x.reshape(m, k // 32, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        iv = np.where(amax == 0, 0, np.float32(127) / amax).astype(np.float32)
    q = np.rint(xb * iv).astype(np.int64)
    d = (amax / np.float32(127)).astype(np.float32)
    s = (d[..., 0] * q.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float32)
    return q, d.astype(np.float16).astype(np.float32)[..., 0], s


def ggml_matmul(t: GGMLType, w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, scale): ggml's mul_mat in float64 from exact integer block sums, and sum of |terms| for tolerances."""
    n, k, m = w.shape[0], x.shape[1], x.shape[0]
    if not is_quantized(t):
        wf = gguf_dequantize(w, GGMLQuantizationType(int(t))).reshape(n, k).astype(np.float64)
        terms = np.abs(x.astype(np.float64)) @ np.abs(wf).T
        return x.astype(np.float64) @ wf.T, terms
    q, sc, bias, sub = unpack(t, w, k)
    nb = k // FORMATS[t].block_elems
    q = q.reshape(n, nb, -1, sub)
    sc, bias = sc.reshape(n, nb, -1).astype(np.float64), bias.reshape(n, nb, -1).astype(np.float64)
    xq, xd, xs = quantize_x(t, x)
    xq = xq.reshape(m, nb, -1, sub)
    isums = np.einsum("jbsl,ibsl->ijbs", q, xq)  # exact integers
    xsub = xq.sum(-1)  # (m, nb, subs)
    xd64 = xd.astype(np.float64)[:, None, :, None]
    main = sc[None] * isums * xd64
    if t in (GGMLType.Q4_1, GGMLType.Q5_1):  # the min term uses q8_1's fp16 s = fp16(d * sum(q))
        minterm = bias[None, :, :, 0] * xs.astype(np.float64)[:, None, :]
        minterm = minterm[..., None]
    else:
        minterm = bias[None] * xsub[:, None] * xd64
    y = (main + minterm).sum((2, 3))
    return y, (np.abs(main) + np.abs(minterm)).sum((2, 3))


def quantization_tolerance(t: GGMLType, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Bound on |ggml's result - x @ W.T| from quantizing x. Each activation is within 0.5*d of q*d (rounding)
    plus 127*d*2^-11 for the fp16 rounding of d (q8_0/q8_1), so within 0.57*d with d = block amax/127; the
    q8_1 sum s is fp16-rounded too (2^-11 relative). Plus float32 slack (1e-5 of sum |W||x|)."""
    n, k = w.shape[0], x.shape[1]
    wf = np.abs(gguf_dequantize(w, GGMLQuantizationType(int(t))).reshape(n, k).astype(np.float64))
    absx = np.abs(x.astype(np.float64))
    slack = 1e-5 * (absx @ wf.T) + 1e-6
    if not is_quantized(t):
        return slack
    be = 256 if t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else 32
    amax = absx.reshape(x.shape[0], -1, be).max(-1)
    err = np.repeat(0.6 * amax / 127, be, axis=1)  # per element bound
    _, _, bias, _ = unpack(t, w, k)
    mabs = np.repeat(np.abs(bias.astype(np.float64)).reshape(n, -1), k // bias.reshape(n, -1).shape[1], axis=1)
    tol = err @ (wf + mabs).T + slack
    if t in (GGMLType.Q4_1, GGMLType.Q5_1):
        xsum = absx.reshape(x.shape[0], -1, 32).sum(-1)
        tol += 2.0**-10 * (xsum @ np.abs(bias.astype(np.float64)).reshape(n, -1).T)
    return tol


# ------------------------------------------------------------------------------------------- tests
def test_formats() -> None:
    assert {t.name: int(t) for t in GGMLType} == {t.name: int(GGMLQuantizationType[t.name]) for t in GGMLType}
    from gguf import GGML_QUANT_SIZES

    for t, f in FORMATS.items():
        assert (f.block_elems, f.block_bytes) == GGML_QUANT_SIZES[GGMLQuantizationType(int(t))]
    assert row_bytes(GGMLType.Q4_K, 512) == 288 and tensor_bytes(GGMLType.Q8_0, (3, 64)) == 3 * 68
    assert not is_quantized(GGMLType.BF16) and is_quantized(GGMLType.Q6_K)
    with pytest.raises(UnsupportedFormatError, match=r"Q2_K.*llama-quantize") as e:
        row_bytes(10, 256)
    assert e.value.code == "unsupported_gguf_type" and isinstance(e.value, ValueError)
    with pytest.raises(UnsupportedFormatError, match="IQ4_NL"):
        row_bytes(20, 256)
    with pytest.raises(UnsupportedFormatError, match="whole number"):
        row_bytes(GGMLType.Q4_K, 100)


def test_backend_is_c() -> None:
    # this machine has a C compiler; the fallback has its own test below
    assert kernels.backend() == "c" and kernels.available()


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact(t: GGMLType) -> None:
    k = _k(t)
    w = random_weight(t, N, k)
    ref = gguf_dequantize(w, GGMLQuantizationType(int(t))).reshape(N, k)
    out = kernels.dequantize(torch.from_numpy(w), t, N, k)
    assert out.dtype == torch.float32 and out.shape == (N, k)
    np.testing.assert_array_equal(out.numpy().view(np.uint32), ref.view(np.uint32))
    bf = kernels.dequantize(torch.from_numpy(w), t, N, k, dtype=torch.bfloat16)
    ref_bf = torch.from_numpy(ref).to(torch.bfloat16)
    assert torch.equal(bf.view(torch.int16), ref_bf.view(torch.int16))
    # a row-gathered subset (an embedding lookup)
    ids = torch.tensor([5, 0, 5, 32])
    sub = kernels.dequantize(torch.from_numpy(w)[ids], t, 4, k)
    np.testing.assert_array_equal(sub.numpy(), ref[ids.numpy()])
    if is_quantized(t):  # the test's own unpacking agrees with gguf's (it backs the matmul reference)
        q, sc, bias, _ = unpack(t, w, k)
        mine = (sc[..., None].astype(np.float64) * q + bias[..., None]).reshape(N, k)
        np.testing.assert_allclose(mine, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_ggml_semantics(t: GGMLType) -> None:
    k = _k(t)
    w = random_weight(t, N, k)
    wt = torch.from_numpy(w)
    for m in (1, 3, 17):
        x = random_x(m, k, seed=m)
        y = kernels.matmul(x, wt, t, N, k)
        assert y.dtype == torch.float32 and y.shape == (m, N)
        ref, scale = ggml_matmul(t, w, x.numpy())
        assert np.all(np.abs(y.numpy() - ref) <= 1e-5 * scale + 1e-30), t
        # close to the float64 product with the dequantized weight, within the activation quantization
        exact = x.numpy().astype(np.float64) @ gguf_dequantize(w, GGMLQuantizationType(int(t))).reshape(N, k).T
        assert np.all(np.abs(y.numpy() - exact) <= quantization_tolerance(t, w, x.numpy())), t


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_batch_and_thread_invariance(t: GGMLType) -> None:
    k = _k(t)
    wt = torch.from_numpy(random_weight(t, N, k))
    x = random_x(17, k, seed=7)
    batched = kernels.matmul(x, wt, t, N, k)
    for i in (0, 1, 9, 16):
        alone = kernels.matmul(x[i:i + 1], wt, t, N, k)
        assert torch.equal(alone[0].view(torch.int32), batched[i].view(torch.int32))
        # other rows' contents do not matter either
        other = x.clone()
        other[[j for j in range(17) if j != i]] *= 3.0
        assert torch.equal(kernels.matmul(other, wt, t, N, k)[i].view(torch.int32), batched[i].view(torch.int32))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.matmul(x, wt, t, N, k)
        torch.set_num_threads(2)
        two = kernels.matmul(x, wt, t, N, k)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))
    assert torch.equal(one.view(torch.int32), batched.view(torch.int32))


def test_batch_invariance_long_rows() -> None:
    """Rows long enough for several 8-block groups plus a partial one, m beyond one 8-row pass."""
    for t in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q6_K):
        k = 32 * 45 if FORMATS[t].block_elems == 32 else 256 * 5
        w = random_weight(t, 11, k, seed=3)
        wt = torch.from_numpy(w)
        x = random_x(19, k, seed=5)
        batched = kernels.matmul(x, wt, t, 11, k)
        for i in (0, 7, 8, 18):
            assert torch.equal(kernels.matmul(x[i:i + 1], wt, t, 11, k).view(torch.int32), batched[i:i + 1].view(torch.int32))
        ref, scale = ggml_matmul(t, w, x.numpy())
        assert np.all(np.abs(batched.numpy() - ref) <= 1e-5 * scale + 1e-30), t


def test_tiled_batches_give_the_bits_of_single_rows() -> None:
    """Batched rows long enough that their quantized activations do not fit L1 together take the tiled path
    (weight rows in tiles of 8, k in chunks: `tiled32`): every row must still equal its own single-row product
    and ggml's arithmetic, with one thread or two, over several chunks, a partial chunk, a partial tile and a
    partial 8-block group."""
    for t in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0):
        k = 32 * 261  # 261 blocks: 33 groups, the last holding 5 blocks
        w = random_weight(t, 21, k, seed=13)
        wt = torch.from_numpy(w)
        x = random_x(11, k, seed=17)  # a pass of 8 rows, then one of 3
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = kernels.matmul(x, wt, t, 21, k)
            torch.set_num_threads(2)
            batched = kernels.matmul(x, wt, t, 21, k)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one.view(torch.int32), batched.view(torch.int32)), t
        for i in (0, 5, 8, 10):
            alone = kernels.matmul(x[i:i + 1], wt, t, 21, k)
            assert torch.equal(alone.view(torch.int32), batched[i:i + 1].view(torch.int32)), (t, i)
        pair = kernels.matmul(x[3:5], wt, t, 21, k)  # two rows: tiled, with chunks sized for two
        assert torch.equal(pair.view(torch.int32), batched[3:5].view(torch.int32)), t
        ref, scale = ggml_matmul(t, w, x.numpy())
        assert np.all(np.abs(batched.numpy() - ref) <= 1e-5 * scale + 1e-30), t


# builds of kernels.c for other CPUs: each SIMD path must give the same bits as this machine's
_VARIANTS = {
    "scalar": ["-march=x86-64"],
    "avx2": ["-march=x86-64-v3"],
    "native-no-vnni": ["-march=native", "-mno-avx512vnni", "-mno-avxvnni"],
    "native-no-vbmi": ["-march=native", "-mno-avx512vbmi"],
}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 SIMD variants")
def test_simd_paths_give_identical_bits(tmp_path) -> None:
    cc = kernels._compiler()
    if cc is None or not kernels.available():
        pytest.skip("no C compiler")
    base = [f for f in kernels._FLAGS if not f.startswith("-march")]
    procs = {name: subprocess.Popen([cc, *base, *flags, str(kernels._SOURCE), "-o", str(tmp_path / f"{name}.so"), "-lm"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for name, flags in _VARIANTS.items()}
    libs, errors = {}, {}
    for name, proc in procs.items():
        errors[name] = proc.communicate(timeout=300)[1].decode(errors="replace")[-2000:]
        if proc.returncode == 0:  # a compiler without some -mno-* flag: that variant is skipped
            lib = ctypes.CDLL(str(tmp_path / f"{name}.so"))
            i64, vp = ctypes.c_int64, ctypes.c_void_p
            lib.sn_matmul.argtypes = [ctypes.c_int, vp, i64, i64, vp, i64, vp]
            lib.sn_matmul.restype = None
            lib.sn_set_num_threads.argtypes = [ctypes.c_int]
            lib.sn_set_num_threads(2)
            libs[name] = lib
    assert "scalar" in libs and "avx2" in libs, errors
    for t in ALL_TYPES:
        k = 256 * 3 if FORMATS[t].block_elems == 256 else 32 * 13
        n = 37  # more weight rows than a block of the float matmul (FJB = 16), the last block partial
        wt = torch.from_numpy(random_weight(t, n, k, seed=11))
        for m in (1, 3, 10):
            x = random_x(m, k, seed=m)
            if m == 10 and FORMATS[t].block_elems == 32 and is_quantized(t):
                x = random_x(m, 32 * 261, seed=m)  # long rows: the tiled path of this machine's build
                wt = torch.from_numpy(random_weight(t, n, 32 * 261, seed=11))
                k = 32 * 261
            want = kernels.matmul(x, wt, t, n, k)
            for name, lib in libs.items():
                y = torch.empty(m, n)
                lib.sn_matmul(int(t), wt.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr())
                assert torch.equal(y.view(torch.int32), want.view(torch.int32)), (t.name, m, name)


def test_leading_dims_and_dtypes() -> None:
    t, k = GGMLType.Q8_0, 64
    wt = torch.from_numpy(random_weight(t, 5, k))
    x = random_x(6, k).reshape(2, 3, k)
    y = kernels.matmul(x, wt, t, 5, k)
    assert y.shape == (2, 3, 5)
    assert torch.equal(y.reshape(6, 5), kernels.matmul(x.reshape(6, k), wt, t, 5, k))
    xb = x.to(torch.bfloat16)
    assert torch.equal(kernels.matmul(xb, wt, t, 5, k), kernels.matmul(xb.float(), wt, t, 5, k))
    xt = random_x(k, 4).T  # not contiguous
    assert torch.equal(kernels.matmul(xt, wt, t, 5, k), kernels.matmul(xt.contiguous(), wt, t, 5, k))


@pytest.mark.parametrize("t", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.BF16],
                         ids=lambda t: t.name)
def test_reference_fallback(t: GGMLType, monkeypatch: pytest.MonkeyPatch) -> None:
    k = _k(t)
    w = random_weight(t, N, k)
    wt = torch.from_numpy(w)
    x = random_x(3, k)
    fast = kernels.matmul(x, wt, t, N, k)
    fast_deq = kernels.dequantize(wt, t, N, k, dtype=torch.bfloat16)
    monkeypatch.setenv("SWARMNODE_GGML_KERNELS", "reference")
    monkeypatch.setattr(kernels, "_backend", None)
    assert kernels.backend() == "reference" and not kernels.available()
    slow = kernels.matmul(x, wt, t, N, k)
    assert np.all(np.abs(slow.numpy() - fast.numpy()) <= quantization_tolerance(t, w, x.numpy()))
    assert torch.equal(kernels.dequantize(wt, t, N, k, dtype=torch.bfloat16), fast_deq)


def test_no_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("SWARMNODE_GGML_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "_backend", None)
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    with caplog.at_level("WARNING", logger=kernels.__name__):
        assert kernels.backend() == "reference"
    assert "C compiler" in caplog.text and "gcc" in caplog.text


def test_bad_inputs() -> None:
    t, k = GGMLType.Q4_0, 64
    wt = torch.from_numpy(random_weight(t, 4, k))
    x = random_x(2, k)
    with pytest.raises(ValueError, match="uint8"):
        kernels.matmul(x, wt.view(torch.int8), t, 4, k)
    with pytest.raises(ValueError, match=r"shape \(4, 36\)"):
        kernels.matmul(x, wt[:, :30].contiguous(), t, 4, k)
    with pytest.raises(ValueError, match=r"shape \(3, 36\).*got \(4, 36\)"):
        kernels.matmul(x, wt, t, 3, k)
    with pytest.raises(ValueError, match="end in k=64"):
        kernels.matmul(x[:, :32], wt, t, 4, k)
    with pytest.raises(ValueError, match="floating-point"):
        kernels.matmul(x.to(torch.int32), wt, t, 4, k)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.matmul(x, torch.from_numpy(random_weight(t, 8, k))[::2], t, 4, k)
    with pytest.raises(UnsupportedFormatError, match="whole number"):
        kernels.matmul(x[:, :48], wt, t, 4, 48)
    for bad in (10, 20):  # Q2_K, IQ4_NL
        with pytest.raises(UnsupportedFormatError, match="supported types are"):
            kernels.matmul(x, wt, bad, 4, k)
        with pytest.raises(UnsupportedFormatError):
            kernels.dequantize(wt, bad, 4, k)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.dequantize(wt, t, 4, k, dtype=torch.float16)


# a block's matrices that take one input, as GGUF files mix their types (Q4_K_M: some value projections in Q6_K)
_GROUPS = [
    (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_K),
    (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1),
    (GGMLType.F16, GGMLType.BF16, GGMLType.F32, GGMLType.Q5_K),
]


@pytest.mark.parametrize("types", _GROUPS, ids=lambda ts: "+".join(t.name for t in ts))
def test_group_gives_each_matrix_its_own_bits(types) -> None:
    """`matmul_group` (one call for the matrices that share an input row) equals `matmul` on each alone, bit for
    bit, with row counts that leave partial blocks of weight rows, with one thread and two."""
    k = 256 * 9  # 9 super-blocks, 72 blocks of 32: a partial 8-block group
    rows = (33, 7, 64, 5, 1)
    weights = [(torch.from_numpy(random_weight(t, rows[i], k, seed=i)), t, rows[i]) for i, t in enumerate(types)]
    x = random_x(1, k, seed=3)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            alone = [kernels.matmul(x, w, t, n, k) for w, t, n in weights]
            # two rows take the batched kernels (8 activation rows a pass over each weight row): the bits of the
            # one-row-at-a-time arithmetic that the single-row path must keep
            batched = [kernels.matmul(torch.cat([x, x * 2.0]), w, t, n, k)[:1] for w, t, n in weights]
            together = kernels.matmul_group(x, weights)
            for a, c, b, (_, t, n) in zip(alone, batched, together, weights):
                assert b.shape == (1, n) and torch.equal(a.view(torch.int32), b.view(torch.int32)), (t.name, threads)
                assert torch.equal(c.view(torch.int32), b.view(torch.int32)), (t.name, threads)
    finally:
        torch.set_num_threads(before)
    # more than one row, or more matrices than one call takes: each matrix on its own, the same results
    many = kernels.matmul_group(random_x(3, k, seed=4), weights)
    for got, (w, t, n) in zip(many, weights):
        assert torch.equal(got, kernels.matmul(random_x(3, k, seed=4), w, t, n, k))
    with pytest.raises(ValueError, match="shape"):
        kernels.matmul_group(x, [(weights[0][0], types[0], rows[0] + 1)])
    with pytest.raises(ValueError, match="floating-point"):
        kernels.matmul_group(x.to(torch.int32), weights)


def test_quantized_activations_of_every_simd_path_agree(tmp_path) -> None:
    """The activation rows' quantization (Q8_0/Q8_1 blocks, Q8_K super-blocks) is vectorized in the AVX-512 build:
    its products equal those of the scalar build on rows with ties, zeros, a repeated largest magnitude of either
    sign and values that round to +-127."""
    cc = kernels._compiler()
    if cc is None or not kernels.available() or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no C compiler or not x86")
    base = [f for f in kernels._FLAGS if not f.startswith("-march")]
    out = tmp_path / "scalar.so"
    subprocess.run([cc, *base, "-march=x86-64", str(kernels._SOURCE), "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.sn_matmul.argtypes = [ctypes.c_int, vp, i64, i64, vp, i64, vp]
    lib.sn_matmul.restype = None
    k = 256 * 4
    x = random_x(4, k, seed=9)
    x[0, :32] = torch.tensor([0.5, -0.5, 1.5, -2.5] * 8) / 127 * 5  # ties at .5 after scaling
    x[1, :256] = 0.0
    x[2, 10], x[2, 200] = -7.0, 7.0  # the largest magnitude twice, first negative: Q8_K takes the first
    x[3, 300], x[3, 301] = 9.0, -9.0
    for t in (GGMLType.Q8_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q6_K):
        wt = torch.from_numpy(random_weight(t, 9, k, seed=2))
        for i in range(4):
            want = torch.empty(1, 9)
            lib.sn_matmul(int(t), wt.data_ptr(), 9, k, x[i:i + 1].contiguous().data_ptr(), 1, want.data_ptr())
            got = kernels.matmul(x[i:i + 1], wt, t, 9, k)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (t.name, i)
