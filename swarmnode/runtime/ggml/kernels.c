/* ggml-compatible CPU kernels for GGUF weights served as they are (see kernels.py).
 *
 * sn_matmul follows ggml-cpu's mul_mat for one weight type: each activation row is quantized into the
 * weight type's vec_dot_type (quantize_row_q8_0 for Q4_0/Q5_0/Q8_0, quantize_row_q8_1 for Q4_1/Q5_1,
 * quantize_row_q8_K for the K-quants; x86 AVX2 variants for q8_0/q8_1, i.e. d = amax/127 rounded to fp16,
 * x * (127/amax) rounded half-to-even), then every output is ggml_vec_dot_<w>_<x>: exact integer dot
 * products per block, scaled by the blocks' (fp16-rounded) scales and summed in float. F32/F16/BF16
 * weights: a plain float32 dot. sn_dequantize/_bf16 equal ggml's dequantize_row_* (and numpy's
 * gguf.quants.dequantize) bit for bit; build with -ffp-contract=off so no a*b+c is fused.
 *
 * Determinism: output (i, j) is one computation by one thread whose order of float operations is fixed
 * by k alone (see "The summation order" for the 32-element blocks; the K-quants sum exact integers per
 * super-block and fmaf them in order), so it has the same bits whatever m, the other rows of x, or the
 * thread count. Every SIMD path (AVX-512 VNNI+VBMI, AVX2 with or without VNNI, scalar) follows that order
 * and computes the integer dots exactly, so they all give identical bits (tests/test_ggml_kernels.py builds
 * them and compares).
 *
 * Speed: the AVX-512 path loads/unpacks each weight block once for up to 8 activation rows (m > 1 costs
 * little more than m = 1 while the weights stream from memory), and prefetches the weight stream into L2. A
 * single activation row (a decode step) runs against WJ weight rows side by side, so each thread has WJ weight
 * streams in flight and reads the activation chunk once for them (F16 20 -> 25 GB/s, Q8_0 18 -> 21, Q4_K
 * 15 -> 18, Q6_K 17 -> 19.5 on a 2-core Xeon, 600 MB of weights); sn_matmul_group does that for several
 * matrices that take the same row (q/k/v, gate/up) in one parallel region, the row quantized once. The
 * activation rows' quantization is vectorized too, with the scalar code's operations. Q4_K/Q5_K scales are
 * unpacked with byte shuffles (VBMI's multishift) rather than scalar bit twiddling (Q4_K 31 -> 36 GB/s in L2).
 *
 * sn_llama_attn_in / sn_llama_attn_out: a Llama block's decode step around those matmuls (decode_step.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__) && defined(__AVX2__) && defined(__F16C__)
#define SN_AVX512 1
#endif
#ifndef SN_PF
#define SN_PF 4096 /* software prefetch distance in the weight stream, bytes */
#endif
#ifndef SN_PFK
#define SN_PFK 12288 /* the same, for weight rows taken WJ at a time (one activation row) */
#endif
#ifndef WJ
#define WJ 4 /* weight rows per pass over one activation row (K-quants and float formats) */
#endif
#ifndef SN_PF_HINT
#define SN_PF_HINT _MM_HINT_T1
#endif

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };
#define QK 32
#define QKK 256

/* ---------------------------------------------------------------- scalars */
static inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
    float f;
    if (e == 0) {
        f = (float)mant * 0x1p-24f;
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (e == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((e + 112) << 23) | (mant << 13);
    }
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline uint16_t fp32_to_fp16(float f) { /* round to nearest even, as _cvtss_sh(f, 0) */
#if defined(__F16C__)
    return _cvtss_sh(f, 0);
#else
    uint32_t w, b;
    memcpy(&w, &f, 4);
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f, bias_f;
    uint32_t shl1_w = w + w, sign = w & 0x80000000u, bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    b = (bias >> 1) + 0x07800000u;
    memcpy(&bias_f, &b, 4);
    base = bias_f + base;
    memcpy(&b, &base, 4);
    uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

static inline float bf16_to_fp32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t fp32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1))) >> 16);
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* ggml's hsum_float_8 order: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) */
static inline float hsum8_s(const float *a) {
    float r0 = a[0] + a[4], r1 = a[1] + a[5], r2 = a[2] + a[6], r3 = a[3] + a[7];
    return (r0 + r2) + (r1 + r3);
}

static int row_bytes_of(int type, int64_t k) {
    switch (type) {
    case T_F32: return (int)(k * 4);
    case T_F16: case T_BF16: return (int)(k * 2);
    case T_Q4_0: return (int)(k / QK * 18);
    case T_Q4_1: return (int)(k / QK * 20);
    case T_Q5_0: return (int)(k / QK * 22);
    case T_Q5_1: return (int)(k / QK * 24);
    case T_Q8_0: return (int)(k / QK * 34);
    case T_Q4_K: return (int)(k / QKK * 144);
    case T_Q5_K: return (int)(k / QKK * 176);
    case T_Q6_K: return (int)(k / QKK * 210);
    default: return -1;
    }
}

/* ------------------------------------------------ quantized activations */
/* 32-element blocks (q8_0 / q8_1). A row of nb blocks is padded with zero blocks (qs = 0, d = s = 0) to
 * nbp = 8 * ceil(nb / 8) blocks and stored as
 *   qs[nbp * 32]  permuted by 4-block subgroups: byte 128*g + 64*h + 16*j + e is value 16*h + e of block 4*g + j
 *   corr[nbp * 4] int32, one per lane (4j + l of subgroup g: values 4l..4l+3 and 16+4l..16+4l+3 of block
 *                 4g + j): -K * their sum, K = the offset of the weights' unsigned form (Q8_0: 128, Q4_0: 8,
 *                 Q5_0: 16; 0 for Q4_1/Q5_1, not written)
 *   d[nbp], s[nbp] floats (ggml's fp16 values widened: d, and q8_1's s = fp16(d * sum(q)))
 *   d4[nbp * 4]   d of each lane (block 4g + j's d at 16g + 4j .. 16g + 4j + 3)
 * The AVX-512 build stores corr + 0x4B400000 (for every type): its dpbusd sums then read as floats are
 * 1.5 * 2^23 + the exact integer (|sum| < 2^22), converted by one subtraction instead of vcvtdq2ps.
 * K-quants: xq8k, ggml's block_q8_K with d as float. */
typedef struct { int8_t qs[QKK]; int16_t bsums[16]; float d; } xq8k;

static inline int is_float_type(int type) { return type == T_F32 || type == T_F16 || type == T_BF16; }
static inline int is_k_quant(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }
static inline int64_t pad8(int64_t nb) { return (nb + 7) / 8 * 8; }
static inline int woff(int type) { return type == T_Q8_0 ? 128 : type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0; }
static inline int has_min(int type) { return type == T_Q4_1 || type == T_Q5_1; }
static inline int bbytes(int type) {
    return type == T_Q8_0 ? 34 : type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
}
#define X32_BYTES(nbp) ((size_t)(nbp) * 72)
#define X32_CORR(x, nbp) ((const int32_t *)((x) + (nbp) * 32))
#define X32_D(x, nbp) ((const float *)((x) + (nbp) * 48))
#define X32_S(x, nbp) ((const float *)((x) + (nbp) * 52))
#define X32_D4(x, nbp) ((const float *)((x) + (nbp) * 56))

/* quantize_row_q8_0 / q8_1 (x86 AVX2 variant): d = amax/127, id = 127/amax, round half to even. The AVX-512
 * build does each block's arithmetic 16 lanes at a time, with the scalar loop's operations (NaN included: an
 * absolute value that is NaN never raises amax; a product that is NaN is stored as 0 and summed as INT_MIN, as
 * (int)NaN is on x86). */
static void quantize_x32(int type, const float *x, uint8_t *out, int64_t nb) {
    const int64_t nbp = pad8(nb);
    int8_t *qs = (int8_t *)out;
    int32_t *corr = (int32_t *)(out + nbp * 32);
    float *dd = (float *)(out + nbp * 48), *ss = (float *)(out + nbp * 52);
    const int K = woff(type), with_sum = has_min(type);
    memset(out, 0, X32_BYTES(nbp));
    for (int64_t b = 0; b < nb; b++, x += QK) {
        int8_t *o = qs + (b / 4) * 128 + (b % 4) * 16;
#if defined(SN_AVX512)
        const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        const __m512 m = _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
        const float amax = _mm512_reduce_max_ps(m);
        const float d = amax / 127.f, id = amax != 0.0f ? 127.f / amax : 0.0f;
        __m512i sumv = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(h ? x1 : x0, _mm512_set1_ps(id)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i q = _mm512_cvtps_epi32(v); /* exact for integral values; NaN and beyond: INT_MIN */
            q = _mm512_mask_mov_epi32(q, _mm512_cmp_ps_mask(v, _mm512_set1_ps(127.f), _CMP_GT_OQ), _mm512_set1_epi32(127));
            q = _mm512_mask_mov_epi32(q, _mm512_cmp_ps_mask(v, _mm512_set1_ps(-128.f), _CMP_LT_OQ), _mm512_set1_epi32(-128));
            _mm_storeu_si128((__m128i *)(o + 64 * h), _mm512_cvtepi32_epi8(q));
            sumv = _mm512_add_epi32(sumv, q);
        }
        const int sum = _mm512_reduce_add_epi32(sumv);
#else
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.f, id = amax != 0.0f ? 127.f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            float v = nearbyintf(x[j] * id);
            int q = v > 127.f ? 127 : v < -128.f ? -128 : (int)v;
            o[(j / 16) * 64 + j % 16] = (int8_t)q;
            sum += q;
        }
#endif
        dd[b] = fp16_to_fp32(fp32_to_fp16(d));
        ss[b] = with_sum ? fp16_to_fp32(fp32_to_fp16(d * (float)sum)) : 0.0f;
    }
    float *d4 = (float *)(out + nbp * 56);
#if defined(SN_AVX512)
    const __m512i ones = _mm512_set1_epi8(1), spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t c = 0; c < nbp / 4; c++) { /* lanes 16c..16c+15: blocks 4c..4c+3 */
        const __m512i lo = _mm512_loadu_si512(qs + 128 * c), hi = _mm512_loadu_si512(qs + 128 * c + 64);
        const __m512i s8 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, lo), ones, hi);
        _mm512_storeu_si512(corr + 16 * c, _mm512_add_epi32(_mm512_mullo_epi32(s8, _mm512_set1_epi32(-K)),
                                                            _mm512_set1_epi32(0x4B400000)));
        _mm512_storeu_ps(d4 + 16 * c, _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(dd + 4 * c))));
    }
#else
    for (int64_t l = 0; l < nbp * 4; l++) {
        const int8_t *q = qs + 128 * (l / 16) + 4 * (l % 16);
        corr[l] = K ? -K * (q[0] + q[1] + q[2] + q[3] + q[64] + q[65] + q[66] + q[67]) : 0;
        d4[l] = dd[l / 4];
    }
#endif
}

static inline int nearest_int(float f) { /* ggml's: round half to even via the 1.5*2^23 trick */
    float v = f + 12582912.f;
    int i;
    memcpy(&i, &v, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* quantize_row_q8_K_ref: scale from the signed value of largest magnitude (first one), iscale=-127/max; the
 * AVX-512 build finds that value with a reduction and the first lane equal to it, then does the scalar loop's
 * operations 16 lanes at a time (bsums from the stored int8 values, as the scalar loop sums them). */
static void quantize_q8k(const float *x, xq8k *y, int64_t k) {
    for (int64_t b = 0; b < k / QKK; b++, x += QKK) {
        float max = 0, amax = 0;
#if defined(SN_AVX512)
        __m512 m = _mm512_setzero_ps();
        for (int j = 0; j < QKK; j += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), m);
        amax = _mm512_reduce_max_ps(m);
        if (amax != 0.0f) {
            const __m512 a = _mm512_set1_ps(amax);
            for (int j = 0; j < QKK; j += 16) {
                const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + j)), a, _CMP_EQ_OQ);
                if (hit) {
                    max = x[j + __builtin_ctz(hit)];
                    break;
                }
            }
        }
#else
        for (int j = 0; j < QKK; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
#endif
        if (amax == 0.0f) {
            memset(&y[b], 0, sizeof(xq8k));
            continue;
        }
        const float iscale = -127.f / max;
#if defined(SN_AVX512)
        for (int j = 0; j < QKK; j += 16) {
            const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(iscale), _mm512_loadu_ps(x + j)),
                                           _mm512_set1_ps(12582912.f));
            const __m512i i = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x007fffff)),
                                               _mm512_set1_epi32(0x00400000));
            const __m128i q8 = _mm512_cvtepi32_epi8(_mm512_min_epi32(i, _mm512_set1_epi32(127)));
            _mm_storeu_si128((__m128i *)(y[b].qs + j), q8);
            y[b].bsums[j / 16] = (int16_t)_mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(q8));
        }
#else
        for (int j = 0; j < QKK; j++) {
            int v = nearest_int(iscale * x[j]);
            y[b].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += y[b].qs[j * 16 + i];
            y[b].bsums[j] = (int16_t)s;
        }
#endif
        y[b].d = 1 / iscale;
    }
}

/* ------------------------------------------------------- int8 dot helpers */
#if defined(__AVX2__)
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { /* lane l += sum_{t<4} u[4l+t]*s[4l+t] */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else /* u <= 31 here (or |a| <= 128 with |b| <= 127 below): the int16 pair sums cannot saturate */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#if !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
static inline __m256i dot_s8s8(__m256i a, __m256i b) { /* |a| * (b * sign(a)); b is never -128 */
    return dot_u8s8(_mm256_setzero_si256(), _mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}
#endif
static inline __m256i bits32(uint32_t qh) { /* byte j = 0xFF if bit j of qh is set */
    const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                            0x0303030303030303LL);
    const __m256i bm = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bm), bm);
}
static inline float hsum8(__m256 v) { /* = hsum8_s */
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
static inline int hsum_i32(__m256i v) {
    __m128i r = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
    r = _mm_add_epi32(r, _mm_unpackhi_epi64(r, r));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 1));
    return _mm_cvtsi128_si32(r);
}
/* 8 fp16 at stride bb, widened */
static inline __m256 ld8h(const uint8_t *p, int bb) {
    return _mm256_cvtph_ps(_mm_setr_epi16((short)rd16(p), (short)rd16(p + bb), (short)rd16(p + 2 * bb),
                                          (short)rd16(p + 3 * bb), (short)rd16(p + 4 * bb), (short)rd16(p + 5 * bb),
                                          (short)rd16(p + 6 * bb), (short)rd16(p + 7 * bb)));
}
#endif

/* ------------------------------------------ vec_dot for 32-element blocks */
/* The summation order, shared by every path (so they give the same bits, and the same bits whatever m):
 * block b = 8*g + 4*s + j (group g, subgroup s, j < 4), lane l < 4 (its values 4l..4l+3 and 16+4l..16+4l+3):
 * p = the exact integer dot of those 8 weights and activations, and
 *     A[s][4j+l] = fmaf(D_b, (float)p, A[s][4j+l]),  D_b = fp16(w.d) * x.d,   blocks in order;
 * Q4_1/Q5_1 also MS[j'] = fmaf(fp16(w.m), x.s, MS[j']) for block b = 8g + j'. Blocks past nb count as zeros
 * (fmaf(0, 0, a)). Result: S = A0 + A1 (16 lanes), T[l] = S[l] + S[l + 8], hsum8_s(T) (+ hsum8_s(MS)). */

/* signed values of a weight block (and dequantize's integer part) */
static void unpack32(int type, const uint8_t *b, int8_t *q) {
    switch (type) {
    case T_Q8_0: memcpy(q, b + 2, 32); break;
    case T_Q4_0: case T_Q4_1: {
        const uint8_t *qs = b + (type == T_Q4_0 ? 2 : 4);
        const int off = type == T_Q4_0 ? 8 : 0;
        for (int j = 0; j < 16; j++) { q[j] = (int8_t)((qs[j] & 15) - off); q[j + 16] = (int8_t)((qs[j] >> 4) - off); }
        break;
    }
    default: { /* Q5_0 / Q5_1 */
        const int o = type == T_Q5_0 ? 2 : 4, off = type == T_Q5_0 ? 16 : 0;
        const uint32_t qh = rd32(b + o);
        const uint8_t *qs = b + o + 4;
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - off);
            q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
        }
    }
    }
}

/* the weight blocks of group g, zero-padded past nb into tmp */
static inline const uint8_t *group_ptr(const uint8_t *wr, int bb, int64_t g, int64_t nb, uint8_t *tmp) {
    const uint8_t *p = wr + 8 * g * (int64_t)bb;
    if (8 * g + 8 <= nb) return p;
    memset(tmp, 0, 8 * 34);
    memcpy(tmp, p, (size_t)(nb - 8 * g) * bb);
    return tmp;
}

#if !defined(__AVX2__)
static float dot32_scalar(int type, const uint8_t *wr, int64_t nb, const uint8_t *x) {
    const int64_t nbp = pad8(nb);
    const int bb = bbytes(type), hm = has_min(type);
    const int8_t *xq = (const int8_t *)x;
    const float *xd = X32_D(x, nbp), *xs = X32_S(x, nbp);
    float A[2][16] = {{0}}, MS[8] = {0}, S[16], T[8];
    uint8_t tmp[8 * 34];
    for (int64_t g = 0; g < nbp / 8; g++) {
        const uint8_t *wg = group_ptr(wr, bb, g, nb, tmp);
        for (int jb = 0; jb < 8; jb++) {
            const int64_t b = 8 * g + jb;
            const int s = jb / 4, j = jb % 4;
            int8_t q[32];
            unpack32(type, wg + jb * bb, q);
            const float D = fp16_to_fp32(rd16(wg + jb * bb)) * xd[b];
            for (int l = 0; l < 4; l++) {
                int p = 0;
                for (int h = 0; h < 2; h++) {
                    const int8_t *xv = xq + 256 * g + 128 * s + 64 * h + 16 * j + 4 * l;
                    for (int t = 0; t < 4; t++) p += q[16 * h + 4 * l + t] * xv[t];
                }
                A[s][4 * j + l] = fmaf(D, (float)p, A[s][4 * j + l]);
            }
            if (hm) MS[jb] = fmaf(fp16_to_fp32(rd16(wg + jb * bb + 2)), xs[b], MS[jb]);
        }
    }
    for (int l = 0; l < 16; l++) S[l] = A[0][l] + A[1][l];
    for (int l = 0; l < 8; l++) T[l] = S[l] + S[l + 8];
    return hm ? hsum8_s(T) + hsum8_s(MS) : hsum8_s(T);
}
#endif

#if defined(__AVX2__) && !defined(SN_AVX512)
/* blocks b0 = 4s+2c and b0+1 of a group, half h: 32 weights as the bytes the lanes multiply */
static inline __m256i w_pair(int type, const uint8_t *p0, int bb, int h) {
    const uint8_t *p1 = p0 + bb;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    switch (type) {
    case T_Q8_0: {
        __m256i v = _mm256_loadu2_m128i((const __m128i *)(p1 + 2 + 16 * h), (const __m128i *)(p0 + 2 + 16 * h));
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
        v = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)); /* w + 128 */
#endif
        return v;
    }
    case T_Q4_0: case T_Q4_1: {
        const int o = type == T_Q4_0 ? 2 : 4;
        __m256i v = _mm256_loadu2_m128i((const __m128i *)(p1 + o), (const __m128i *)(p0 + o));
        return _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, m4);
    }
    default: {
        const int o = type == T_Q5_0 ? 2 : 4;
        __m256i v = _mm256_loadu2_m128i((const __m128i *)(p1 + o + 4), (const __m128i *)(p0 + o + 4));
        v = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, m4);
        const uint32_t hb = ((rd32(p0 + o) >> (16 * h)) & 0xFFFF) | (((rd32(p1 + o) >> (16 * h)) & 0xFFFF) << 16);
        return _mm256_or_si256(v, _mm256_and_si256(bits32(hb), _mm256_set1_epi8(0x10)));
    }
    }
}

static inline __attribute__((always_inline)) float dot32_avx2(int type, const uint8_t *wr, int64_t nb, const uint8_t *x) {
    const int64_t nbp = pad8(nb);
    const int bb = bbytes(type), hm = has_min(type);
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
    const int use_corr = woff(type) != 0;
#else
    const int use_corr = woff(type) != 0 && type != T_Q8_0;
#endif
    const int32_t *corr = X32_CORR(x, nbp);
    const float *xd = X32_D(x, nbp), *xs = X32_S(x, nbp);
    __m256 A[2][2], MS = _mm256_setzero_ps();
    for (int i = 0; i < 2; i++) A[i][0] = A[i][1] = _mm256_setzero_ps();
    uint8_t tmp[8 * 34];
    for (int64_t g = 0; g < nbp / 8; g++) {
        const uint8_t *wg = group_ptr(wr, bb, g, nb, tmp);
        const __m256 D = _mm256_mul_ps(ld8h(wg, bb), _mm256_loadu_ps(xd + 8 * g));
        for (int s = 0; s < 2; s++)
            for (int c = 0; c < 2; c++) {
                const int b0 = 4 * s + 2 * c;
                const __m256 Dc = _mm256_permutevar8x32_ps(D, _mm256_setr_epi32(b0, b0, b0, b0, b0 + 1, b0 + 1, b0 + 1, b0 + 1));
                __m256i p = use_corr ? _mm256_loadu_si256((const __m256i *)(corr + 32 * g + 16 * s + 8 * c))
                                     : _mm256_setzero_si256();
                for (int h = 0; h < 2; h++) {
                    const __m256i u = w_pair(type, wg + b0 * bb, bb, h);
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 256 * g + 128 * s + 64 * h + 32 * c));
#if !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
                    if (type == T_Q8_0) p = _mm256_add_epi32(p, dot_s8s8(u, xv));
                    else
#endif
                    p = dot_u8s8(p, u, xv);
                }
                A[s][c] = _mm256_fmadd_ps(Dc, _mm256_cvtepi32_ps(p), A[s][c]);
            }
        if (hm) MS = _mm256_fmadd_ps(ld8h(wg + 2, bb), _mm256_loadu_ps(xs + 8 * g), MS);
    }
    __m256 S0 = _mm256_add_ps(A[0][0], A[1][0]);
    __m256 S1 = _mm256_add_ps(A[0][1], A[1][1]);
    const float r = hsum8(_mm256_add_ps(S0, S1));
    return hm ? r + hsum8(MS) : r;
}
#endif

#if defined(SN_AVX512)
static inline __m512i ld4x16(const uint8_t *p, int bb) { /* 16 bytes from each of 4 blocks */
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + bb)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 2 * bb)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 3 * bb)), 3);
}
/* Q4_0/Q4_1/Q5_0/Q5_1: a group's 8 blocks (<= 192 bytes) are loaded as 3 zmm and its fields picked out with
 * vpermt2b by these tables, built once at load time. A pick: byte i = group byte off[i]; a = off (window
 * zmm 0-1), b = off - 64 (window 1-2) where off >= 128 (bit i of hi). */
typedef struct { uint8_t a[64], b[64]; uint64_t hi; } pickt;
typedef struct { pickt nib[2], dm, qh[2][2]; } wtab;
static wtab wtabs[4]; /* Q4_0, Q4_1, Q5_0, Q5_1 */
static inline int wtab_slot(int type) { return type == T_Q4_0 ? 0 : type == T_Q4_1 ? 1 : type == T_Q5_0 ? 2 : 3; }

static void make_pick(pickt *p, const int *off) {
    p->hi = 0;
    for (int i = 0; i < 64; i++) {
        p->a[i] = (uint8_t)(off[i] & 127);
        p->b[i] = (uint8_t)((off[i] - 64) & 127);
        if (off[i] >= 128) p->hi |= 1ULL << i;
    }
}

__attribute__((constructor)) static void make_wtabs(void) {
    static const int types[4] = {T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1};
    for (int ti = 0; ti < 4; ti++) {
        const int type = types[ti], bb = bbytes(type), five = type == T_Q5_0 || type == T_Q5_1;
        const int hm = has_min(type), qho = hm ? 4 : 2, nibo = (hm ? 4 : 2) + (five ? 4 : 0);
        wtab *t = &wtabs[ti];
        int off[64];
        for (int s = 0; s < 2; s++) {
            for (int i = 0; i < 64; i++) off[i] = (4 * s + i / 16) * bb + nibo + i % 16;
            make_pick(&t->nib[s], off);
            for (int h = 0; h < 2; h++) {
                for (int i = 0; i < 64; i++) off[i] = (4 * s + i / 16) * bb + qho + 2 * h + (i % 16) / 8;
                make_pick(&t->qh[s][h], off);
            }
        }
        for (int i = 0; i < 64; i++) off[i] = i < 16 ? (i / 2) * bb + i % 2 : i < 32 ? ((i - 16) / 2) * bb + 2 + i % 2 : 0;
        make_pick(&t->dm, off);
    }
}

static inline __m512i pick(const __m512i *Z, const pickt *p) {
    __m512i r = _mm512_permutex2var_epi8(Z[0], _mm512_loadu_si512(p->a), Z[1]);
    if (p->hi) r = _mm512_mask_blend_epi8(p->hi, r, _mm512_permutex2var_epi8(Z[1], _mm512_loadu_si512(p->b), Z[2]));
    return r;
}

typedef struct { __m512i u[4]; __m512 dw4[2]; __m256 mw; } wg32;
static inline __m512 spread_d(__m256 d, int s) { /* lanes 4j..4j+3 = d[4s + j] */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(4 * s, 4 * s, 4 * s, 4 * s, 4 * s + 1, 4 * s + 1, 4 * s + 1, 4 * s + 1,
                                                   4 * s + 2, 4 * s + 2, 4 * s + 2, 4 * s + 2, 4 * s + 3, 4 * s + 3, 4 * s + 3,
                                                   4 * s + 3), _mm512_castps256_ps512(d));
}
#define RW 8 /* activation rows per pass over a weight row (the cases below go up to RW - 1) */

/* a group's 8 weight blocks in their unsigned form: u[2s+h] = half h of blocks 4s..4s+3 */
static inline __attribute__((always_inline)) void load_wg32(int type, const uint8_t *w, wg32 *g) {
    const int bb = bbytes(type);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (type == T_Q8_0) {
        for (int s = 0; s < 2; s++) {
            const uint8_t *b = w + 4 * s * bb;
            g->u[2 * s] = _mm512_xor_si512(ld4x16(b + 2, bb), _mm512_set1_epi8((char)0x80));
            g->u[2 * s + 1] = _mm512_xor_si512(ld4x16(b + 18, bb), _mm512_set1_epi8((char)0x80));
        }
        const __m256 dw = ld8h(w, bb);
        g->dw4[0] = spread_d(dw, 0);
        g->dw4[1] = spread_d(dw, 1);
        return;
    }
    const wtab *tb = &wtabs[wtab_slot(type)];
    __m512i Z[3];
    Z[0] = _mm512_loadu_si512(w);
    Z[1] = _mm512_loadu_si512(w + 64);
    Z[2] = _mm512_maskz_loadu_epi8(~0ULL >> (64 - (8 * bb - 128)), w + 128);
    const __m512i five = _mm512_set1_epi8(16);
    const __m512i bitpat = _mm512_set1_epi64(0x8040201008040201LL);
    for (int s = 0; s < 2; s++) {
        const __m512i t = pick(Z, &tb->nib[s]);
        __m512i lo = _mm512_and_si512(t, m4), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), m4);
        if (type == T_Q5_0 || type == T_Q5_1) {
            lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(pick(Z, &tb->qh[s][0]), bitpat), lo, five);
            hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(pick(Z, &tb->qh[s][1]), bitpat), hi, five);
        }
        g->u[2 * s] = lo;
        g->u[2 * s + 1] = hi;
    }
    const __m512i dm = pick(Z, &tb->dm);
    const __m256 dw = _mm256_cvtph_ps(_mm512_castsi512_si128(dm));
    g->dw4[0] = spread_d(dw, 0);
    g->dw4[1] = spread_d(dw, 1);
    if (has_min(type)) g->mw = _mm256_cvtph_ps(_mm512_extracti32x4_epi32(dm, 1));
}

static inline __attribute__((always_inline)) void acc_wg32(int type, const wg32 *g, const uint8_t *x, int64_t nbp,
                                                             int64_t grp, __m512 *A, __m256 *MS) {
    const int32_t *corr = X32_CORR(x, nbp) + 32 * grp;
    const float *d4 = X32_D4(x, nbp) + 32 * grp;
    const uint8_t *xq = x + 256 * grp;
    for (int s = 0; s < 2; s++) {
        const __m512 Ds = _mm512_mul_ps(g->dw4[s], _mm512_loadu_ps(d4 + 16 * s)); /* fp16(w.d) * x.d per lane */
        __m512i p = _mm512_loadu_si512(corr + 16 * s);
        p = _mm512_dpbusd_epi32(p, g->u[2 * s], _mm512_loadu_si512(xq + 128 * s));
        p = _mm512_dpbusd_epi32(p, g->u[2 * s + 1], _mm512_loadu_si512(xq + 128 * s + 64));
        const __m512 pf = _mm512_sub_ps(_mm512_castsi512_ps(p), _mm512_set1_ps(12582912.0f)); /* exact */
        A[s] = _mm512_fmadd_ps(Ds, pf, A[s]);
    }
    if (has_min(type)) *MS = _mm256_fmadd_ps(g->mw, _mm256_loadu_ps(X32_S(x, nbp) + 8 * grp), *MS);
}

static inline float fin32(int type, const __m512 *A, __m256 MS) {
    const __m512 S = _mm512_add_ps(A[0], A[1]);
    const __m256 T = _mm256_add_ps(_mm512_castps512_ps256(S), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(S), 1)));
    return has_min(type) ? hsum8(T) + hsum8(MS) : hsum8(T);
}

/* The sums of R activation rows against one weight row, kept between the k-chunks of a tile (`tiled32`). */
typedef struct { __m512 A[RW][2]; __m256 MS[RW]; } acc32;

static inline void zero32(acc32 *a, int R) {
    for (int r = 0; r < R; r++) {
        a->MS[r] = _mm256_setzero_ps();
        a->A[r][0] = a->A[r][1] = _mm512_setzero_ps();
    }
}

/* R activation rows (x, x + xrb, ...) against groups [g0, g1) of one weight row, added to `a`: each weight group
 * is loaded once. The sums see the same operations in the same order however the groups are split, so a
 * split (`tiled32`) gives the bits of one pass. */
static inline __attribute__((always_inline)) void part32_512(int type, int R, const uint8_t *wr, int64_t nb,
                                                               int64_t g0, int64_t g1, const uint8_t *x, size_t xrb,
                                                               acc32 *a) {
    const int64_t nbp = pad8(nb);
    const int bb = bbytes(type);
    __m512 A[RW][2];
    __m256 MS[RW];
    for (int r = 0; r < R; r++) {
        MS[r] = a->MS[r];
        A[r][0] = a->A[r][0];
        A[r][1] = a->A[r][1];
    }
    uint8_t tmp[8 * 34];
    for (int64_t grp = g0; grp < g1; grp++) {
        wg32 g;
        const uint8_t *wp = wr + 8 * grp * (int64_t)bb;
        for (int c = 0; c < 8 * bb; c += 64) _mm_prefetch((const char *)(wp + SN_PF + c), SN_PF_HINT);
        load_wg32(type, group_ptr(wr, bb, grp, nb, tmp), &g);
        for (int r = 0; r < R; r++) acc_wg32(type, &g, x + r * xrb, nbp, grp, A[r], &MS[r]);
    }
    for (int r = 0; r < R; r++) {
        a->MS[r] = MS[r];
        a->A[r][0] = A[r][0];
        a->A[r][1] = A[r][1];
    }
}

/* R activation rows against one weight row, all its groups in one pass */
static inline __attribute__((always_inline)) void rows32_512(int type, int R, const uint8_t *wr, int64_t nb,
                                                               const uint8_t *x, size_t xrb, float *y, int64_t ys) {
    acc32 a;
    zero32(&a, R);
    part32_512(type, R, wr, nb, 0, pad8(nb) / 8, x, xrb, &a);
    for (int r = 0; r < R; r++) y[r * ys] = fin32(type, a.A[r], a.MS[r]);
}

/* One activation row against J <= WJ weight rows (wr, wr + rb, ...), each row's sums as rows32_512's with R = 1:
 * the activation group is read once for all J, and J weight streams are in flight at once. */
static inline __attribute__((always_inline)) void wrows32_512(int type, const uint8_t *wr, int64_t rb, const int J,
                                                                int64_t nb, const uint8_t *x, float *y) {
    const int64_t nbp = pad8(nb), groups = nbp / 8;
    const int bb = bbytes(type);
    __m512 A[WJ][2];
    __m256 MS[WJ];
    for (int j = 0; j < WJ; j++) {
        MS[j] = _mm256_setzero_ps();
        A[j][0] = A[j][1] = _mm512_setzero_ps();
    }
    uint8_t tmp[8 * 34];
    for (int64_t grp = 0; grp < groups; grp++) {
        for (int j = 0; j < J; j++) {
            const uint8_t *wj = wr + j * rb;
            const uint8_t *wp = wj + 8 * grp * (int64_t)bb;
            for (int c = 0; c < 8 * bb; c += 64) _mm_prefetch((const char *)(wp + SN_PFK + c), SN_PF_HINT);
            wg32 g;
            load_wg32(type, group_ptr(wj, bb, grp, nb, tmp), &g);
            acc_wg32(type, &g, x, nbp, grp, A[j], &MS[j]);
        }
    }
    for (int j = 0; j < J; j++) y[j] = fin32(type, A[j], MS[j]);
}
#define W32(TY)                                                                                                \
    case TY:                                                                                                   \
        if (J == WJ) wrows32_512(TY, wr, rb, WJ, nb, x, y);                                                    \
        else                                                                                                   \
            for (int j = 0; j < J; j++) wrows32_512(TY, wr + j * rb, rb, 1, nb, x, y + j);                      \
        break;
static void wrows32(int type, const uint8_t *wr, int64_t rb, int J, int64_t nb, const uint8_t *x, float *y) {
    switch (type) {
    W32(T_Q8_0)
    W32(T_Q4_0)
    W32(T_Q4_1)
    W32(T_Q5_0)
    W32(T_Q5_1)
    default: break;
    }
}

#define R32(TY, N) rows32_512(TY, N, wr, nb, x + i * xrb, xrb, y + i * ys, ys)
#define DEF_ROWS32(NAME, TYPE)                                                                                 \
    static void NAME(const uint8_t *wr, int64_t nb, const uint8_t *x, size_t xrb, int64_t m, float *y, int64_t ys) { \
        int64_t i = 0;                                                                                         \
        for (; i + RW <= m; i += RW) R32(TYPE, RW);                                                                  \
        switch (m - i) {                                                                                       \
        case 7: R32(TYPE, 7); break;                                                                                 \
        case 6: R32(TYPE, 6); break;                                                                                 \
        case 5: R32(TYPE, 5); break;                                                                                 \
        case 4: R32(TYPE, 4); break;                                                                                 \
        case 3: R32(TYPE, 3); break;                                                                                 \
        case 2: R32(TYPE, 2); break;                                                                                 \
        case 1: R32(TYPE, 1); break;                                                                                 \
        }                                                                                                      \
    }
#elif defined(__AVX2__)
#define DEF_ROWS32(NAME, TYPE)                                                                                 \
    static void NAME(const uint8_t *wr, int64_t nb, const uint8_t *x, size_t xrb, int64_t m, float *y, int64_t ys) { \
        for (int64_t i = 0; i < m; i++) y[i * ys] = dot32_avx2(TYPE, wr, nb, x + i * xrb);                    \
    }
#else
#define DEF_ROWS32(NAME, TYPE)                                                                                 \
    static void NAME(const uint8_t *wr, int64_t nb, const uint8_t *x, size_t xrb, int64_t m, float *y, int64_t ys) { \
        for (int64_t i = 0; i < m; i++) y[i * ys] = dot32_scalar(TYPE, wr, nb, x + i * xrb);                  \
    }
#endif
DEF_ROWS32(rows_q8_0, T_Q8_0)
DEF_ROWS32(rows_q4_0, T_Q4_0)
DEF_ROWS32(rows_q4_1, T_Q4_1)
DEF_ROWS32(rows_q5_0, T_Q5_0)
DEF_ROWS32(rows_q5_1, T_Q5_1)

#if defined(SN_AVX512)
/* Tiles for batched activations whose quantized rows do not fit L1 together (8 rows of k = 2048 take 36 KiB,
 * of k = 8192 144 KiB): TJ weight rows at a time, k in chunks of the groups whose activations (all R rows) fit
 * TK_BYTES, each chunk against every weight row of the tile while it sits in L1; the sums stay in `acc32`
 * between chunks. Without tiles, every weight row re-read the activations from L2 and 8 rows cost 3.7x one. */
#define TJ 8
#define TK_BYTES 24576
#define X32_GROUP_BYTES 576 /* quantized activations of one group of 8 blocks, one row (X32_BYTES / 8 groups) */
typedef void (*part_fn)(int, const uint8_t *, int64_t, int64_t, int64_t, const uint8_t *, size_t, acc32 *);
#define P32(TY, N) part32_512(TY, N, wr, nb, g0, g1, x, xrb, a)
#define DEF_PART32(NAME, TYPE)                                                                                 \
    static void NAME(int R, const uint8_t *wr, int64_t nb, int64_t g0, int64_t g1, const uint8_t *x, size_t xrb,   \
                     acc32 *a) {                                                                               \
        switch (R) {                                                                                           \
        case 8: P32(TYPE, 8); break;                                                                           \
        case 7: P32(TYPE, 7); break;                                                                           \
        case 6: P32(TYPE, 6); break;                                                                           \
        case 5: P32(TYPE, 5); break;                                                                           \
        case 4: P32(TYPE, 4); break;                                                                           \
        case 3: P32(TYPE, 3); break;                                                                           \
        case 2: P32(TYPE, 2); break;                                                                           \
        default: P32(TYPE, 1); break;                                                                          \
        }                                                                                                      \
    }
DEF_PART32(part_q8_0, T_Q8_0)
DEF_PART32(part_q4_0, T_Q4_0)
DEF_PART32(part_q4_1, T_Q4_1)
DEF_PART32(part_q5_0, T_Q5_0)
DEF_PART32(part_q5_1, T_Q5_1)

static part_fn part_of(int type) {
    switch (type) {
    case T_Q8_0: return part_q8_0;
    case T_Q4_0: return part_q4_0;
    case T_Q4_1: return part_q4_1;
    case T_Q5_0: return part_q5_0;
    case T_Q5_1: return part_q5_1;
    default: return NULL;
    }
}

/* Whether `tiled32` should run: more than one activation row, and their quantized rows together beyond L1 */
static inline int wants_tiles(int type, int64_t m, size_t xrb) {
    return part_of(type) != NULL && m > 1 && (size_t)(m < RW ? m : RW) * xrb > TK_BYTES;
}

static void tiled32(int type, const uint8_t *w, int64_t rb, int64_t n, int64_t nb, const uint8_t *xq, size_t xrb,
                    int64_t m, float *y, int nt) {
    const part_fn part = part_of(type);
    const int64_t groups = pad8(nb) / 8;
    int64_t jt;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (jt = 0; jt < n; jt += TJ) {
        const int64_t je = jt + TJ < n ? jt + TJ : n;
        acc32 acc[TJ];
        for (int64_t i = 0; i < m; i += RW) {
            const int R = m - i < RW ? (int)(m - i) : RW;
            int64_t chunk = TK_BYTES / (R * X32_GROUP_BYTES);
            if (chunk < 1) chunk = 1;
            for (int64_t j = jt; j < je; j++) zero32(&acc[j - jt], R);
            for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
                const int64_t g1 = g0 + chunk < groups ? g0 + chunk : groups;
                for (int64_t j = jt; j < je; j++) part(R, w + j * rb, nb, g0, g1, xq + i * xrb, xrb, &acc[j - jt]);
            }
            for (int64_t j = jt; j < je; j++)
                for (int r = 0; r < R; r++) y[(i + r) * n + j] = fin32(type, acc[j - jt].A[r], acc[j - jt].MS[r]);
        }
    }
}
#endif

/* ---------------------------------------------------------------- K-quants */
/* Per super-block, exact integers (any path): Q4_K/Q5_K isum = sum_j sc_j * dot(q_j, x_j) and
 * summ = sum_j m_j * sum(x_j), then sumf = fmaf(d, isum, sumf); sumf = fmaf(-dmin, summ, sumf) with
 * d = x.d * fp16(w.d), dmin = x.d * fp16(w.dmin). Q6_K: isum = sum_j sc_j * dot(q_j - 32, x_j),
 * sumf = fmaf(x.d * fp16(w.d), isum, sumf). Super-blocks in order. */

/* ggml's get_scale_min_k4: 8 six-bit scales and mins packed in 12 bytes */
static inline void scale_min_k4(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = q[j] & 63;
            mn[j] = q[j + 4] & 63;
        } else {
            sc[j] = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
            mn[j] = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
        }
    }
}

#if !defined(SN_AVX512)
static float dot_q45_k(int five, const uint8_t *w, const xq8k *x, int64_t nb) {
    const int bb = five ? 176 : 144;
    float sumf = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += bb) {
        uint8_t sc[8], mn[8];
        scale_min_k4(w + 4, sc, mn);
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        int summ = 0, isum = 0;
        for (int j = 0; j < 8; j++) summ += mn[j] * (x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]);
#if defined(__AVX2__)
        __m256i is = _mm256_setzero_si256();
        const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
        const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), one), 4));
            }
            const __m256i p1 = dot_u8s8(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)(x[b].qs + 64 * j)));
            const __m256i p2 = dot_u8s8(_mm256_setzero_si256(), hi, _mm256_loadu_si256((const __m256i *)(x[b].qs + 64 * j + 32)));
            is = _mm256_add_epi32(is, _mm256_mullo_epi32(p1, _mm256_set1_epi32(sc[2 * j])));
            is = _mm256_add_epi32(is, _mm256_mullo_epi32(p2, _mm256_set1_epi32(sc[2 * j + 1])));
        }
        isum = hsum_i32(is);
#else
        for (int j = 0; j < 4; j++) {
            for (int h = 0; h < 2; h++) {
                int s = 0;
                for (int l = 0; l < 32; l++) {
                    int v = h ? qs[32 * j + l] >> 4 : qs[32 * j + l] & 15;
                    if (five) v |= ((qh[l] >> (2 * j + h)) & 1) << 4;
                    s += v * x[b].qs[64 * j + 32 * h + l];
                }
                isum += s * sc[2 * j + h];
            }
        }
#endif
        const float d = x[b].d * fp16_to_fp32(rd16(w)), dmin = x[b].d * fp16_to_fp32(rd16(w + 2));
        sumf = fmaf(d, (float)isum, sumf);
        sumf = fmaf(-dmin, (float)summ, sumf);
    }
    return sumf;
}

static float dot_q6_k(const uint8_t *w, const xq8k *x, int64_t nb) {
    float sumf = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        int isum = 0, off = 0;
        for (int j = 0; j < 16; j++) off += sc[j] * x[b].bsums[j];
#if defined(__AVX2__)
        __m256i is = _mm256_setzero_si256();
        const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; h++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            const __m256i hh = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            __m256i u[4];
            u[0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(_mm256_and_si256(hh, m3), 4));
            u[1] = _mm256_or_si256(_mm256_and_si256(c, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), m3), 4));
            u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), m3), 4));
            u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), m3), 4));
            for (int g = 0; g < 4; g++) {
                const int s = 8 * h + 2 * g;
                const __m256i p = dot_u8s8(_mm256_setzero_si256(), u[g],
                                           _mm256_loadu_si256((const __m256i *)(x[b].qs + 128 * h + 32 * g)));
                const __m256i scv = _mm256_setr_epi32(sc[s], sc[s], sc[s], sc[s], sc[s + 1], sc[s + 1], sc[s + 1], sc[s + 1]);
                is = _mm256_add_epi32(is, _mm256_mullo_epi32(p, scv));
            }
        }
        isum = hsum_i32(is);
#else
        for (int h = 0; h < 2; h++) {
            for (int l = 0; l < 32; l++) {
                const uint8_t *L = ql + 64 * h, *H = qh + 32 * h;
                const int8_t *xq = x[b].qs + 128 * h;
                const int u0 = (L[l] & 15) | ((H[l] & 3) << 4), u1 = (L[l + 32] & 15) | (((H[l] >> 2) & 3) << 4);
                const int u2 = (L[l] >> 4) | (((H[l] >> 4) & 3) << 4), u3 = (L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4);
                const int is = 8 * h + l / 16;
                isum += sc[is] * u0 * xq[l] + sc[is + 2] * u1 * xq[l + 32] + sc[is + 4] * u2 * xq[l + 64] +
                        sc[is + 6] * u3 * xq[l + 96];
            }
        }
#endif
        isum -= 32 * off;
        sumf = fmaf(x[b].d * fp16_to_fp32(rd16(w + 208)), (float)isum, sumf);
    }
    return sumf;
}

static void rowsk(int type, const uint8_t *wr, int64_t nb, const uint8_t *x, size_t xrb, int64_t m, float *y, int64_t ys) {
    for (int64_t i = 0; i < m; i++) {
        const xq8k *xr = (const xq8k *)(x + i * xrb);
        y[i * ys] = type == T_Q6_K ? dot_q6_k(wr, xr, nb) : dot_q45_k(type == T_Q5_K, wr, xr, nb);
    }
}
#else
/* AVX-512: one super-block's weights unpacked once (u[t]: values 64t..64t+63 unsigned), then dotted with up
 * to 8 activation rows: p_t = vpdpbusd lanes (|p| < 2^15), two of them packed to int16 (vpackssdw, exact) and
 * multiplied by their scales with one vpdpwssd; scp[P]: the (scale, scale) int16 pairs that packing lines
 * up with (int32 lane q: from p_{2P} if q % 4 < 2 else p_{2P+1}, its lanes 4(q/4) + 2(q%4 % 2) + {0, 1}). */
static int32_t sc_idx6[2][16];  /* Q6_K: [P][q], the int32 lane of the 16 scales (as int32) lane q pairs with */
static uint8_t k4_pair_idx[2][64]; /* Q4_K/Q5_K: the byte of 16 bytes sc[8], mn[8] at bytes 0 and 2 of lane q */
__attribute__((constructor)) static void make_sc_idx(void) {
    for (int P = 0; P < 2; P++)
        for (int q = 0; q < 16; q++) {
            const int t = 2 * P + (q % 4 >= 2), lane = 4 * (q / 4) + 2 * (q % 2);
            sc_idx6[P][q] = 4 * t + lane / 4;
            k4_pair_idx[P][4 * q] = k4_pair_idx[P][4 * q + 2] = (uint8_t)(2 * t + lane / 8);
        }
}
/* ggml's get_scale_min_k4 for all 8 sub-blocks at once: the 12 scale bytes at q (16 read) to sc[8], mn[8] */
static inline __m128i scmn_k4(const uint8_t *q) {
    const __m128i t = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)q),
                                       _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i lo = _mm_and_si128(
        _mm_multishift_epi64_epi8(_mm_setr_epi8(0, 8, 16, 24, 32, 40, 48, 56, 0, 8, 16, 24, 36, 44, 52, 60), t),
        _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
    const __m128i hi = _mm_multishift_epi64_epi8(_mm_setr_epi8(0, 0, 0, 0, 2, 10, 18, 26, 0, 0, 0, 0, 2, 10, 18, 26), t);
    return _mm_ternarylogic_epi64(lo, hi, _mm_setr_epi8(0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30, 0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30),
                                  0xF8); /* lo | (hi & mask) */
}
static inline __m512i sc_pairs6(__m512i scz, int P) {
    const __m512i v = _mm512_permutexvar_epi32(_mm512_loadu_si512(sc_idx6[P]), scz);
    return _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(v, 16));
}
#define KR 8
static inline __m256i hsum8x8(const __m256i *v) { /* lane r = the sum of v[r]'s 8 lanes */
    const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}
/* One super-block of a weight row, unpacked: u[t] the values 64t..64t+63 (unsigned), scp the scale pairs (see
 * above), aux the Q4_K/Q5_K mins repeated per 16-sum pair (int16) or the 16 Q6_K scales (int16), dw and dmw the
 * fp16 scales as floats. */
typedef struct { __m512i u[4], scp[2]; __m256i aux; float dw, dmw; } ksb;
static inline __attribute__((always_inline)) void load_ksb(int type, const uint8_t *w, ksb *k) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    k->dmw = 0.0f;
    if (type == T_Q6_K) {
        const uint8_t *ql = w, *qh = w + 128;
        for (int h = 0; h < 2; h++) {
            const __m512i L = _mm512_loadu_si512(ql + 64 * h);
            const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
            const __m512i c30 = _mm512_set1_epi8(0x30);
            k->u[2 * h] = _mm512_or_si512(_mm512_and_si512(L, m4),
                                       _mm512_and_si512(_mm512_sllv_epi64(H, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2)), c30));
            k->u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                           _mm512_and_si512(_mm512_srlv_epi64(H, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2)), c30));
        }
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + 192));
        const __m512i scz = _mm512_cvtepi8_epi32(sc8);
        k->scp[0] = sc_pairs6(scz, 0);
        k->scp[1] = sc_pairs6(scz, 1);
        k->aux = _mm256_cvtepi8_epi16(sc8);
        k->dw = fp16_to_fp32(rd16(w + 208));
    } else {
        const __m128i scmn = scmn_k4(w + 4); /* sc[8], mn[8] */
        const uint8_t *qs = w + (type == T_Q5_K ? 48 : 16);
        __m512i hb = _mm512_setzero_si512();
        if (type == T_Q5_K) hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 16)));
        for (int t = 0; t < 4; t++) {
            const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * t)));
            k->u[t] = _mm512_and_si512(_mm512_srlv_epi64(q, _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4)), m4);
            if (type == T_Q5_K) {
                const __m512i sel = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8((char)(1 << (2 * t)))),
                                                       _mm256_set1_epi8((char)(1 << (2 * t + 1))), 1);
                k->u[t] = _mm512_mask_add_epi8(k->u[t], _mm512_test_epi8_mask(hb, sel), k->u[t], _mm512_set1_epi8(16));
            }
        }
        const __m512i scz = _mm512_castsi128_si512(scmn);
        k->scp[0] = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, _mm512_loadu_si512(k4_pair_idx[0]), scz);
        k->scp[1] = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, _mm512_loadu_si512(k4_pair_idx[1]), scz);
        k->aux = _mm256_maskz_permutexvar_epi8(0x55555555u, _mm256_setr_epi8(8, 0, 8, 0, 9, 0, 9, 0, 10, 0, 10, 0, 11, 0, 11, 0,
                                                                          12, 0, 12, 0, 13, 0, 13, 0, 14, 0, 14, 0, 15, 0, 15, 0),
                                               _mm512_castsi512_si256(scz));
        k->dw = fp16_to_fp32(rd16(w));
        k->dmw = fp16_to_fp32(rd16(w + 2));
    }
}
/* One activation row's super-block against an unpacked weight super-block: iv (8 lanes of int32) sums to isum
 * (Q6_K: already less 32 times the scaled sums), sv to summ (Q4_K/Q5_K; Q6_K: the scaled sums). */
static inline __attribute__((always_inline)) void dot_ksb(int type, const ksb *k, const xq8k *xb, __m256i *iv,
                                                            __m256i *sv) {
    __m512i is = _mm512_setzero_si512();
    for (int P = 0; P < 2; P++) {
        const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k->u[2 * P], _mm512_loadu_si512(xb->qs + 128 * P));
        const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k->u[2 * P + 1], _mm512_loadu_si512(xb->qs + 128 * P + 64));
        is = _mm512_dpwssd_epi32(is, _mm512_packs_epi32(p0, p1), k->scp[P]);
    }
    *iv = _mm256_add_epi32(_mm512_castsi512_si256(is), _mm512_extracti64x4_epi64(is, 1));
    *sv = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), k->aux);
    if (type == T_Q6_K) *iv = _mm256_sub_epi32(*iv, _mm256_slli_epi32(*sv, 5));
}
static inline __attribute__((always_inline)) void rowsk_512(int type, const uint8_t *wr, int64_t nb, const uint8_t *x,
                                                              size_t xrb, int R, float *y, int64_t ys) {
    const int bb = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    __m256 sumf = _mm256_setzero_ps();
    float sum1 = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = wr + b * bb;
        for (int c = 0; c < bb; c += 64) _mm_prefetch((const char *)(w + SN_PF + c), SN_PF_HINT);
        ksb k;
        load_ksb(type, w, &k);
        if (R == 1) { /* one row: reduce in place, scalar fmaf */
            __m256i iv, sv;
            dot_ksb(type, &k, (const xq8k *)x + b, &iv, &sv);
            const float xd = ((const xq8k *)x + b)->d;
            sum1 = fmaf(xd * k.dw, (float)hsum_i32(iv), sum1);
            if (type != T_Q6_K) sum1 = fmaf(-(xd * k.dmw), (float)hsum_i32(sv), sum1);
            continue;
        }
        __m256i iv[KR], sv[KR];
        float xdv[KR];
        for (int r = 0; r < KR; r++) {
            if (r >= R) { /* unused lanes */
                iv[r] = sv[r] = _mm256_setzero_si256();
                xdv[r] = 0.0f;
                continue;
            }
            const xq8k *xb = (const xq8k *)(x + r * xrb) + b;
            dot_ksb(type, &k, xb, &iv[r], &sv[r]);
            xdv[r] = xb->d;
        }
        /* lane r: row r's isum (summ); then each lane does row r's fmaf steps */
        const __m256 xd = _mm256_loadu_ps(xdv);
        sumf = _mm256_fmadd_ps(_mm256_mul_ps(xd, _mm256_set1_ps(k.dw)), _mm256_cvtepi32_ps(hsum8x8(iv)), sumf);
        if (type != T_Q6_K)
            sumf = _mm256_fmadd_ps(_mm256_xor_ps(_mm256_mul_ps(xd, _mm256_set1_ps(k.dmw)), _mm256_set1_ps(-0.0f)),
                                   _mm256_cvtepi32_ps(hsum8x8(sv)), sumf);
    }
    if (R == 1) {
        y[0] = sum1;
        return;
    }
    float out[KR];
    _mm256_storeu_ps(out, sumf);
    for (int r = 0; r < R; r++) y[r * ys] = out[r];
}
/* One activation row against J <= KR weight rows (wr, wr + rb, ...): the transpose of the above, lane j holding
 * weight row j's sums, so a super-block's integer sums of all J rows are reduced together (hsum8x8) and each lane
 * does its row's fmaf steps: the bits of one row at a time, at a fraction of the reductions, with the activation
 * super-block read once for all J. */
static inline __attribute__((always_inline)) void wrowsk_512(int type, const uint8_t *wr, int64_t rb, int J,
                                                               int64_t nb, const xq8k *x, float *y) {
    const int bb = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    __m256 sumf = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i iv[KR], sv[KR];
        float dwv[KR], dmwv[KR];
        for (int j = 0; j < KR; j++) {
            if (j >= J) {
                iv[j] = sv[j] = _mm256_setzero_si256();
                dwv[j] = dmwv[j] = 0.0f;
                continue;
            }
            const uint8_t *w = wr + j * rb + b * bb;
            for (int c = 0; c < bb; c += 64) _mm_prefetch((const char *)(w + SN_PFK + c), SN_PF_HINT);
            ksb k;
            load_ksb(type, w, &k);
            dot_ksb(type, &k, x + b, &iv[j], &sv[j]);
            dwv[j] = k.dw;
            dmwv[j] = k.dmw;
        }
        const __m256 xd = _mm256_set1_ps(x[b].d);
        sumf = _mm256_fmadd_ps(_mm256_mul_ps(xd, _mm256_loadu_ps(dwv)), _mm256_cvtepi32_ps(hsum8x8(iv)), sumf);
        if (type != T_Q6_K)
            sumf = _mm256_fmadd_ps(_mm256_xor_ps(_mm256_mul_ps(xd, _mm256_loadu_ps(dmwv)), _mm256_set1_ps(-0.0f)),
                                   _mm256_cvtepi32_ps(hsum8x8(sv)), sumf);
    }
    float out[KR];
    _mm256_storeu_ps(out, sumf);
    for (int j = 0; j < J; j++) y[j] = out[j];
}
static void wrowsk(int type, const uint8_t *wr, int64_t rb, int J, int64_t nb, const xq8k *x, float *y) {
    if (type == T_Q4_K) wrowsk_512(T_Q4_K, wr, rb, J, nb, x, y);
    else if (type == T_Q5_K) wrowsk_512(T_Q5_K, wr, rb, J, nb, x, y);
    else wrowsk_512(T_Q6_K, wr, rb, J, nb, x, y);
}
static void rowsk(int type, const uint8_t *wr, int64_t nb, const uint8_t *x, size_t xrb, int64_t m, float *y, int64_t ys) {
    for (int64_t i = 0; i < m; i += KR) {
        const int R = m - i < KR ? (int)(m - i) : KR;
        if (R == 1) {
            if (type == T_Q4_K) rowsk_512(T_Q4_K, wr, nb, x + i * xrb, xrb, 1, y + i * ys, ys);
            else if (type == T_Q5_K) rowsk_512(T_Q5_K, wr, nb, x + i * xrb, xrb, 1, y + i * ys, ys);
            else rowsk_512(T_Q6_K, wr, nb, x + i * xrb, xrb, 1, y + i * ys, ys);
        } else {
            if (type == T_Q4_K) rowsk_512(T_Q4_K, wr, nb, x + i * xrb, xrb, R, y + i * ys, ys);
            else if (type == T_Q5_K) rowsk_512(T_Q5_K, wr, nb, x + i * xrb, xrb, R, y + i * ys, ys);
            else rowsk_512(T_Q6_K, wr, nb, x + i * xrb, xrb, R, y + i * ys, ys);
        }
    }
}
#endif

/* ------------------------------------------------------------ float dots */
/* 64 lanes (8 vectors of 8), lane c%64 for c < k/64*64; lanes combined as
 * ((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7)), then hsum8; the tail in order. Eight independent chains keep both FMA
 * ports busy; a weight chunk is converted once and used for up to FROWS activation rows. */
#define FROWS 4
#define FJB 16 /* weight rows per block of the float matmul (sn_matmul) */

static inline float ld_w(int type, const uint8_t *w, int64_t c) {
    if (type == T_F32) { float f; memcpy(&f, w + 4 * c, 4); return f; }
    return type == T_F16 ? fp16_to_fp32(rd16(w + 2 * c)) : bf16_to_fp32(rd16(w + 2 * c));
}

#if defined(__AVX2__)
static inline __m256 ld_w8(int type, const uint8_t *w, int64_t c) {
    if (type == T_F32) return _mm256_loadu_ps((const float *)(w + 4 * c));
    if (type == T_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 2 * c))),
                                                 16));
}
/* A row's sum from its 64 lanes as 8 vectors of 8, combined ((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7)), then the tail
 * of k past the last whole 64 in order: the same for every SIMD path. */
static inline float fin_lanes8(const __m256 *h, int type, const uint8_t *w, const float *xr, int64_t kk, int64_t k) {
    const __m256 lo = _mm256_add_ps(_mm256_add_ps(h[0], h[1]), _mm256_add_ps(h[2], h[3]));
    const __m256 hi = _mm256_add_ps(_mm256_add_ps(h[4], h[5]), _mm256_add_ps(h[6], h[7]));
    float res = hsum8(_mm256_add_ps(lo, hi));
    for (int64_t c = kk; c < k; c++) res = fmaf(xr[c], ld_w(type, w, c), res);
    return res;
}
#endif

#if defined(__AVX512F__) && defined(__AVX2__)
static inline __m512 ld_w16(int type, const uint8_t *w, int64_t c) {
    if (type == T_F32) return _mm512_loadu_ps((const float *)(w + 4 * c));
    if (type == T_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 2 * c)));
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + 2 * c))), 16));
}
#endif

/* y[r * ys] = dot(w, x + r * xs) for r < R (R <= FROWS); each row's sum is the same as with R = 1. Inlined with
 * a constant R (dot_float_rows), so each count gets its own register allocation. With AVX-512 the 64 lanes are
 * 4 vectors of 16 (vector V holds the 8-lane vectors 2V and 2V + 1): each lane sees the same fused multiply-adds
 * in the same order and the halves are combined as above, so the bits are those of the AVX2 and scalar paths,
 * at half the instructions (batched decode through F16/BF16 weights is bound by them, not by memory). */
static inline __attribute__((always_inline)) void dot_float_rows_r(int type, const uint8_t *w, const float *x,
                                                                   int64_t xs, const int R, int64_t k, float *y,
                                                                   int64_t ys) {
    const int64_t kk = k / 64 * 64;
#if defined(__AVX512F__) && defined(__AVX2__)
    __m512 a[FROWS][4];
    for (int r = 0; r < FROWS; r++)
        for (int v = 0; v < 4; v++) a[r][v] = _mm512_setzero_ps();
    const int es = type == T_F32 ? 4 : 2;
    for (int64_t c = 0; c < kk; c += 64) {
        for (int b = 0; b < 64 * es; b += 64) _mm_prefetch((const char *)(w + c * es + SN_PF + b), SN_PF_HINT);
        for (int v = 0; v < 4; v++) {
            const __m512 wv = ld_w16(type, w, c + 16 * v);
            a[0][v] = _mm512_fmadd_ps(_mm512_loadu_ps(x + c + 16 * v), wv, a[0][v]);
            if (R > 1) a[1][v] = _mm512_fmadd_ps(_mm512_loadu_ps(x + xs + c + 16 * v), wv, a[1][v]);
            if (R > 2) a[2][v] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 2 * xs + c + 16 * v), wv, a[2][v]);
            if (R > 3) a[3][v] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 3 * xs + c + 16 * v), wv, a[3][v]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 h[8]; /* the 8-lane vectors of the AVX2 path */
        for (int v = 0; v < 4; v++) {
            h[2 * v] = _mm512_castps512_ps256(a[r][v]);
            h[2 * v + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[r][v]), 1));
        }
        y[r * ys] = fin_lanes8(h, type, w, x + r * xs, kk, k);
    }
#elif defined(__AVX2__)
    __m256 a[FROWS][8];
    for (int r = 0; r < FROWS; r++)
        for (int v = 0; v < 8; v++) a[r][v] = _mm256_setzero_ps();
    const int es = type == T_F32 ? 4 : 2;
    for (int64_t c = 0; c < kk; c += 64) {
        for (int b = 0; b < 64 * es; b += 64) _mm_prefetch((const char *)(w + c * es + SN_PF + b), SN_PF_HINT);
        for (int v = 0; v < 8; v++) {
            const __m256 wv = ld_w8(type, w, c + 8 * v);
            a[0][v] = _mm256_fmadd_ps(_mm256_loadu_ps(x + c + 8 * v), wv, a[0][v]);
            if (R > 1) a[1][v] = _mm256_fmadd_ps(_mm256_loadu_ps(x + xs + c + 8 * v), wv, a[1][v]);
            if (R > 2) a[2][v] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 2 * xs + c + 8 * v), wv, a[2][v]);
            if (R > 3) a[3][v] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 3 * xs + c + 8 * v), wv, a[3][v]);
        }
    }
    for (int r = 0; r < R; r++) y[r * ys] = fin_lanes8(a[r], type, w, x + r * xs, kk, k);
#else
    for (int r = 0; r < R; r++) {
        const float *xr = x + r * xs;
        float a[64] = {0}, s[8];
        for (int64_t c = 0; c < kk; c += 64)
            for (int l = 0; l < 64; l++) a[l] = fmaf(xr[c + l], ld_w(type, w, c + l), a[l]);
        for (int l = 0; l < 8; l++)
            s[l] = ((a[l] + a[l + 8]) + (a[l + 16] + a[l + 24])) + ((a[l + 32] + a[l + 40]) + (a[l + 48] + a[l + 56]));
        float res = hsum8_s(s);
        for (int64_t c = kk; c < k; c++) res = fmaf(xr[c], ld_w(type, w, c), res);
        y[r * ys] = res;
    }
#endif
}

#if defined(__AVX512F__) && defined(__AVX2__)
/* One activation row against J <= WJ weight rows (w, w + rb, ...), each with the lanes and order above (the bits
 * of dot_float_rows_r with R = 1), the activation chunk loaded once for all J: several weight streams in flight
 * read memory faster than one. */
static inline __attribute__((always_inline)) void dot_float_wrows_r(int type, const uint8_t *w, int64_t rb,
                                                                    const int J, const float *x, int64_t k, float *y) {
    const int64_t kk = k / 64 * 64;
    __m512 a[WJ][4];
    for (int j = 0; j < WJ; j++)
        for (int v = 0; v < 4; v++) a[j][v] = _mm512_setzero_ps();
    const int es = type == T_F32 ? 4 : 2;
    for (int64_t c = 0; c < kk; c += 64) {
        __m512 xv[4];
        for (int v = 0; v < 4; v++) xv[v] = _mm512_loadu_ps(x + c + 16 * v);
        for (int j = 0; j < J; j++) {
            const uint8_t *wj = w + j * rb;
            for (int b = 0; b < 64 * es; b += 64) _mm_prefetch((const char *)(wj + c * es + SN_PFK + b), SN_PF_HINT);
            for (int v = 0; v < 4; v++) a[j][v] = _mm512_fmadd_ps(xv[v], ld_w16(type, wj, c + 16 * v), a[j][v]);
        }
    }
    for (int j = 0; j < J; j++) {
        __m256 h[8];
        for (int v = 0; v < 4; v++) {
            h[2 * v] = _mm512_castps512_ps256(a[j][v]);
            h[2 * v + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j][v]), 1));
        }
        y[j] = fin_lanes8(h, type, w + j * rb, x, kk, k);
    }
}
static void dot_float_wrows(int type, const uint8_t *w, int64_t rb, int J, const float *x, int64_t k, float *y) {
    switch (J) {
    case WJ: dot_float_wrows_r(type, w, rb, WJ, x, k, y); break;
    default:
        for (int j = 0; j < J; j++) dot_float_wrows_r(type, w + j * rb, rb, 1, x, k, y + j);
        break;
    }
}
#endif

static void dot_float_rows(int type, const uint8_t *w, const float *x, int64_t xs, int R, int64_t k, float *y,
                           int64_t ys) {
    switch (R) {
    case 1: dot_float_rows_r(type, w, x, xs, 1, k, y, ys); break;
    case 2: dot_float_rows_r(type, w, x, xs, 2, k, y, ys); break;
    case 3: dot_float_rows_r(type, w, x, xs, 3, k, y, ys); break;
    default: dot_float_rows_r(type, w, x, xs, 4, k, y, ys); break;
    }
}

/* ------------------------------------------------------------- threads */
static int sn_threads = 0; /* set from torch.get_num_threads() by kernels.py; 0: OpenMP's default */

void sn_set_num_threads(int n) { sn_threads = n; }

int sn_num_threads(void) {
#ifdef _OPENMP
    return sn_threads > 0 ? sn_threads : omp_get_max_threads();
#else
    return 1;
#endif
}

int sn_simd(void) { /* which integer-dot path this build uses, for the logs */
#if defined(SN_AVX512)
    return 4;
#elif defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 3;
#elif defined(__AVX2__) && defined(__AVXVNNI__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------- matmul */
/* Below this many multiply-adds a parallel region costs more than it saves; which thread computes an
 * output never changes its bits, so this only affects speed. */
#define PAR_MIN 32768

typedef void (*rows_fn)(const uint8_t *, int64_t, const uint8_t *, size_t, int64_t, float *, int64_t);

void sn_matmul_group(int count, const int *types, const uint8_t *const *ws, const int64_t *ns, int64_t k,
                     const float *x, float *const *ys);

void sn_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y) {
#if defined(SN_AVX512)
    if (m == 1) { /* one activation row: weight rows WJ at a time (sn_matmul_group) */
        const int64_t n1 = n;
        sn_matmul_group(1, &type, &w, &n1, k, x, &y);
        return;
    }
#endif
    const int rb = row_bytes_of(type, k);
    const int nt = sn_num_threads();
    if (rb < 0 || n <= 0 || m <= 0) return;
    if (is_float_type(type)) {
        /* FJB weight rows at a time, each group of FROWS activation rows over all of them: a group's rows stay in
         * L1 while the block's weights, read from memory by the first group, come from L2 for the others (8
         * activation rows of 2048 floats, 64 KiB, do not fit L1: taken in turn per weight row, they cost 3x) */
        int64_t jb;
#if defined(__AVX512F__) && defined(__AVX2__)
        if (m == 1) {
#pragma omp parallel for schedule(static) num_threads(nt) if (n * k >= PAR_MIN)
            for (jb = 0; jb < n; jb += WJ)
                dot_float_wrows(type, w + jb * (int64_t)rb, rb, n - jb < WJ ? (int)(n - jb) : WJ, x, k, y + jb);
            return;
        }
#endif
#pragma omp parallel for schedule(static) num_threads(nt) if (n * k * m >= PAR_MIN)
        for (jb = 0; jb < n; jb += FJB) {
            const int64_t je = jb + FJB < n ? jb + FJB : n;
            for (int64_t i = 0; i < m; i += FROWS) {
                const int R = m - i < FROWS ? (int)(m - i) : FROWS;
                for (int64_t j = jb; j < je; j++)
                    dot_float_rows(type, w + j * (int64_t)rb, x + i * k, k, R, k, y + i * n + j, n);
            }
        }
        return;
    }
    const int kq = is_k_quant(type);
    const int64_t nb = kq ? k / QKK : k / QK;
    const size_t xrb = kq ? (size_t)nb * sizeof(xq8k) : X32_BYTES(pad8(nb));
    uint8_t *xq = malloc(xrb * (size_t)m + 64);
    if (!xq) return;
    int64_t i;
#pragma omp parallel for schedule(static) num_threads(nt) if (m > 1 && m * k >= PAR_MIN)
    for (i = 0; i < m; i++) {
        if (kq) quantize_q8k(x + i * k, (xq8k *)(xq + i * xrb), k);
        else quantize_x32(type, x + i * k, xq + i * xrb, nb);
    }
    rows_fn f = NULL;
    switch (type) {
    case T_Q8_0: f = rows_q8_0; break;
    case T_Q4_0: f = rows_q4_0; break;
    case T_Q4_1: f = rows_q4_1; break;
    case T_Q5_0: f = rows_q5_0; break;
    case T_Q5_1: f = rows_q5_1; break;
    default: break;
    }
#if defined(SN_AVX512)
    if (wants_tiles(type, m, xrb)) {
        tiled32(type, w, rb, n, nb, xq, xrb, m, y, nt);
        free(xq);
        return;
    }
#endif
    int64_t j;
#pragma omp parallel for schedule(static) num_threads(nt) if (n * k * m >= PAR_MIN)
    for (j = 0; j < n; j++) {
        if (f) f(w + j * (int64_t)rb, nb, xq, xrb, m, y + j, n);
        else rowsk(type, w + j * (int64_t)rb, nb, xq, xrb, m, y + j, n);
    }
    free(xq);
}
/* ---------------------------------------------------------- dequantize */
/* One block to floats, ggml's dequantize_row_* arithmetic: d*q, d*q + m, (d*sc)*q - (dmin*m). */
static void dequant_block(int type, const uint8_t *b, float *y) {
    switch (type) {
    case T_Q8_0: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: {
        int8_t q[32];
        unpack32(type, b, q);
        const float d = fp16_to_fp32(rd16(b));
        if (type == T_Q4_1 || type == T_Q5_1) {
            const float m = fp16_to_fp32(rd16(b + 2));
            for (int j = 0; j < 32; j++) y[j] = d * (float)q[j] + m;
        } else {
            for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;
        }
        break;
    }
    case T_Q4_K: case T_Q5_K: {
        const int five = type == T_Q5_K;
        const float d = fp16_to_fp32(rd16(b)), dmin = fp16_to_fp32(rd16(b + 2));
        uint8_t sc[8], mn[8];
        scale_min_k4(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
        for (int j = 0; j < 4; j++) {
            for (int h = 0; h < 2; h++) {
                const float d1 = d * (float)sc[2 * j + h], m1 = dmin * (float)mn[2 * j + h];
                for (int l = 0; l < 32; l++) {
                    int v = h ? qs[32 * j + l] >> 4 : qs[32 * j + l] & 15;
                    if (five) v |= ((qh[l] >> (2 * j + h)) & 1) << 4;
                    y[64 * j + 32 * h + l] = d1 * (float)v - m1;
                }
            }
        }
        break;
    }
    case T_Q6_K: {
        const float d = fp16_to_fp32(rd16(b + 208));
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *L = b + 64 * h, *H = b + 128 + 32 * h;
            float *o = y + 128 * h;
            for (int l = 0; l < 32; l++) {
                const int is = 8 * h + l / 16;
                const int q0 = ((L[l] & 15) | ((H[l] & 3) << 4)) - 32, q1 = ((L[l + 32] & 15) | (((H[l] >> 2) & 3) << 4)) - 32;
                const int q2 = ((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32, q3 = ((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32;
                o[l] = (d * (float)sc[is]) * (float)q0;
                o[l + 32] = (d * (float)sc[is + 2]) * (float)q1;
                o[l + 64] = (d * (float)sc[is + 4]) * (float)q2;
                o[l + 96] = (d * (float)sc[is + 6]) * (float)q3;
            }
        }
        break;
    }
    }
}

static void dequant_rows(int type, const uint8_t *w, int64_t rows, int64_t k, float *of, uint16_t *ob) {
    const int rb = row_bytes_of(type, k), nt = sn_num_threads();
    if (rb < 0 || rows <= 0) return;
    const int be = is_k_quant(type) ? QKK : QK;
    const int bb = row_bytes_of(type, be);
    int64_t r;
#pragma omp parallel for schedule(static) num_threads(nt) if (rows * k >= PAR_MIN)
    for (r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * (int64_t)rb;
        if (is_float_type(type)) {
            for (int64_t c = 0; c < k; c++) {
                const float v = ld_w(type, wr, c);
                if (of) of[r * k + c] = v; else ob[r * k + c] = fp32_to_bf16(v);
            }
            continue;
        }
        float tmp[QKK];
        for (int64_t b = 0; b < k / be; b++) {
            float *dst = of ? of + r * k + b * be : tmp;
            dequant_block(type, wr + b * bb, dst);
            if (!of)
                for (int j = 0; j < be; j++) ob[r * k + b * be + j] = fp32_to_bf16(tmp[j]);
        }
    }
}

void sn_dequantize(int type, const uint8_t *w, int64_t rows, int64_t k, float *out) {
    dequant_rows(type, w, rows, k, out, NULL);
}

void sn_dequantize_bf16(int type, const uint8_t *w, int64_t rows, int64_t k, uint16_t *out) {
    dequant_rows(type, w, rows, k, NULL, out);
}

/* ------------------------------------------------------- grouped matmul */
#define MAX_GROUP 8
#if defined(SN_AVX512)
/* J <= WJ weight rows of one matrix (w, w + rb, ...) against one activation row: `x` itself for the float formats,
 * `xq` (x quantized for the weight's type) for the others. */
static void wrows_any(int type, const uint8_t *w, int64_t rb, int J, int64_t k, const float *x, const uint8_t *xq,
                      float *y) {
    if (is_float_type(type)) dot_float_wrows(type, w, rb, J, x, k, y);
    else if (is_k_quant(type)) wrowsk(type, w, rb, J, k / QKK, (const xq8k *)xq, y);
    else wrows32(type, w, rb, J, k / QK, xq, y);
}
static inline int x_format(int type) { /* which quantized activations a type's dot products take */
    return is_float_type(type) ? -2 : is_k_quant(type) ? -1 : type;
}
#endif

/* ys[i] = x @ ws[i].T for `count` (<= MAX_GROUP) matrices of k columns that take the same single activation row
 * (a block's query, key and value projections; its gate and up projections): x is quantized once per activation
 * format, and every matrix's rows, WJ at a time, are shared out in one parallel region. Each output has the bits
 * sn_matmul gives it alone. */
void sn_matmul_group(int count, const int *types, const uint8_t *const *ws, const int64_t *ns, int64_t k,
                     const float *x, float *const *ys) {
#if defined(SN_AVX512)
    if (count <= 0 || count > MAX_GROUP) return;
    const int nt = sn_num_threads();
    uint8_t *xq[MAX_GROUP];
    int owned[MAX_GROUP];
    int64_t rbs[MAX_GROUP], first[MAX_GROUP + 1], tasks = 0, work = 0;
    for (int i = 0; i < count; i++) {
        rbs[i] = row_bytes_of(types[i], k);
        xq[i] = NULL;
        owned[i] = 0;
        first[i] = tasks;
        if (rbs[i] < 0 || ns[i] <= 0) continue;
        tasks += (ns[i] + WJ - 1) / WJ;
        work += ns[i] * k;
        const int f = x_format(types[i]);
        if (f == -2) continue;
        for (int p = 0; p < i && !xq[i]; p++)
            if (xq[p] && x_format(types[p]) == f) xq[i] = xq[p];
        if (xq[i]) continue;
        if (f == -1) {
            xq[i] = malloc((size_t)(k / QKK) * sizeof(xq8k) + 64);
            if (xq[i]) quantize_q8k(x, (xq8k *)xq[i], k);
        } else {
            xq[i] = malloc(X32_BYTES(pad8(k / QK)) + 64);
            if (xq[i]) quantize_x32(types[i], x, xq[i], k / QK);
        }
        if (!xq[i]) { /* out of memory: nothing is computed */
            for (int p = 0; p < i; p++)
                if (owned[p]) free(xq[p]);
            return;
        }
        owned[i] = 1;
    }
    first[count] = tasks;
    int64_t t;
#pragma omp parallel for schedule(static) num_threads(nt) if (work >= PAR_MIN)
    for (t = 0; t < tasks; t++) {
        int i = 0;
        while (t >= first[i + 1]) i++;
        const int64_t j = (t - first[i]) * WJ;
        const int J = ns[i] - j < WJ ? (int)(ns[i] - j) : WJ;
        wrows_any(types[i], ws[i] + j * rbs[i], rbs[i], J, k, x, xq[i], ys[i] + j);
    }
    for (int i = 0; i < count; i++)
        if (owned[i]) free(xq[i]);
#else
    for (int i = 0; i < count; i++) sn_matmul(types[i], ws[i], ns[i], k, x, 1, ys[i]);
#endif
}

/* --------------------------------------------------- decode step of a Llama block */
/* One token through a Llama-architecture decoder layer (RMSNorm, rotary attention over grouped keys and values,
 * a SiLU-gated MLP, residual adds) with every op between the matmuls done here, so a decode step crosses two
 * calls a block instead of some sixty framework ops (each of which, after a matmul has streamed megabytes of
 * weights through the caches, starts cold). The arithmetic, the same in every build (plain float operations in a
 * fixed order, no fused multiply-adds):
 *   sums of products (RMSNorm's sum of squares, attention scores): 16 lanes, lane i % 16, then the lanes added
 *     pairwise (l + 8, l + 4, l + 2, l + 1);
 *   RMSNorm: y_i = w_i * (x_i * (1 / sqrtf(sum / n + eps)))      (LlamaRMSNorm's order: the weight last)
 *   rotary: q_i * cos_i + r_i * sin_i, r = (-q[d/2:], q[:d/2])  (transformers' apply_rotary_pos_emb, exactly)
 *   attention: s_j = dot(q, k_j) * scale, p_j = expf(s_j - max_j s) / sum_j (summed in j order),
 *     o = sum_j p_j v_j in j order;
 *   MLP: silu(g) * u with silu(g) = g / (1 + expf(-g)).
 * The matmuls are sn_matmul_group / sn_matmul's, with their bits. */
static float dot_lanes(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i + l < n; l++) acc[l] += a[i + l] * b[i + l];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

static void rms_norm(const float *x, const float *w, float eps, int64_t n, float *y) {
    const float r = 1.0f / sqrtf(dot_lanes(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

static void rotary(float *q, const float *cos, const float *sin, int64_t heads, int64_t d) {
    const int64_t h = d / 2;
    for (int64_t head = 0; head < heads; head++, q += d)
        for (int64_t i = 0; i < h; i++) {
            const float a = q[i], b = q[i + h];
            q[i] = a * cos[i] + (-b) * sin[i];
            q[i + h] = b * cos[i + h] + a * sin[i + h];
        }
}

/* attention of one query row per head over kv_len cached positions, for each of `rows` rows; head h reads key/value
 * head h / (nq / nkv); position j of row r's key head g at k + r * kb + g * ks + j * d (v: vb, vs). mask: NULL, or
 * rows x kv_len bytes, 0 where the row must not look (the key is skipped: no score, no weight). A row that may see
 * no key gets zeros. Each thread keeps kv_len floats of scores. Returns 0, or -1 when out of memory. */
static int attend(int64_t rows, const float *q, const float *k, const float *v, int64_t kv_len, int64_t kb,
                  int64_t ks, int64_t vb, int64_t vs, const uint8_t *mask, int64_t nq, int64_t nkv, int64_t d,
                  float scale, float *out) {
    const int64_t group = nq / nkv;
    int failed = 0;
#pragma omp parallel num_threads(sn_num_threads()) if (rows * nq * kv_len * d >= PAR_MIN)
    {
        float *s = malloc((size_t)(kv_len > 0 ? kv_len : 1) * sizeof(float));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t rh;
#pragma omp for schedule(static)
        for (rh = 0; rh < rows * nq; rh++) {
            if (!s) continue;
            const int64_t r = rh / nq, h = rh % nq;
            const float *qh = q + rh * d, *kh = k + r * kb + (h / group) * ks, *vh = v + r * vb + (h / group) * vs;
            const uint8_t *seen = mask ? mask + r * kv_len : NULL;
            float *o = out + rh * d;
            float max = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < kv_len; j++) {
                if (seen && !seen[j]) continue;
                s[j] = dot_lanes(qh, kh + j * d, d) * scale;
                if (s[j] > max) max = s[j];
            }
            for (int64_t j = 0; j < kv_len; j++) {
                if (seen && !seen[j]) continue;
                s[j] = expf(s[j] - max);
                sum += s[j];
            }
            for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
            if (!(sum > 0.0f)) continue;
            for (int64_t j = 0; j < kv_len; j++) {
                if (seen && !seen[j]) continue;
                const float p = s[j] / sum, *vj = vh + j * d;
                for (int64_t i = 0; i < d; i++) o[i] += p * vj[i];
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}

/* y (rows x n each) = x @ W^T for `count` matrices of one input: one grouped call for a single row */
static void matmul_each(int count, const int *types, const uint8_t *const *ws, const int64_t *ns, int64_t k,
                        const float *x, int64_t rows, float *const *ys) {
    if (rows == 1) {
        sn_matmul_group(count, types, ws, ns, k, x, ys);
        return;
    }
    for (int i = 0; i < count; i++) sn_matmul(types[i], ws[i], ns[i], k, x, rows, ys[i]);
}

/* Attention's input for `rows` tokens (one a session): h = RMSNorm(x), q|k|v = h @ [Wq; Wk; Wv]^T (ns: their rows),
 * rotary on q and k (cos, sin: d floats a row). x: rows x hidden; q, k, v: rows x ns[i]. Returns 0, or -1 when out
 * of memory. */
int sn_llama_attn_in(int64_t rows, const float *x, const float *norm_w, float eps, int64_t hidden, const int *types,
                     const uint8_t *const *ws, const int64_t *ns, const float *cos, const float *sin, int64_t d,
                     float *q, float *k, float *v) {
    float *h = malloc((size_t)(rows * hidden) * sizeof(float));
    if (!h) return -1;
    for (int64_t r = 0; r < rows; r++) rms_norm(x + r * hidden, norm_w, eps, hidden, h + r * hidden);
    float *const ys[3] = {q, k, v};
    matmul_each(3, types, ws, ns, hidden, h, rows, ys);
    free(h);
    for (int64_t r = 0; r < rows; r++) {
        rotary(q + r * ns[0], cos + r * d, sin + r * d, ns[0] / d, d);
        rotary(k + r * ns[1], cos + r * d, sin + r * d, ns[1] / d, d);
    }
    return 0;
}

/* The rest of the block for `rows` tokens: a = attention(q; k, v), x1 = x + a @ Wo^T, h = RMSNorm(x1),
 * m = silu(h @ Wg^T) * (h @ Wu^T), out = x1 + m @ Wd^T. k, v: kv_len positions of nkv heads, rows of d floats,
 * heads ks (vs) floats apart, rows kb (vb); mask as attend's. Returns 0, or -1 when out of memory. */
int sn_llama_attn_out(int64_t rows, const float *x, const float *q, const float *k, const float *v, int64_t kv_len,
                      int64_t kb, int64_t ks, int64_t vb, int64_t vs, const uint8_t *mask, int64_t nq, int64_t nkv,
                      int64_t d, float scale, int o_type, const uint8_t *o_w, const float *norm_w, float eps,
                      const int *mlp_types, const uint8_t *const *mlp_ws, int64_t inter, int down_type,
                      const uint8_t *down_w, int64_t hidden, float *out) {
    float *a = malloc((size_t)(rows * (nq * d + 2 * hidden + 2 * inter)) * sizeof(float));
    if (!a) return -1;
    float *o = a + rows * nq * d, *h = o + rows * hidden, *g = h + rows * hidden, *u = g + rows * inter;
    if (attend(rows, q, k, v, kv_len, kb, ks, vb, vs, mask, nq, nkv, d, scale, a)) {
        free(a);
        return -1;
    }
    sn_matmul(o_type, o_w, hidden, nq * d, a, rows, o);
    for (int64_t i = 0; i < rows * hidden; i++) out[i] = x[i] + o[i];
    for (int64_t r = 0; r < rows; r++) rms_norm(out + r * hidden, norm_w, eps, hidden, h + r * hidden);
    const int64_t ns[2] = {inter, inter};
    float *const ys[2] = {g, u};
    matmul_each(2, mlp_types, mlp_ws, ns, hidden, h, rows, ys);
    for (int64_t i = 0; i < rows * inter; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    sn_matmul(down_type, down_w, hidden, inter, g, rows, o);
    for (int64_t i = 0; i < rows * hidden; i++) out[i] = out[i] + o[i];
    free(a);
    return 0;
}
