/* y = x w^T (+ b) for skinny x: the runner's decode, draft and small verify products
 * (`vericache.model.kernels`), bound by reading the weights once.
 *
 * x: [m, k], w: [n, k], y: [m, n], b: [n] or NULL; float32, contiguous (bfloat16 w:
 * `vc_linear_bf16w`, below; quantized blocks: `vc_linear_qw`; a drafter's LM head over them:
 * `vc_linear_qw_q8x`, then `vc_linear_qw_refine`).
 * Output features go in blocks of JB and rows in blocks of at most IB: each block of JB
 * weight rows is read from memory once for every PANEL rows (it stays in L1 across their
 * row blocks, and the panel's x in L2), each (row, feature) pair accumulating in a vector
 * register over k. The feature blocks are split between `threads` OpenMP threads (the
 * runtime torch itself uses: the library links the libgomp.so.1 torch has loaded). A row's
 * sum is in a fixed order that depends on k and VL alone, not on m, the threads or the other
 * rows.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* VL: floats in a vector, the machine's own width (AVX-512: 16; else 8, AVX2's). A generic
 * vector wider than the registers was lowered through memory: on an AVX2 EPYC, 7-10 GFLOP/s
 * at any number of rows, against 50-75 with VL 8. A row's sums are in the order VL fixes,
 * the same on every call of one build. */
#if defined(__AVX512F__)
#define VL 16
#define JB 4
#else
#define VL 8
#define JB 3 /* JB 4's 16 accumulators fill AVX2's 16 registers: 16 rows of a 1536 x 576
                product took 529 us with JB 4, 397 with JB 3, on that EPYC */
#endif
#define IB 4
#define PANEL 128

typedef float vf __attribute__((vector_size(VL * sizeof(float))));

static inline vf load(const float *p) {
    vf r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline float hsum(vf a) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += a[i];
    return s;
}

static inline float as_is(float v) { return v; }

/* rows [i0, i0 + MI) x features [j0, j0 + JB), as NAME##MI, over weights of type WT: VL of
 * them a vector by WLOAD, one by WVAL (float32's: `load`, `as_is`) */
#define BLOCK_OF(NAME, MI, WT, WLOAD, WVAL)                                                 \
    static inline void NAME##MI(const float *x, const WT *w, const float *b, float *y,      \
                                int64_t n, int64_t k, int64_t i0, int64_t j0) {             \
        vf acc[MI][JB];                                                                     \
        memset(acc, 0, sizeof acc);                                                         \
        const int64_t kv = k - k % VL;                                                      \
        for (int64_t kk = 0; kk < kv; kk += VL) {                                           \
            vf wv[JB], xv[MI];                                                              \
            for (int j = 0; j < JB; j++) wv[j] = WLOAD(w + (j0 + j) * k + kk);              \
            for (int i = 0; i < MI; i++) xv[i] = load(x + (i0 + i) * k + kk);               \
            for (int i = 0; i < MI; i++)                                                    \
                for (int j = 0; j < JB; j++) acc[i][j] += xv[i] * wv[j];                    \
        }                                                                                   \
        for (int i = 0; i < MI; i++)                                                        \
            for (int j = 0; j < JB; j++) {                                                  \
                float s = hsum(acc[i][j]);                                                  \
                const float *xr = x + (i0 + i) * k;                                         \
                const WT *wr = w + (j0 + j) * k;                                            \
                for (int64_t kk = kv; kk < k; kk++) s += xr[kk] * WVAL(wr[kk]);             \
                y[(i0 + i) * n + j0 + j] = b ? s + b[j0 + j] : s;                           \
            }                                                                               \
    }
#define BLOCK(MI) BLOCK_OF(block, MI, float, load, as_is)
BLOCK(1)
BLOCK(2)
BLOCK(3)
BLOCK(4)

/* every block of JB features, in parallel, for each panel of PANEL rows (a panel of x stays
 * in L2 while every weight block passes): BLK##4 over the panel's row blocks of IB, then
 * BLK##3, 2 or 1 over its rest; the block functions take (ARGS..., n, k, i0, j0) */
#define PANELS(BLK, ...)                                                                    \
    for (int64_t p0 = 0; p0 < m; p0 += PANEL) {                                             \
        const int64_t p1 = p0 + PANEL < m ? p0 + PANEL : m;                                 \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                  \
        for (int64_t jb = 0; jb < blocks; jb++) {                                           \
            const int64_t j0 = jb * JB;                                                     \
            int64_t i0 = p0;                                                                \
            for (; i0 + IB <= p1; i0 += IB) BLK##4(__VA_ARGS__, n, k, i0, j0);              \
            switch (p1 - i0) {                                                              \
            case 3: BLK##3(__VA_ARGS__, n, k, i0, j0); break;                               \
            case 2: BLK##2(__VA_ARGS__, n, k, i0, j0); break;                               \
            case 1: BLK##1(__VA_ARGS__, n, k, i0, j0); break;                               \
            default: break;                                                                 \
            }                                                                               \
        }                                                                                   \
    }

/* features [j0, j0 + nj), nj < JB: one feature at a time */
static void tail(const float *x, const float *w, const float *b, float *y, int64_t m,
                 int64_t n, int64_t k, int64_t j0, int64_t nj) {
    const int64_t kv = k - k % VL;
    for (int64_t j = j0; j < j0 + nj; j++)
        for (int64_t i = 0; i < m; i++) {
            vf acc;
            memset(&acc, 0, sizeof acc);
            for (int64_t kk = 0; kk < kv; kk += VL) acc += load(x + i * k + kk) * load(w + j * k + kk);
            float s = hsum(acc);
            for (int64_t kk = kv; kk < k; kk++) s += x[i * k + kk] * w[j * k + kk];
            y[i * n + j] = b ? s + b[j] : s;
        }
}

void vc_linear_f32(const float *x, const float *w, const float *b, float *y, int64_t m,
                   int64_t n, int64_t k, int64_t threads) {
    const int64_t blocks = n / JB;
    PANELS(block, x, w, b, y)
    if (n % JB) tail(x, w, b, y, m, n, k, blocks * JB, n % JB);
}

/* y = x w^T (+ b) with bfloat16 weights w [n, k] (a drafter's copy, `Runner.draft_weights`):
 * the same blocks, threads and panels as `vc_linear_f32`, with half the weight bytes to read.
 * With AVX512-BF16 (`vdpbf16ps`: 32 bfloat16 products a vector, summed in pairs into float32)
 * x is split into two bfloat16 parts, hi = x rounded (to nearest, ties to even) and lo = x -
 * hi rounded, and each weight vector meets both: x keeps 16 of its 24 bits, so the weights'
 * rounding is what the drafts see. Without AVX512-BF16 each weight is widened (exactly) and
 * multiplied by x's float32 value. The drafts these passes make are verified over the full KV
 * in float32, so their rounding changes which drafts are accepted, never the output. A row's
 * sums are in an order fixed by k and the build, as `vc_linear_f32`'s. On a 2-vCPU Zen 4
 * EPYC, one SmolLM2 layer's products times 30 plus its LM head: 4.2 / 8.9 / 31.6 ms at 1 / 4 /
 * 16 rows, against 7.7 / 13.1 / 37.5 for `vc_linear_f32`; x rounded whole (one part) took
 * 4.0 / 6.6 / 16.7, and with the query rounding of `attend.c`'s drafter keys it cost τ:
 * pooled 16.0 -> 14.2 over 16 shared-document prompts at snapkv 4x, k = 32, each rounding
 * alone 15.5-16.5 (`benchmarks/tau_probe.py`; /tmp probes). */
static inline float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define KB 32 /* bfloat16 pairs' products a vdpbf16ps sums: k in steps of 32 */

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* x's hi parts at x, its lo parts at x + lo (both [m, k]) */
#define BLOCK_BF(MI)                                                                        \
    static inline void bblock##MI(const uint16_t *x, int64_t lo, const uint16_t *w,         \
                                  const float *b, float *y, int64_t n, int64_t k, int64_t i0, \
                                  int64_t j0) {                                             \
        __m512 acc[MI][JB];                                                                 \
        for (int i = 0; i < MI; i++)                                                        \
            for (int j = 0; j < JB; j++) acc[i][j] = _mm512_setzero_ps();                   \
        const int64_t kv = k - k % KB;                                                      \
        for (int64_t kk = 0; kk < kv; kk += KB) {                                           \
            __m512i wv[JB], xh[MI], xl[MI];                                                 \
            for (int j = 0; j < JB; j++) wv[j] = _mm512_loadu_si512(w + (j0 + j) * k + kk); \
            for (int i = 0; i < MI; i++) {                                                  \
                xh[i] = _mm512_loadu_si512(x + (i0 + i) * k + kk);                          \
                xl[i] = _mm512_loadu_si512(x + lo + (i0 + i) * k + kk);                     \
            }                                                                               \
            for (int i = 0; i < MI; i++)                                                    \
                for (int j = 0; j < JB; j++) {                                              \
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xh[i], (__m512bh)wv[j]); \
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xl[i], (__m512bh)wv[j]); \
                }                                                                           \
        }                                                                                   \
        for (int i = 0; i < MI; i++)                                                        \
            for (int j = 0; j < JB; j++) {                                                  \
                float s = _mm512_reduce_add_ps(acc[i][j]);                                  \
                const uint16_t *xr = x + (i0 + i) * k, *wr = w + (j0 + j) * k;              \
                for (int64_t kk = kv; kk < k; kk++)                                         \
                    s += (bf16_value(xr[kk]) + bf16_value(xr[lo + kk])) * bf16_value(wr[kk]); \
                y[(i0 + i) * n + j0 + j] = b ? s + b[j0 + j] : s;                           \
            }                                                                               \
    }
/* the blocks' x: its hi and lo parts; x[i]'s value as they sum it */
#define BF_X xs, lo
#define X_AT(i) (bf16_value(xs[i]) + bf16_value(xs[lo + (i)]))
#define BF_DOT 1
#else
typedef uint16_t vh __attribute__((vector_size(VL * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(VL * sizeof(uint32_t))));

/* VL weights at p, widened */
static inline vf load_bf16(const uint16_t *p) {
    vh x;
    memcpy(&x, p, sizeof x);
    const vu u = __builtin_convertvector(x, vu) << 16;
    vf r;
    memcpy(&r, &u, sizeof r);
    return r;
}

#define BLOCK_BF(MI) BLOCK_OF(bblock, MI, uint16_t, load_bf16, bf16_value)
#define BF_X xf
#define X_AT(i) xf[i]
#define BF_DOT 0
#endif
BLOCK_BF(1)
BLOCK_BF(2)
BLOCK_BF(3)
BLOCK_BF(4)

int vc_linear_bf16w(const float *xf, const uint16_t *w, const float *b, float *y, int64_t m,
                    int64_t n, int64_t k, int64_t threads) {
#if BF_DOT
    const int64_t lo = m * k;
    uint16_t *xs = malloc(sizeof(uint16_t) * (size_t)(2 * lo));
    if (!xs) return -1;
    for (int64_t i = 0; i < lo; i++) {
        xs[i] = bf16_round(xf[i]);
        xs[lo + i] = bf16_round(xf[i] - bf16_value(xs[i]));
    }
#endif
    const int64_t blocks = n / JB;
    PANELS(bblock, BF_X, w, b, y)
    for (int64_t j = blocks * JB; j < n; j++)
        for (int64_t i = 0; i < m; i++) {
            float s = 0.0f;
            for (int64_t kk = 0; kk < k; kk++) s += X_AT(i * k + kk) * bf16_value(w[j * k + kk]);
            y[i * n + j] = b ? s + b[j] : s;
        }
#if BF_DOT
    free(xs);
#endif
    return 0;
}

int vc_bf16_dot(void) { return BF_DOT; }

/* y = x w^T (+ b) over weights held in blocks of QB along k (weights that were quantized
 * before they reached float32, as a GGUF model's are: `vericache.model.qweights`, read by
 * every pass of at most `runner.BLOCK_ROWS` rows): element i of row j is d[j, i / QB] * q + m[j, i / QB], q the
 * block's integer (bits 4: 0..15, two a byte, byte c of a block holding elements c and
 * c + QB / 2 in its low and high nibbles; bits 8: -128..127, one a byte) and m NULL for 0. The
 * Python side keeps this form only where it gives every float32 weight back bit for bit (d * q
 * is exact in float32, so the sum rounds once, as the dequantizer's did), so these products
 * multiply x by the model's own weights, reading 5 (bits 4) or 9 (bits 8) bits a weight
 * (d and m float32) instead of 32, or bfloat16's 16. k a multiple of QB; the same blocks,
 * threads and panels as `vc_linear_f32`, and the same sums: each weight widened exactly, the
 * products added in the same order (VL-wide vectors along k, their lanes in order), so a
 * product over the blocks gives `vc_linear_f32`'s bits over the float32 matrix (tests:
 * test_kernels.py), and the runner may take either for any call. */
#define QB 32
struct vc_qw {
    const uint8_t *q;
    const float *d, *m; /* [n, k / QB]; m NULL: 0 */
    int64_t bits;       /* 4 or 8 */
};

/* the QB weights of row j's block kb, widened into w */
static inline void q_block(const struct vc_qw *w, int64_t k, int64_t j, int64_t kb, float *out) {
    const int64_t nb = k / QB;
    const float d = w->d[j * nb + kb], m = w->m ? w->m[j * nb + kb] : 0.0f;
    if (w->bits == 4) {
        const uint8_t *q = w->q + (j * nb + kb) * (QB / 2);
        for (int c = 0; c < QB / 2; c++) {
            out[c] = d * (float)(q[c] & 15) + m;
            out[c + QB / 2] = d * (float)(q[c] >> 4) + m;
        }
    } else {
        const int8_t *q = (const int8_t *)w->q + (j * nb + kb) * QB;
        for (int c = 0; c < QB; c++) out[c] = d * (float)q[c] + m;
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* the QB weights of row j's block kb as two vectors (elements 0..15, 16..31) */
static inline void q_vectors(const struct vc_qw *w, int64_t k, int64_t j, int64_t kb,
                             __m512 *w0, __m512 *w1) {
    const int64_t nb = k / QB, at = j * nb + kb;
    const __m512 d = _mm512_set1_ps(w->d[at]), m = _mm512_set1_ps(w->m ? w->m[at] : 0.0f);
    __m512i q0, q1;
    if (w->bits == 4) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w->q + at * (QB / 2))));
        q0 = _mm512_and_si512(b, _mm512_set1_epi32(15));
        q1 = _mm512_srli_epi32(b, 4);
    } else {
        const int8_t *q = (const int8_t *)w->q + at * QB;
        q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
        q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
    }
    /* d * q is exact, so the fused form rounds once, as d * q + m does */
    *w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q0), m);
    *w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q1), m);
}

#define QBLOCK(MI)                                                                          \
    static inline void qblock##MI(const float *x, const struct vc_qw *w, const float *b,    \
                                  float *y, int64_t n, int64_t k, int64_t i0, int64_t j0) { \
        __m512 acc[MI][JB];                                                                 \
        for (int i = 0; i < MI; i++)                                                        \
            for (int j = 0; j < JB; j++) acc[i][j] = _mm512_setzero_ps();                   \
        for (int64_t kb = 0; kb < k / QB; kb++) {                                           \
            __m512 w0[JB], w1[JB];                                                          \
            for (int j = 0; j < JB; j++) q_vectors(w, k, j0 + j, kb, w0 + j, w1 + j);       \
            for (int i = 0; i < MI; i++) {                                                  \
                const __m512 x0 = _mm512_loadu_ps(x + (i0 + i) * k + kb * QB);              \
                const __m512 x1 = _mm512_loadu_ps(x + (i0 + i) * k + kb * QB + 16);         \
                for (int j = 0; j < JB; j++) {                                              \
                    acc[i][j] = _mm512_fmadd_ps(x0, w0[j], acc[i][j]);                      \
                    acc[i][j] = _mm512_fmadd_ps(x1, w1[j], acc[i][j]);                      \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < MI; i++)                                                        \
            for (int j = 0; j < JB; j++) {                                                  \
                vf a;                                                                       \
                memcpy(&a, &acc[i][j], sizeof a);                                           \
                const float s = hsum(a);                                                    \
                y[(i0 + i) * n + j0 + j] = b ? s + b[j0 + j] : s;                           \
            }                                                                               \
    }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* the VL (8) weights [c, c + VL) of row j's block kb, c a multiple of VL, in a vector: the
 * values `q_block` writes, formed in registers (d * q is exact, so the fused form rounds
 * once, as d * q + m does). Through q_block's buffer, a scalar store a weight, a draft step
 * of the default model (batch 1, 2300 keys) took 90.7 ms on a 2-vCPU AVX2 EPYC (Zen 3). */
static inline __attribute__((always_inline)) vf q_vec(const struct vc_qw *w, int64_t k,
                                                      int64_t j, int64_t kb, int c,
                                                      const int bits) {
    const int64_t at = j * (k / QB) + kb;
    __m256i q;
    if (bits == 4) {
        const uint8_t *bytes = w->q + at * (QB / 2) + c % (QB / 2);
        q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
        q = c < QB / 2 ? _mm256_and_si256(q, _mm256_set1_epi32(15)) : _mm256_srli_epi32(q, 4);
    } else {
        q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w->q + at * QB + c)));
    }
    const __m256 r = _mm256_fmadd_ps(_mm256_set1_ps(w->d[at]), _mm256_cvtepi32_ps(q),
                                     _mm256_set1_ps(w->m ? w->m[at] : 0.0f));
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* rows [i0, i0 + MI) x features [j0, j0 + NJ) (MI <= 4, NJ <= JB, constants where inlined,
 * so the accumulators stay in registers), in `vc_linear_f32`'s order: per block, its VL-wide
 * vectors c = 0, 8, 16, 24 in turn */
static inline __attribute__((always_inline)) void
q_tile(const float *x, const struct vc_qw *w, const float *b, float *y, int64_t n, int64_t k,
       int64_t i0, int64_t j0, const int MI, const int NJ, const int bits) {
    vf acc[4][JB];
    for (int i = 0; i < MI; i++)
        for (int j = 0; j < NJ; j++) acc[i][j] = (vf){};
    for (int64_t kb = 0; kb < k / QB; kb++)
        for (int c = 0; c < QB; c += VL) {
            vf wv[JB];
            for (int j = 0; j < NJ; j++) wv[j] = q_vec(w, k, j0 + j, kb, c, bits);
            for (int i = 0; i < MI; i++) {
                const vf xv = load(x + (i0 + i) * k + kb * QB + c);
                for (int j = 0; j < NJ; j++) acc[i][j] += xv * wv[j];
            }
        }
    for (int i = 0; i < MI; i++)
        for (int j = 0; j < NJ; j++) {
            const float s = hsum(acc[i][j]);
            y[(i0 + i) * n + j0 + j] = b ? s + b[j0 + j] : s;
        }
}

/* more than 2 rows: the block's features as 2 + 1, so that the accumulators, the weights'
 * vectors and their temporaries fit AVX2's 16 registers (JB 3 x 4 rows spilled: 4 rows
 * cost what two 2-row calls did) */
#define QBLOCK_AS(MI, BITS)                                                                 \
    if (MI <= 2)                                                                            \
        q_tile(x, w, b, y, n, k, i0, j0, MI, JB, BITS);                                     \
    else {                                                                                  \
        q_tile(x, w, b, y, n, k, i0, j0, MI, 2, BITS);                                      \
        q_tile(x, w, b, y, n, k, i0, j0 + 2, MI, 1, BITS);                                  \
    }
#define QBLOCK(MI)                                                                          \
    static inline void qblock##MI(const float *x, const struct vc_qw *w, const float *b,    \
                                  float *y, int64_t n, int64_t k, int64_t i0, int64_t j0) { \
        if (w->bits == 4) {                                                                 \
            QBLOCK_AS(MI, 4)                                                                \
        } else {                                                                            \
            QBLOCK_AS(MI, 8)                                                                \
        }                                                                                   \
    }
#else
#define QBLOCK(MI)                                                                          \
    static inline void qblock##MI(const float *x, const struct vc_qw *w, const float *b,    \
                                  float *y, int64_t n, int64_t k, int64_t i0, int64_t j0) { \
        vf acc[MI][JB];                                                                     \
        memset(acc, 0, sizeof acc);                                                         \
        float wb[JB][QB] __attribute__((aligned(64)));                                      \
        for (int64_t kb = 0; kb < k / QB; kb++) {                                           \
            for (int j = 0; j < JB; j++) q_block(w, k, j0 + j, kb, wb[j]);                  \
            for (int c = 0; c < QB; c += VL) {                                              \
                vf wv[JB], xv[MI];                                                          \
                for (int j = 0; j < JB; j++) wv[j] = load(wb[j] + c);                       \
                for (int i = 0; i < MI; i++) xv[i] = load(x + (i0 + i) * k + kb * QB + c);  \
                for (int i = 0; i < MI; i++)                                                \
                    for (int j = 0; j < JB; j++) acc[i][j] += xv[i] * wv[j];                \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < MI; i++)                                                        \
            for (int j = 0; j < JB; j++) {                                                  \
                const float s = hsum(acc[i][j]);                                            \
                y[(i0 + i) * n + j0 + j] = b ? s + b[j0 + j] : s;                           \
            }                                                                               \
    }
#endif
QBLOCK(1)
QBLOCK(2)
QBLOCK(3)
QBLOCK(4)

/* one row xr's product with feature j over the blocks (the features past the last JB, and
 * `vc_linear_qw_refine`'s entries): `vc_linear_f32`'s order, a block widened at a time */
static float q_dot(const float *xr, const struct vc_qw *w, int64_t k, int64_t j) {
    vf acc;
    memset(&acc, 0, sizeof acc);
    float wb[QB] __attribute__((aligned(64)));
    for (int64_t kb = 0; kb < k / QB; kb++) {
        q_block(w, k, j, kb, wb);
        for (int c = 0; c < QB; c += VL) acc += load(xr + kb * QB + c) * load(wb + c);
    }
    return hsum(acc);
}

int vc_linear_qw(const float *x, const struct vc_qw *w, const float *b, float *y, int64_t m,
                 int64_t n, int64_t k, int64_t threads) {
    if (k % QB || (w->bits != 4 && w->bits != 8)) return -2;
    const int64_t blocks = n / JB;
    PANELS(qblock, x, w, b, y)
    for (int64_t j = blocks * JB; j < n; j++)
        for (int64_t i = 0; i < m; i++) {
            const float s = q_dot(x + i * k, w, k, j);
            y[i * n + j] = b ? s + b[j] : s;
        }
    return 0;
}

/* y ~ x w^T (+ b) over block weights, for a drafter's LM head: x's rows quantized to int8 per
 * block of QB (scale amax / 127, to nearest: llama.cpp's Q8 activations), each block's
 * integer dot product with the weights' q (`q8x_dot`: VNNI's vpdpbusd, unsigned bytes, q
 * itself or, 8 bits, q + 128, times x's signed ones, 32 products a block into int32; AVX2's
 * vpmaddubsw and vpmaddwd, the same integers), scaled by d and x's scale. 4 bits: q is
 * centred on 8 (the integer sum less 8 sum(xq), exact) and m + 8 d times the block's float32
 * sum of x added, so x's rounding meets q - 8, not q (the weights' offset m is about -8 d:
 * against q, x's rounding errors came back about four times as large, 2.7% of the product
 * against 0.6% over the default model's layers). 8 bits: 128 sum(xq) taken off, exact (VNNI;
 * AVX2 multiplies q itself). The weights are the model's own; only x is rounded, as llama.cpp
 * computes such a product (`vericache.model.kernels.Linear.draft_head` then computes each
 * row's largest logits again exactly: rounded logits alone cost τ). A row's blocks and lanes
 * add in an order fixed by k. Reads what `vc_linear_qw` reads, with about
 * a third of its vector work a weight (it forms each float32 weight, d * q + m, to keep
 * float32's bits). Without AVX512-VNNI or AVX2 it is `vc_linear_qw` (`vc_q8x` says which).
 * The draft head's product, one thread, on a 2-vCPU AVX2 EPYC (Zen 3): 4.5 ms as
 * `vc_linear_qw`. */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVX2__)
#define Q8X 1
#define Q8X_ROWS 4 /* x rows and output features that share a block's loads: 16 accumulators */
#define Q8X_JB 4
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8X_VNNI 1
#else
#define Q8X_VNNI 0
#endif
#define Q8X_CENTRE8 (Q8X_VNNI ? -128 : 0) /* 8 bits: the offset of the bytes q8x_dot takes */

static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* row j's block kb as 32 bytes in x's element order: 4 bits, q (unsigned); 8 bits, VNNI:
 * q ^ 0x80 (unsigned q + 128), AVX2: q (signed) */
static inline __attribute__((always_inline)) __m256i
q8x_weights(const uint8_t *q, int64_t at, const int bits) {
    if (bits == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(q + at * (QB / 2)));
        const __m128i f = _mm_set1_epi8(15);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), f), _mm_and_si128(b, f));
    }
    const __m256i w = _mm256_loadu_si256((const __m256i *)(q + at * QB));
    return Q8X_VNNI ? _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)) : w;
}

/* init + the block's integer dot product of the weights' bytes (`q8x_weights`) with x's, in 8
 * int32 lanes: VNNI's vpdpbusd; AVX2's vpmaddubsw (pairs into int16: 4 bits, at most
 * 2 x 15 x 127; 8 bits, |q| times x with q's sign, at most 2 x 128 x 127, so neither
 * saturates) then vpmaddwd. Both give the exact integer sums. */
static inline __attribute__((always_inline)) __m256i
q8x_dot(__m256i init, __m256i wq, __m256i xv, const int bits) {
#if Q8X_VNNI
    (void)bits;
    return _mm256_dpbusd_epi32(init, wq, xv);
#else
    const __m256i p = bits == 4 ? _mm256_maddubs_epi16(wq, xv)
                                : _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq),
                                                       _mm256_sign_epi8(xv, wq));
    return _mm256_add_epi32(init, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

/* init + a block's integer dot product of the weights' bytes with x's: x's bytes xv (parts 1),
 * or 256 x its first part's (xv) + its second's (xv2) (parts 2), exact in int32 */
static inline __attribute__((always_inline)) __m256i
q8x_parts_dot(__m256i init, __m256i wq, __m256i xv, __m256i xv2, const int bits,
              const int parts) {
    if (parts == 1) return q8x_dot(init, wq, xv, bits);
    const __m256i hi = _mm256_slli_epi32(q8x_dot(_mm256_setzero_si256(), wq, xv, bits), 8);
    return q8x_dot(_mm256_add_epi32(hi, init), wq, xv2, bits);
}

/* features [j0, j0 + nj) x rows [i0, i0 + rows), nj <= Q8X_JB, rows <= Q8X_ROWS: constants
 * where it is inlined, so that the accumulators stay in registers */
static inline __attribute__((always_inline)) void
q8x_tile(const struct vc_qw *w, const int8_t *xq, const int8_t *xq2, const float *xs,
         const float *xsum, const int32_t *xqs, const float *b, float *y, int64_t n, int64_t nb, int64_t j0,
         const int nj, int64_t i0, const int rows, const int bits, const int parts) {
    __m256 acc[Q8X_ROWS][Q8X_JB];
    float off[Q8X_ROWS][Q8X_JB];
    for (int r = 0; r < Q8X_ROWS; r++)
        for (int jj = 0; jj < Q8X_JB; jj++) {
            acc[r][jj] = _mm256_setzero_ps();
            off[r][jj] = 0.0f;
        }
    const int32_t centre = bits == 4 ? -8 : Q8X_CENTRE8;
    for (int64_t kb = 0; kb < nb; kb++) {
        __m256i wq[Q8X_JB];
        float d[Q8X_JB], mc[Q8X_JB];
        for (int jj = 0; jj < nj; jj++) {
            const int64_t at = (j0 + jj) * nb + kb;
            wq[jj] = q8x_weights(w->q, at, bits);
            d[jj] = w->d[at];
            mc[jj] = bits == 4 ? (w->m ? w->m[at] : 0.0f) + 8.0f * d[jj] : 0.0f;
        }
        for (int r = 0; r < rows; r++) {
            const int64_t at = (i0 + r) * nb + kb;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + at * QB));
            const __m256i init = _mm256_setr_epi32(centre * xqs[at], 0, 0, 0, 0, 0, 0, 0);
            const float sx = xs[at], sum = xsum[at];
            /* parts 2: x's second byte, the first's rounding error in 256ths */
            const __m256i xv2 = parts == 2 ? _mm256_loadu_si256((const __m256i *)(xq2 + at * QB)) : xv;
            for (int jj = 0; jj < nj; jj++) {
                const __m256i dot = q8x_parts_dot(init, wq[jj], xv, xv2, bits, parts);
                acc[r][jj] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[jj] * sx),
                                             acc[r][jj]);
                /* fmaf: one rounding in every tile's copy (a contraction the compiler
                   chose per copy gave a row other bits among others than alone) */
                if (bits == 4) off[r][jj] = fmaf(mc[jj], sum, off[r][jj]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int jj = 0; jj < nj; jj++) {
            const float s = hsum8(acc[r][jj]) + off[r][jj];
            y[(i0 + r) * n + j0 + jj] = b ? s + b[j0 + jj] : s;
        }
}

/* q8x_tile with nj, rows, bits and parts as constants (nj: Q8X_JB, or 1 feature at a time) */
#define Q8X_ROWS_OF(NJ, J0, BITS)                                                           \
    switch (rows) {                                                                         \
    case 4: q8x_tile(w, xq, xq2, xs, xsum, xqs, b, y, n, nb, J0, NJ, i0, 4, BITS, parts); break; \
    case 3: q8x_tile(w, xq, xq2, xs, xsum, xqs, b, y, n, nb, J0, NJ, i0, 3, BITS, parts); break; \
    case 2: q8x_tile(w, xq, xq2, xs, xsum, xqs, b, y, n, nb, J0, NJ, i0, 2, BITS, parts); break; \
    default: q8x_tile(w, xq, xq2, xs, xsum, xqs, b, y, n, nb, J0, NJ, i0, 1, BITS, parts); break; \
    }
#define Q8X_TILES(BITS)                                                                     \
    {                                                                                       \
        if (nj == Q8X_JB && BITS == 4) { /* 8 bits: one feature at a time, 2.5x faster */ \
            Q8X_ROWS_OF(Q8X_JB, j0, BITS)                                                   \
        } else                                                                              \
            for (int64_t j = j0; j < j0 + nj; j++) {                                        \
                Q8X_ROWS_OF(1, j, BITS)                                                     \
            }                                                                               \
    }

#if Q8X_VNNI && defined(__AVX512BW__)
/* 4-bit blocks four at a time in 512-bit vectors (AVX512-VNNI): 64 bytes of q (blocks kb ..
 * kb + 3) give their low nibbles in one vector and their high nibbles in another, each block's
 * 16 in 4 int32 lanes of vpdpbusd, so x's bytes of such a group are laid out to match (`q4z_x`:
 * the four blocks' elements 0..15, then their 16..31) and each lane's integer sum is one
 * block's. A block's sum is scaled in its lanes (d x's scale, 4 lanes a block), the offset
 * (m + 8 d) times its float32 sum of x in 4 lanes of its own. The blocks past the last group
 * of four: `q8x_tile`'s way, a block at a time. */
#define Q4Z 1
#define Q4Z_ROWS 2 /* rows x Q8X_JB features: 8 accumulators and 8 offsets in registers */

/* row i's bytes xq (parts 2: and xq2) of the groups of four blocks, in place, into q4z's
 * order; init [groups, 16]: each block's -8 x sum(xq) in its first lane */
static void q4z_x(int8_t *xq, int8_t *xq2, const int32_t *xqs, int32_t *init, int64_t groups) {
    for (int64_t g = 0; g < groups; g++) {
        for (int part = 0; part < 2; part++) {
            int8_t *p = part ? xq2 : xq;
            if (!p) continue;
            int8_t tmp[128];
            memcpy(tmp, p + g * 128, 128);
            for (int b = 0; b < 4; b++) {
                memcpy(p + g * 128 + 16 * b, tmp + 32 * b, 16);
                memcpy(p + g * 128 + 64 + 16 * b, tmp + 32 * b + 16, 16);
            }
        }
        for (int b = 0; b < 4; b++) {
            init[g * 16 + 4 * b] = -8 * xqs[4 * g + b];
            init[g * 16 + 4 * b + 1] = init[g * 16 + 4 * b + 2] = init[g * 16 + 4 * b + 3] = 0;
        }
    }
}

static inline __attribute__((always_inline)) void
q4z_tile(const struct vc_qw *w, const int8_t *xq, const int8_t *xq2, const float *xs,
         const float *xsum, const int32_t *xqs, const int32_t *init, const float *b, float *y,
         int64_t n, int64_t nb, int64_t k, int64_t j0, const int nj, int64_t i0, const int rows,
         const int parts) {
    const int64_t groups = nb / 4;
    __m512 acc[Q4Z_ROWS][Q8X_JB];
    __m128 off[Q4Z_ROWS][Q8X_JB];
    for (int r = 0; r < Q4Z_ROWS; r++)
        for (int jj = 0; jj < Q8X_JB; jj++) {
            acc[r][jj] = _mm512_setzero_ps();
            off[r][jj] = _mm_setzero_ps();
        }
    const __m512i nib = _mm512_set1_epi8(15);
    const __m512i four = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t g = 0; g < groups; g++) {
        __m512i lo[Q8X_JB], hi[Q8X_JB];
        __m128 d[Q8X_JB], mc[Q8X_JB];
        for (int jj = 0; jj < nj; jj++) {
            const int64_t at = (j0 + jj) * nb + 4 * g;
            const __m512i z = _mm512_loadu_si512((const void *)(w->q + at * (QB / 2)));
            lo[jj] = _mm512_and_si512(z, nib);
            hi[jj] = _mm512_and_si512(_mm512_srli_epi16(z, 4), nib);
            d[jj] = _mm_loadu_ps(w->d + at);
            mc[jj] = _mm_fmadd_ps(_mm_set1_ps(8.0f), d[jj],
                                  w->m ? _mm_loadu_ps(w->m + at) : _mm_setzero_ps());
        }
        for (int r = 0; r < rows; r++) {
            const int64_t row = i0 + r, xa = row * k + g * 128, sa = row * nb + 4 * g;
            const __m512i xl = _mm512_loadu_si512((const void *)(xq + xa));
            const __m512i xh = _mm512_loadu_si512((const void *)(xq + xa + 64));
            const __m512i in = _mm512_loadu_si512((const void *)(init + (row * groups + g) * 16));
            const __m128 sx = _mm_loadu_ps(xs + sa), sum = _mm_loadu_ps(xsum + sa);
            __m512i xl2 = xl, xh2 = xh;
            if (parts == 2) {
                xl2 = _mm512_loadu_si512((const void *)(xq2 + xa));
                xh2 = _mm512_loadu_si512((const void *)(xq2 + xa + 64));
            }
            for (int jj = 0; jj < nj; jj++) {
                __m512i t;
                if (parts == 2) {
                    t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[jj], xl);
                    t = _mm512_dpbusd_epi32(t, hi[jj], xh);
                    t = _mm512_add_epi32(_mm512_slli_epi32(t, 8), in);
                    t = _mm512_dpbusd_epi32(t, lo[jj], xl2);
                    t = _mm512_dpbusd_epi32(t, hi[jj], xh2);
                } else {
                    t = _mm512_dpbusd_epi32(in, lo[jj], xl);
                    t = _mm512_dpbusd_epi32(t, hi[jj], xh);
                }
                const __m512 scale =
                    _mm512_permutexvar_ps(four, _mm512_castps128_ps512(_mm_mul_ps(d[jj], sx)));
                acc[r][jj] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, acc[r][jj]);
                off[r][jj] = _mm_fmadd_ps(mc[jj], sum, off[r][jj]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int jj = 0; jj < nj; jj++) {
            /* the blocks past the groups: a block at a time (`q8x_tile`'s form) */
            float tail = 0.0f;
            const int64_t row = i0 + r;
            for (int64_t kb = 4 * groups; kb < nb; kb++) {
                const int64_t at = (j0 + jj) * nb + kb, xa = row * nb + kb;
                const __m256i wq = q8x_weights(w->q, at, 4);
                const __m256i in = _mm256_setr_epi32(-8 * xqs[xa], 0, 0, 0, 0, 0, 0, 0);
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + xa * QB));
                const __m256i xv2 =
                    parts == 2 ? _mm256_loadu_si256((const __m256i *)(xq2 + xa * QB)) : xv;
                const __m256i t = q8x_parts_dot(in, wq, xv, xv2, 4, parts);
                const float dd = w->d[at], mm = w->m ? w->m[at] : 0.0f;
                tail = fmaf(hsum8(_mm256_cvtepi32_ps(t)), dd * xs[xa],
                            fmaf(fmaf(8.0f, dd, mm), xsum[xa], tail));
            }
            __m128 o = off[r][jj];
            o = _mm_add_ps(o, _mm_movehl_ps(o, o));
            o = _mm_add_ss(o, _mm_movehdup_ps(o));
            const float s = _mm512_reduce_add_ps(acc[r][jj]) + _mm_cvtss_f32(o) + tail;
            y[(i0 + r) * n + j0 + jj] = b ? s + b[j0 + jj] : s;
        }
}
#else
#define Q4Z 0
#endif

/* `vc_linear_qw_q8x` (parts 1) and `vc_linear_qw_q8x2` (parts 2): x's blocks rounded, the
 * products tiled */
static inline __attribute__((always_inline)) int
q8x_product(const float *x, const struct vc_qw *w, const float *b, float *y, int64_t m,
            int64_t n, int64_t k, int64_t threads, const int parts) {
    if (k % QB || (w->bits != 4 && w->bits != 8)) return -2;
    const int64_t nb = k / QB;
    int8_t *xq = malloc((size_t)(parts * m * k));
    float *xs = malloc(sizeof(float) * (size_t)(2 * m * nb)); /* scale, then float32 sum */
    int32_t *xqs = malloc(sizeof(int32_t) * (size_t)(m * nb)); /* sum(xq) (parts 2: 256 x the
                                                                  first's + the second's) */
    if (!xq || !xs || !xqs) {
        free(xq);
        free(xs);
        free(xqs);
        return -1;
    }
    int8_t *xq2 = parts == 2 ? xq + m * k : NULL;
    float *xsum = xs + m * nb;
    for (int64_t i = 0; i < m * nb; i++) {
        const float *v = x + i * QB;
        float amax = 0.0f, sum = 0.0f;
        int32_t qs = 0, qs2 = 0;
#if defined(__AVX512F__)
        /* the same values as the loop below (its sums in another order), in vectors */
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        sum = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512 t0 = _mm512_mul_ps(v0, inv), t1 = _mm512_mul_ps(v1, inv);
        const __m512i q0 = _mm512_cvtps_epi32(t0), q1 = _mm512_cvtps_epi32(t1);
        _mm_storeu_si128((__m128i *)(xq + i * QB), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + i * QB + 16), _mm512_cvtsepi32_epi8(q1));
        qs = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        if (parts == 2) {
            const __m512 k256 = _mm512_set1_ps(256.0f);
            __m512i r0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t0, _mm512_cvtepi32_ps(q0)), k256));
            __m512i r1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t1, _mm512_cvtepi32_ps(q1)), k256));
            const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
            r0 = _mm512_max_epi32(_mm512_min_epi32(r0, hi), lo);
            r1 = _mm512_max_epi32(_mm512_min_epi32(r1, hi), lo);
            _mm_storeu_si128((__m128i *)(xq2 + i * QB), _mm512_cvtepi32_epi8(r0));
            _mm_storeu_si128((__m128i *)(xq2 + i * QB + 16), _mm512_cvtepi32_epi8(r1));
            qs2 = _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
        }
#else
        for (int c = 0; c < QB; c++) {
            const float a = fabsf(v[c]);
            amax = a > amax ? a : amax;
            sum += v[c];
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int c = 0; c < QB; c++) {
            const float t = v[c] * inv;
            const int8_t q = (int8_t)lrintf(t);
            xq[i * QB + c] = q;
            qs += q;
            if (parts == 2) { /* t - q in [-1/2, 1/2]: in 256ths, clipped to a signed byte */
                const long r = lrintf((t - (float)q) * 256.0f);
                const int8_t q2 = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
                xq2[i * QB + c] = q2;
                qs2 += q2;
            }
        }
#endif
        xs[i] = parts == 2 ? amax / 127.0f / 256.0f : amax / 127.0f;
        xsum[i] = sum;
        xqs[i] = parts == 2 ? 256 * qs + qs2 : qs;
    }
    const int64_t tiles = (n + Q8X_JB - 1) / Q8X_JB;
    /* 4-bit blocks four at a time (`q4z_tile`): x's bytes in its order, each block's centring */
    const int64_t groups = Q4Z && w->bits == 4 ? nb / 4 : 0;
    int32_t *init = groups ? malloc(sizeof(int32_t) * (size_t)(m * groups * 16)) : NULL;
    if (groups && !init) {
        free(xq);
        free(xs);
        free(xqs);
        return -1;
    }
#if Q4Z
    for (int64_t i = 0; groups && i < m; i++)
        q4z_x(xq + i * k, xq2 ? xq2 + i * k : NULL, xqs + i * nb, init + i * groups * 16, groups);
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t j0 = t * Q8X_JB;
        const int nj = n - j0 < Q8X_JB ? (int)(n - j0) : Q8X_JB;
#if Q4Z
        if (groups) {
            for (int64_t i0 = 0; i0 < m; i0 += Q4Z_ROWS) {
                const int rows = m - i0 < Q4Z_ROWS ? (int)(m - i0) : Q4Z_ROWS;
#define Q4Z_CALL(NJ, R) q4z_tile(w, xq, xq2, xs, xsum, xqs, init, b, y, n, nb, k, j0, NJ, i0, R, parts)
                if (nj == Q8X_JB) {
                    if (rows == 2) Q4Z_CALL(Q8X_JB, 2); else Q4Z_CALL(Q8X_JB, 1);
                } else {
                    if (rows == 2) Q4Z_CALL(nj, 2); else Q4Z_CALL(nj, 1);
                }
#undef Q4Z_CALL
            }
            continue;
        }
#endif
        for (int64_t i0 = 0; i0 < m; i0 += Q8X_ROWS) {
            const int rows = m - i0 < Q8X_ROWS ? (int)(m - i0) : Q8X_ROWS;
            if (w->bits == 4)
                Q8X_TILES(4)
            else
                Q8X_TILES(8)
        }
    }
    free(init);
    free(xq);
    free(xs);
    free(xqs);
    return 0;
}
#else
#define Q8X 0
#endif

int vc_linear_qw_q8x(const float *x, const struct vc_qw *w, const float *b, float *y, int64_t m,
                     int64_t n, int64_t k, int64_t threads) {
#if Q8X
    return q8x_product(x, w, b, y, m, n, k, threads, 1);
#else
    return vc_linear_qw(x, w, b, y, m, n, k, threads);
#endif
}

/* y ~ x w^T (+ b) over block weights, for a drafter's layers: `vc_linear_qw_q8x` with x in two
 * int8 parts a block (the first x's rounding as there, the second that rounding's error in
 * 256ths of the same scale), each block's two integer dot products combined exactly (256 x
 * the first's + the second's): x within about 1/65000 of its block's largest |x|, against
 * 1/254 for one part (the default model's layers, batch 1: 2e-5 of the product's largest
 * value against 5e-3). One thread of a Zen 4 (AVX512-VNNI, `q4z_tile`), its Q4_1 layer
 * products at batch 1: 0.15-0.18 ms a layer against the exact product's 0.25-0.28
 * (`benchmarks/draft_step.py --products`, thirty-eighth session). Without VNNI
 * (`vc_q8x_vnni` 0) the runner keeps the exact product: AVX2's integer path, the same
 * integers a block at a time, ran a layer's products at 0.84-0.91x the exact product's speed
 * (a Zen 3 build on that Zen 4: `--march znver3`). The exact product where `vc_q8x` is 0. */
int vc_linear_qw_q8x2(const float *x, const struct vc_qw *w, const float *b, float *y,
                      int64_t m, int64_t n, int64_t k, int64_t threads) {
#if Q8X
    return q8x_product(x, w, b, y, m, n, k, threads, 2);
#else
    return vc_linear_qw(x, w, b, y, m, n, k, threads);
#endif
}

int vc_q8x(void) { return Q8X; }

int vc_q8x_vnni(void) {
#if Q8X
    return Q8X_VNNI;
#else
    return 0;
#endif
}

/* y's rows (m x n, from `vc_linear_qw_q8x` over the same x and w) with each row's `top`
 * largest entries computed again exactly (each weight d * q + m, float32 products: the exact
 * product's value, up to its summation order), in place: a greedy draft's argmax is then the
 * exact product's wherever that one is among the rounded product's `top` largest (x's
 * rounding moves a logit by about 0.5% of the row's scale, so a token outside them would have
 * to lose more than that gap). top <= 64. */
int vc_linear_qw_refine(const float *x, const struct vc_qw *w, const float *b, float *y,
                        int64_t m, int64_t n, int64_t k, int64_t top) {
    if (k % QB || (w->bits != 4 && w->bits != 8) || top < 1 || top > 64) return -2;
    for (int64_t i = 0; i < m; i++) {
        float *yr = y + i * n;
        const float *xr = x + i * k;
        int64_t idx[64];
        float val[64];
        int64_t have = 0; /* idx, val: the largest so far, in descending order */
        for (int64_t j = 0; j < n; j++) {
            const float v = yr[j];
            if (have == top && v <= val[top - 1]) continue;
            int64_t at = have < top ? have++ : top - 1;
            while (at > 0 && val[at - 1] < v) {
                val[at] = val[at - 1];
                idx[at] = idx[at - 1];
                at--;
            }
            val[at] = v;
            idx[at] = j;
        }
        for (int64_t c = 0; c < have; c++) {
            const int64_t j = idx[c];
            const float s = q_dot(xr, w, k, j);
            yr[j] = b ? s + b[j] : s;
        }
    }
    return 0;
}

/* y[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w for each of m rows of n (RMSNorm; x, y
 * contiguous): each row's sum in an order fixed by n. */
void vc_rms_f32(const float *x, const float *w, float *y, int64_t m, int64_t n, float eps) {
    const int64_t nv = n - n % VL;
    for (int64_t i = 0; i < m; i++) {
        const float *xr = x + i * n;
        float *yr = y + i * n;
        vf acc;
        memset(&acc, 0, sizeof acc);
        for (int64_t c = 0; c < nv; c += VL) {
            const vf v = load(xr + c);
            acc += v * v;
        }
        float ss = hsum(acc);
        for (int64_t c = nv; c < n; c++) ss += xr[c] * xr[c];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t c = 0; c < n; c++) yr[c] = xr[c] * inv * w[c];
    }
}

/* RMSNorm of each head of x [T, heads, D] in place (token stride st, heads D apart), head h
 * scaled by w[h] (w [heads, D]: Qwen3's and Gemma 3's q/k norms); each head as `vc_rms_f32`
 * does a row. */
void vc_rms_heads_f32(float *x, const float *w, int64_t T, int64_t heads, int64_t D, int64_t st,
                      float eps) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) {
            float *r = x + t * st + h * D;
            vc_rms_f32(r, w + h * D, r, 1, D, eps);
        }
}

/* Rotary embedding in place (the rotate-half form): x [T, heads, D] with token stride st and
 * head stride D; cos, sin [T, R] (R <= D, even; dims past R pass). */
void vc_rope_f32(float *x, int64_t T, int64_t heads, int64_t D, int64_t st, const float *cos,
                 const float *sin, int64_t R) {
    const int64_t half = R / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * R, *s = sin + t * R;
        for (int64_t h = 0; h < heads; h++) {
            float *xr = x + t * st + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = xr[i], b = xr[i + half];
                xr[i] = a * c[i] - b * s[i];
                xr[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* exp(x), elementwise and branch-free, so that loops of it vectorise without -ffast-math
 * (glibc's expf does not): x clamped to [-86, 88.7], x = n ln2 + r with n = rint(x / ln2)
 * (the 1.5 * 2^23 trick) and |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 / 7! (the
 * next term is below 1e-8 relative), times 2^(n - 1) built in the exponent bits, times 2 (so
 * n = 128 stays finite). Within 2 ulp of the exact value on [-86, 88.7]; below, exp(-86)
 * (under float32's epsilon, where `silu` adds it to 1); above, exp(88.7) (the largest below
 * float32's overflow). */
static inline float vexp(float x) {
    x = x < -86.0f ? -86.0f : x;
    x = x > 88.7f ? 88.7f : x;
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln2 in two parts */
    float e = 1.0f / 5040.0f;
    e = e * r + 1.0f / 720.0f;
    e = e * r + 1.0f / 120.0f;
    e = e * r + 1.0f / 24.0f;
    e = e * r + 1.0f / 6.0f;
    e = e * r + 0.5f;
    e = e * r + 1.0f;
    e = e * r + 1.0f;
    const int32_t bits = ((int32_t)n + 126) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return e * scale * 2.0f;
}

/* a[t, i] = silu(gu[t, i]) * gu[t, I + i] for T rows of gu [T, 2I] (the gated MLP's product;
 * silu(g) = g / (1 + exp(-g)), each element by itself). */
void vc_silu_mul_f32(const float *gu, float *a, int64_t T, int64_t I) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *ar = a + t * I;
        for (int64_t i = 0; i < I; i++) ar[i] = g[i] / (1.0f + vexp(-g[i])) * u[i];
    }
}

typedef int (*attend_fn)(const float *q, const void *k, const void *v, int64_t sb, int64_t sh,
                         int64_t sn, const int64_t *lo, const int64_t *hi, float *out, int64_t B,
                         int64_t H, int64_t R, int64_t D, float scale, int64_t threads);

/* One fast pass's decoder layers in one call (`Runner._fused`): the layers of a pre-norm
 * block (RMSNorm, qkv product with optional bias, optional per-head q/k RMSNorm, RoPE,
 * attention over the caches, output product, residual; RMSNorm, gate/up product,
 * silu * up, down product, residual),
 * each step the same function, in the same order, as the runner's layer loop calls one at a
 * time, so a row gets the same bits either way. Row t of the pass is padded row u = pad[t]
 * (u = t without pad): sequence u / lq, query u % lq. Every pointer array has one entry per
 * layer. */
struct vc_pass {
    int64_t T, H, hq, hkv, D, I, R, layers, B, lq, threads;
    float eps, scale;
    float *h;                                              /* [T, H] in and out */
    const float *const *ln_in, *const *w_qkv, *const *b_qkv, *const *w_o, *const *ln_mlp,
        *const *w_gu, *const *w_down; /* b_qkv entries may be NULL; w_* of type w_type */
    const float *const *qk_norm;                           /* [hq + hkv, D] or NULL */
    const float *const *cos, *const *sin;                  /* [T, R] per layer */
    void *const *ck, *const *cv;     /* a layer's caches, slot lo: float32, or bfloat16 */
    int64_t sb, sh, sn;                                    /* their strides (slot, head, key) */
    const int64_t *wslot, *wpos;                           /* [T] where a row's K/V go */
    const int64_t *pad;             /* [T] row t's place in the padded [B lq] rows; NULL: t */
    const int64_t *const *lo, *const *hi;                  /* [B, G lq] per layer */
    attend_fn attend;                /* `attend.c`'s, for the caches' type */
    int64_t kv_bf16;                 /* 1: the caches hold bfloat16 (the drafter's) */
    int64_t w_type; /* w_*: 0 float32; 1 bfloat16 (`vc_linear_bf16w`); 2 struct vc_qw (`vc_linear_qw`);
                       3 struct vc_qw, x in two int8 parts (`vc_linear_qw_q8x2`: a drafter's) */
};

/* a pass's product: its weights' type chooses the kernel; nonzero: out of memory */
static int pass_linear(const struct vc_pass *p, const float *x, const float *w, const float *b,
                       float *y, int64_t m, int64_t n, int64_t k) {
    if (p->w_type == 1) return vc_linear_bf16w(x, (const uint16_t *)w, b, y, m, n, k, p->threads);
    if (p->w_type == 2) return vc_linear_qw(x, (const struct vc_qw *)w, b, y, m, n, k, p->threads);
    if (p->w_type == 3)
        return vc_linear_qw_q8x2(x, (const struct vc_qw *)w, b, y, m, n, k, p->threads);
    vc_linear_f32(x, w, b, y, m, n, k, p->threads);
    return 0;
}

/* a cache row's D elements from float32 `x`: copied, or rounded to bfloat16 (to nearest, ties
 * to even, as torch's conversion: finite values get the bits a `.to(torch.bfloat16)` gives) */
static void kv_put(void *base, int64_t at, const float *x, int64_t D, int64_t bf16) {
    if (!bf16) {
        memcpy((float *)base + at, x, sizeof(float) * (size_t)D);
        return;
    }
    uint16_t *o = (uint16_t *)base + at;
    for (int64_t d = 0; d < D; d++) {
        uint32_t u;
        memcpy(&u, x + d, sizeof u);
        o[d] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* Where query head gi of KV head kh of pass row t sits in the padded queries [B, hkv, g lq,
 * D] the attention reads (and its output in the same layout): a float offset. */
static inline int64_t padded(const struct vc_pass *p, int64_t t, int64_t kh, int64_t gi) {
    const int64_t u = p->pad ? p->pad[t] : t, g = p->hq / p->hkv;
    return ((u / p->lq * p->hkv + kh) * g * p->lq + gi * p->lq + u % p->lq) * p->D;
}

int vc_layers_f32(const struct vc_pass *p) {
    const int64_t T = p->T, H = p->H, hq = p->hq, hkv = p->hkv, D = p->D, I = p->I;
    const int64_t g = hq / hkv, nqkv = (hq + 2 * hkv) * D, rows = g * p->lq;
    float *x = malloc(sizeof(float) * (size_t)(T * H));
    float *qkv = malloc(sizeof(float) * (size_t)(T * nqkv));
    /* the padded rows' queries (padding rows zero, as the loop's) and outputs */
    float *qp = calloc((size_t)(p->B * p->lq * hq * D), sizeof(float));
    float *op = malloc(sizeof(float) * (size_t)(p->B * p->lq * hq * D));
    float *attn = malloc(sizeof(float) * (size_t)(T * hq * D));
    float *o = malloc(sizeof(float) * (size_t)(T * H));
    float *gu = malloc(sizeof(float) * (size_t)(T * 2 * I));
    float *a = malloc(sizeof(float) * (size_t)(T * I));
    int err = !(x && qkv && qp && op && attn && o && gu && a);
    for (int64_t li = 0; li < p->layers && !err; li++) {
        vc_rms_f32(p->h, p->ln_in[li], x, T, H, p->eps);
        if ((err = pass_linear(p, x, p->w_qkv[li], p->b_qkv[li], qkv, T, nqkv, H))) break;
        if (p->qk_norm[li]) vc_rms_heads_f32(qkv, p->qk_norm[li], T, hq + hkv, D, nqkv, p->eps);
        vc_rope_f32(qkv, T, hq + hkv, D, nqkv, p->cos[li], p->sin[li], p->R);
        for (int64_t t = 0; t < T; t++) {
            const float *row = qkv + t * nqkv;
            for (int64_t kh = 0; kh < hkv; kh++) {
                const int64_t at = p->wslot[t] * p->sb + kh * p->sh + p->wpos[t] * p->sn;
                kv_put(p->ck[li], at, row + (hq + kh) * D, D, p->kv_bf16);
                kv_put(p->cv[li], at, row + (hq + hkv + kh) * D, D, p->kv_bf16);
                for (int64_t gi = 0; gi < g; gi++)
                    memcpy(qp + padded(p, t, kh, gi), row + (kh * g + gi) * D,
                           sizeof(float) * (size_t)D);
            }
        }
        err = p->attend(qp, p->ck[li], p->cv[li], p->sb, p->sh, p->sn, p->lo[li], p->hi[li], op,
                        p->B, hkv, rows, D, p->scale, p->threads);
        if (err) break;
        for (int64_t t = 0; t < T; t++)
            for (int64_t kh = 0; kh < hkv; kh++)
                for (int64_t gi = 0; gi < g; gi++)
                    memcpy(attn + t * hq * D + (kh * g + gi) * D, op + padded(p, t, kh, gi),
                           sizeof(float) * (size_t)D);
        if ((err = pass_linear(p, attn, p->w_o[li], NULL, o, T, H, hq * D))) break;
        for (int64_t i = 0; i < T * H; i++) p->h[i] = p->h[i] + o[i];
        vc_rms_f32(p->h, p->ln_mlp[li], x, T, H, p->eps);
        if ((err = pass_linear(p, x, p->w_gu[li], NULL, gu, T, 2 * I, H))) break;
        vc_silu_mul_f32(gu, a, T, I);
        if ((err = pass_linear(p, a, p->w_down[li], NULL, o, T, H, I))) break;
        for (int64_t i = 0; i < T * H; i++) p->h[i] = p->h[i] + o[i];
    }
    free(x); free(qkv); free(qp); free(op); free(attn); free(o); free(gu); free(a);
    return err;
}

/* The block form of a float32 matrix w [n, k] (k a multiple of QB), as
 * `vericache.model.qweights.blocks_of_torch` finds it, in one pass instead of a dozen of
 * torch's: bits 4 (Q4_1's form: per block, lo = its least weight, d = half((hi - lo) / 15),
 * q = round((w - lo) / d) in 0..15, packed as `vc_linear_qw` reads them, m = lo) or bits 8
 * (Q8_0's: d = half(max |w| / 127), q = round(w / d) in -128..127, no offset), kept only where
 * d * q (+ m) gives every weight back bit for bit. A d of 0 divides by 1. Returns 1 with q, d
 * (and m, bits 4) filled, 0 at the first block that is not of that form (what was filled is
 * then meaningless). d * q + m is rounded twice, as torch's two operations: not contracted
 * into one fused multiply-add (the function's own optimize attribute); round() is rint's
 * ties-to-even, as torch.round. */
static inline float f16_round(float x) { return (float)(_Float16)x; }

static inline uint32_t bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

__attribute__((optimize("fp-contract=off")))
int vc_blocks_of(const float *w, int64_t n, int64_t k, int64_t bits, uint8_t *q, float *d,
                 float *m) {
    const int64_t nb = n * (k / QB);
    for (int64_t b = 0; b < nb; b++) {
        const float *x = w + b * QB;
        float lo = x[0], hi = x[0], amax = fabsf(x[0]);
        for (int i = 1; i < QB; i++) { /* NaN: torch's amin/amax give NaN, and so fails */
            if (x[i] != x[i]) return 0;
            lo = x[i] < lo ? x[i] : lo;
            hi = x[i] > hi ? x[i] : hi;
            amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        }
        if (x[0] != x[0]) return 0;
        const float db = bits == 4 ? f16_round((hi - lo) / 15.0f) : f16_round(amax / 127.0f);
        if (db != db) return 0; /* (torch.equal(d, d.half().float()) fails on NaN) */
        const float safe = db == 0.0f ? 1.0f : db;
        uint8_t qi[QB];
        for (int i = 0; i < QB; i++) {
            const float r = rintf(bits == 4 ? (x[i] - lo) / safe : x[i] / safe);
            if (bits == 4 ? !(r >= 0.0f && r <= 15.0f) : !(r >= -128.0f && r <= 127.0f))
                return 0;
            float back = db * r;
            if (bits == 4) back = back + lo;
            if (bits_of(back) != bits_of(x[i])) return 0;
            qi[i] = (uint8_t)(int8_t)r;
        }
        d[b] = db;
        if (bits == 4) {
            m[b] = lo;
            for (int c = 0; c < QB / 2; c++)
                q[b * (QB / 2) + c] = (uint8_t)(qi[c] | (qi[c + QB / 2] << 4));
        } else {
            memcpy(q + b * QB, qi, QB);
        }
    }
    return 1;
}
