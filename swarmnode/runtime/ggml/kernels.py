"""Multiply activations by GGUF weights as they are (still quantized), with ggml-cpu's semantics.

:func:`matmul` computes ``y = x @ W.T`` where ``W`` is a GGUF tensor's bytes, one row of ggml blocks per
output feature. Like llama.cpp's CPU backend (``ggml_compute_forward_mul_mat``), each activation row is
first quantized to the weight type's ``vec_dot_type`` (``quantize_row_q8_0`` / ``_q8_1`` / ``_q8_K``) and
each output is ``ggml_vec_dot_<type>_<vec_dot_type>``: integer dot products per block, scaled by the
fp16 scales. So a model served from a GGUF gives the numbers llama.cpp gives, not those of a dequantized
copy. :func:`dequantize` equals ggml's ``dequantize_row_*`` (and ``gguf.quants.dequantize``) bit for bit;
the caller uses it for embedding rows and for big batches (dequantize, then a GEMM).

Every output is computed by one thread in an order of float operations fixed by ``k`` alone (each SIMD
path of the C code follows the same order), so its bits do not depend on the batch (which other sessions
share it), on the other rows, on the thread count, or on which CPU extensions the build used. With several
rows the kernels load each weight block once for up to 8 rows, so a batch costs little more than one row; with
one row they read several weight rows side by side (more memory streams in flight), and :func:`matmul_group`
multiplies one row by the several matrices that take it (a block's q/k/v) in one call.

The kernels are C (``kernels.c``), compiled once per CPU and source into ``cache_home()/kernels`` with the
system C compiler and loaded with ctypes, after torch, so they share torch's libgomp and obey
``torch.set_num_threads``. Without a compiler (or with ``SWARMNODE_GGML_KERNELS=reference``) a pure
torch/numpy reference runs instead: dequantize with ``gguf.quants.dequantize``, then a float32 linear;
correct within the activation-quantization error, but slow. :func:`backend` says which one is active.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch  # before the .so is loaded: its libgomp.so.1 must resolve to torch's copy

from swarmnode.runtime.ggml.formats import FORMATS, GGMLType, as_type, row_bytes

__all__ = ["MAX_GROUP", "WeightGroup", "available", "backend", "decode_step_kernels", "dequantize", "matmul",
           "matmul_group"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("kernels.c")
# -ffp-contract=off: no fused a*b+c beyond the explicit fmaf/_mm256_fmadd_ps, so dequantize matches ggml's
# and numpy's arithmetic exactly.
_FLAGS = ("-std=c11", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off")
_ENV_BACKEND = "SWARMNODE_GGML_KERNELS"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_backend: str | None = None
_matmul_fn = None
_group_fn = None
_deq_fn = None
_deq_bf16_fn = None
_set_threads_fn = None
_attn_in_fn = None
_attn_out_fn = None
_threads_set = 0


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), version.encode(),
                 _cpu_flags().encode(), platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    from swarmnode.model_prep import cache_home

    return cache_home() / "kernels" / f"sn_ggml_{h.hexdigest()[:20]}.so"


def _build(cc: str, target: Path) -> None:
    """Compile kernels.c into `target` unless it exists; safe when several processes race."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return
        logger.info("compiling the ggml kernels once for this CPU (a few seconds)")
        t0 = time.monotonic()
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
        os.close(fd)
        try:
            res = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"],
                                 capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        logger.info("compiled the ggml kernels in %.1f s: %s", time.monotonic() - t0, target)


def _load() -> str:
    """Load the C kernels (building them first if needed) or settle on the reference; returns which."""
    global _lib, _backend, _matmul_fn, _group_fn, _deq_fn, _deq_bf16_fn, _set_threads_fn, _attn_in_fn, _attn_out_fn
    if _backend is not None:
        return _backend
    with _lock:
        if _backend is not None:
            return _backend
        if os.environ.get(_ENV_BACKEND, "").strip().lower() == "reference":
            logger.info("%s=reference: using the slow torch/numpy reference for GGUF weights", _ENV_BACKEND)
            _backend = "reference"
            return _backend
        cc = _compiler()
        if cc is None:
            logger.warning(
                "no C compiler found ($CC, cc or gcc), so GGUF weights are multiplied by a slow torch/numpy "
                "reference; install a C compiler with OpenMP (e.g. `apt-get install gcc`) for the fast kernels"
            )
            _backend = "reference"
            return _backend
        try:
            path = _library_path(cc)
            _build(cc, path)
            lib = ctypes.CDLL(str(path))
        except Exception as e:
            logger.warning(
                "could not build the ggml kernels (%s); GGUF weights are multiplied by a slow torch/numpy "
                "reference. Install a working C compiler with OpenMP (e.g. gcc) to get the fast kernels", e
            )
            _backend = "reference"
            return _backend
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        lib.sn_matmul.argtypes = [ctypes.c_int, vp, i64, i64, vp, i64, vp]
        lib.sn_matmul.restype = None
        lib.sn_matmul_group.argtypes = [ctypes.c_int, vp, vp, vp, i64, vp, vp]
        lib.sn_matmul_group.restype = None
        for fn in (lib.sn_dequantize, lib.sn_dequantize_bf16):
            fn.argtypes = [ctypes.c_int, vp, i64, i64, vp]
            fn.restype = None
        f32, i32 = ctypes.c_float, ctypes.c_int
        lib.sn_llama_attn_in.argtypes = [i64, vp, vp, f32, i64, vp, vp, vp, vp, vp, i64, vp, vp, vp]
        lib.sn_llama_attn_out.argtypes = [i64, vp, vp, vp, vp, i64, i64, i64, i64, i64, vp, i64, i64, i64, f32, i32,
                                          vp, vp, f32, vp, vp, i64, i32, vp, i64, vp]
        for fn in (lib.sn_llama_attn_in, lib.sn_llama_attn_out):
            fn.restype = ctypes.c_int
        _attn_in_fn, _attn_out_fn = lib.sn_llama_attn_in, lib.sn_llama_attn_out
        lib.sn_set_num_threads.argtypes = [ctypes.c_int]
        lib.sn_set_num_threads.restype = None
        lib.sn_simd.restype = ctypes.c_int
        _lib, _matmul_fn, _deq_fn, _deq_bf16_fn = lib, lib.sn_matmul, lib.sn_dequantize, lib.sn_dequantize_bf16
        _group_fn = lib.sn_matmul_group
        _set_threads_fn = lib.sn_set_num_threads
        simd = {4: "AVX-512 VNNI", 3: "AVX2 + AVX512-VNNI", 2: "AVX2 + AVX-VNNI", 1: "AVX2", 0: "scalar"}[lib.sn_simd()]
        logger.info("ggml kernels loaded (%s): %s", simd, path)
        _backend = "c"
        return _backend


def available() -> bool:
    """Whether the fast C kernels are in use (else the slow reference)."""
    return _load() == "c"


def backend() -> str:
    """``"c"`` (the compiled kernels) or ``"reference"`` (torch/numpy fallback)."""
    return _load()


def decode_step_kernels():
    """The C entry points of a Llama block's decode step (``sn_llama_attn_in``, ``sn_llama_attn_out``; see
    `runtime.ggml.decode_step`), with the kernels' thread count synced to torch's; None when the reference backend
    runs (no compiler), which has no such step."""
    if _load() != "c":
        return None
    if torch.get_num_threads() != _threads_set:
        _sync_threads()
    return _attn_in_fn, _attn_out_fn


def _sync_threads() -> None:
    global _threads_set
    nt = torch.get_num_threads()
    if nt != _threads_set:
        _set_threads_fn(nt)  # type: ignore[misc]
        _threads_set = nt


def _check_weight(weight: torch.Tensor, t: GGMLType, n: int, k: int) -> int:
    if k <= 0 or n < 0:
        raise ValueError(f"bad GGUF weight shape: n={n} rows of k={k} weights")
    rb = row_bytes(t, k)  # UnsupportedFormatError when k is not a whole number of blocks
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8:
        raise ValueError(f"a GGUF weight must be a uint8 tensor of raw blocks, got {getattr(weight, 'dtype', type(weight))}")
    if weight.device.type != "cpu":
        raise ValueError(f"the ggml kernels run on the CPU; the weight is on {weight.device}")
    if tuple(weight.shape) != (n, rb):
        raise ValueError(
            f"a {t.name} weight of {n} rows of {k} weights must have shape ({n}, {rb}) "
            f"({rb} bytes a row), got {tuple(weight.shape)}"
        )
    if not weight.is_contiguous():
        raise ValueError("the GGUF weight must be contiguous (rows of raw blocks back to back)")
    return rb


def _reference_weight(weight: torch.Tensor, t: GGMLType, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    w = gguf_dequantize(weight.numpy(), GGMLQuantizationType(int(t)))
    return torch.from_numpy(w.reshape(weight.shape[0], k).astype("float32", copy=False))


_row_bytes_cache: dict[tuple[int, int], int] = {}


def matmul(x: torch.Tensor, weight: torch.Tensor, type: GGMLType | int, n: int, k: int) -> torch.Tensor:
    """``x @ W.T`` in float32 for a GGUF weight `W` of `n` rows of `k` weights of `type`, as ggml does it.

    `x`: (..., k), any float dtype (converted to contiguous float32). `weight`: uint8 (n, row_bytes).
    Returns float32 (..., n).
    """
    # The common case (float32 contiguous CPU activations, a well-formed weight) takes a short path: this
    # runs ~100 times per generated token, so its Python overhead matters.
    rb = _row_bytes_cache.get((type, k))
    if (
        rb is not None
        and isinstance(weight, torch.Tensor)
        and weight.dtype is torch.uint8
        and weight.is_cpu
        and weight.shape == (n, rb)
        and weight.is_contiguous()
        and isinstance(x, torch.Tensor)
        and x.dtype is torch.float32
        and x.is_cpu
        and x.dim()
        and x.shape[-1] == k
        and x.is_contiguous()
        and _backend == "c"
    ):
        y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        m = x.numel() // k if k else 0
        if m and n:
            if torch.get_num_threads() != _threads_set:
                _sync_threads()
            _matmul_fn(int(type), weight.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr())  # type: ignore[misc]
        return y
    t = as_type(type)
    rb = _check_weight(weight, t, n, k)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"activations must be a floating-point tensor, got {getattr(x, 'dtype', x.__class__)}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"activations must end in k={k}, got shape {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"the ggml kernels run on the CPU; the activations are on {x.device}")
    lead = x.shape[:-1]
    if x.dtype == torch.float32 and x.is_contiguous():
        x2 = x.view(-1, k)
    else:
        x2 = x.reshape(-1, k).to(torch.float32).contiguous()
    m = x2.shape[0]
    if _load() == "reference":
        return torch.nn.functional.linear(x2, _reference_weight(weight, t, k)).reshape(*lead, n)
    _row_bytes_cache[(int(t), k)] = rb  # a valid (type, k): the short path may take it from now on
    y = torch.empty((m, n), dtype=torch.float32)
    if m and n:
        _sync_threads()
        _matmul_fn(int(t), weight.data_ptr(), n, k, x2.data_ptr(), m, y.data_ptr())  # type: ignore[misc]
    return y.reshape(*lead, n)


#: The most matrices :func:`matmul_group` multiplies in one call (``MAX_GROUP`` in kernels.c).
MAX_GROUP = 8


class WeightGroup:
    """Matrices of k columns that take the same single activation row (a block's query, key and value
    projections), checked and laid out for the kernels once, so a decode step only passes the row and the outputs:
    :meth:`matmul` multiplies the row by all of them in one call, the row quantized once per format and all
    their rows shared out among the threads at once. Each result has the bits :func:`matmul` gives it alone."""

    def __init__(self, weights: list[tuple[torch.Tensor, GGMLType | int, int]], k: int):
        self.weights = [(w, as_type(t), n) for w, t, n in weights]
        for w, t, n in self.weights:
            _check_weight(w, t, n, k)
        self.k, self.count = k, len(self.weights)
        self._types = (ctypes.c_int * self.count)(*(int(t) for _, t, _ in self.weights))
        self._ptrs = (ctypes.c_void_p * self.count)(*(w.data_ptr() for w, _, _ in self.weights))
        self._rows = (ctypes.c_int64 * self.count)(*(n for _, _, n in self.weights))

    def matmul(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x @ W.T`` for each matrix, float32, shape ``(*x.shape[:-1], n)``; `x` ends in k."""
        k = self.k
        usual = x.is_floating_point() and x.device.type == "cpu" and x.numel() == k == x.shape[-1]
        if not usual or self.count > MAX_GROUP or _load() != "c":  # one by one (matmul also rejects bad input)
            return [matmul(x, w, t, n, k) for w, t, n in self.weights]
        x1 = x.reshape(k).to(torch.float32).contiguous()
        outs = [torch.empty(*x.shape[:-1], n, dtype=torch.float32) for _, _, n in self.weights]
        if torch.get_num_threads() != _threads_set:
            _sync_threads()
        _group_fn(self.count, self._types, self._ptrs, self._rows, k, x1.data_ptr(),  # type: ignore[misc]
                  (ctypes.c_void_p * self.count)(*(y.data_ptr() for y in outs)))
        return outs


def matmul_group(x: torch.Tensor, weights: list[tuple[torch.Tensor, GGMLType | int, int]]) -> list[torch.Tensor]:
    """``x @ W.T`` for each ``(W, type, n)`` of `weights` and one activation row `x` (`WeightGroup`, laid out for
    this call only)."""
    return WeightGroup(weights, x.shape[-1]).matmul(x)


def dequantize(
    weight: torch.Tensor, type: GGMLType | int, n: int, k: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The (n, k) values of a GGUF weight (or of a gather of its rows, e.g. ``weight[ids]``), as ggml's
    ``dequantize_row_*`` computes them; `dtype` float32, or bfloat16 (rounded to nearest even)."""
    t = as_type(type)
    _check_weight(weight, t, n, k)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize gives float32 or bfloat16, not {dtype}")
    if _load() == "reference":
        return _reference_weight(weight, t, k).to(dtype)
    out = torch.empty((n, k), dtype=dtype)
    if n:
        _sync_threads()
        fn = _deq_fn if dtype == torch.float32 else _deq_bf16_fn
        fn(int(t), weight.data_ptr(), n, k, out.data_ptr())  # type: ignore[misc]
    return out


assert set(FORMATS) == set(GGMLType)
