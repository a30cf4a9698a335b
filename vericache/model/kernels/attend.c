/* Attention for a batch of sequences at once, reading each key and value once per KV head:
 * the runner's fast path for passes over pooled caches (`vericache.model.kernels`).
 *
 * For each task t = b * H + h in [t0, t1) (sequence b, KV head h), and each of its R query
 * rows r: out[b, h, r] = softmax(scale * q[b, h, r] . k[b, h, j]) v[b, h, j] over the keys
 * j in [lo[b, r], hi[b, r]) (nothing: zeros). Keys go in blocks of BLOCK: a block is read
 * from memory once and used for every row (GQA's query heads and a verify pass's rows share
 * it), with an online softmax per row (running max and sum), as in FlashAttention.
 *
 * q, out: [B, H, R, D] contiguous float32; k, v: float32 (`vc_attend_f32`) or bfloat16
 * (`vc_attend_bf16`: the drafter's caches, widened to float32 as they are read, or, with
 * AVX512-BF16, keys dotted as bfloat16 pairs with the query rounded to bfloat16: BF_DOT; the
 * sums are float32 either way) with element strides sb, sh, sn for b, h and the key, and 1 within a
 * key (a pool's slots as they lie); lo, hi: [B, R] int64.
 * Each task's keys go in parts of PART_KEYS at fixed places (part p: keys [p PART_KEYS,
 * (p + 1) PART_KEYS)), each part with its own running max and sum, combined by them at the
 * end; the (task, part) units go to `threads` OpenMP threads (the runtime torch has loaded).
 * So a batch of one sequence (a few KV heads) still keeps every thread busy, and a row whose
 * keys start at 0 (no sliding window) gets the same bits whatever the threads and whatever
 * rows share its call: its parts, blocks and vectors are placed by its own range alone.
 *
 * Votes (`vc_attend_votes_*`): each key's attention mass summed over the task's rows,
 * votes[t, j] = sum_r softmax_r(j) (0 outside every row's range), for selection policies. The
 * units keep their rows' weights exp(s - m) as they compute them, with the running max m of
 * each block; once the rows' maxima M and sums are known, a pass over the kept weights adds
 * each key's up, in row order, each block's scaled by exp(m - M) / sum (no exponential a
 * key). Only the rows r with r % vl >= v0 vote (a task's rows are (query head, row) with vl
 * rows a head: v0 = 0 counts them all; a prefill chunk's question window counts its last
 * rows only). The rows' outputs are the bits the call without votes gives (the same units,
 * the same sums); `out` NULL: the votes only (no value products).
 *
 * ALiBi (`vc_attend_alibi_f32`, float32 K/V, votes optional): each score plus its row's slope
 * (slope [H, R]) times the key's position, as `alibi_bias` computes each family's; the caches
 * are dense, so a key's slot is its position and a row's is hi - 1.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#define BLOCK 64
#define PART_KEYS 512 /* a multiple of BLOCK */
#define SCRATCH_FLOATS (16 << 20) /* 64 MB */
#define PART_BLOCKS (PART_KEYS / BLOCK) /* a part's blocks (its first may start off BLOCK) */

/* W: floats in a vector and keys scored at once, the machine's own width (AVX-512: 16; else 8,
 * AVX2's). 16 keys' dot products of 16-float vectors (32 registers' worth) on AVX2's 16
 * registers went through memory: a 64-query chunk over 8k keys took 162 ms a layer on an
 * AVX2 EPYC, 22 ms with W 8. A row's sums are in the order W fixes, the same on every call of
 * one build. */
#if defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif

typedef float vf __attribute__((vector_size(W * sizeof(float))));

/* BF_DOT: bfloat16 keys are scored by AVX512-BF16's vdpbf16ps (32 products a vector, summed
 * in pairs into float32) against the row's query rounded to bfloat16, read where they lie;
 * only the values are widened. A drafter's scores then differ from its float32 query's in
 * the query's rounding, and its drafts are verified. Without AVX512-BF16 the keys are
 * widened with the values and scored in float32. A draft step's layer (16 x 2300 keys, 3
 * rows a KV head, 2 threads, a 2-vCPU Zen 4 EPYC) took 1.18 ms, against 1.70 widening the
 * keys; 4 x 2300 keys 0.26 against 0.41 (/tmp probe). */
#if defined(__AVX512BF16__) && W == 16
#include <immintrin.h>
#define BF_DOT 1
#else
#define BF_DOT 0
#endif

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline vf load(const float *p) {
    vf r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void store(float *p, vf x) { memcpy(p, &x, sizeof x); }

typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));

/* W keys' or values' elements at element offset `off` of `base`: float32 (BF 0) or bfloat16
 * (BF 1: the top half of a float32, so widening is a shift) */
static inline __attribute__((always_inline)) vf kv_load(const void *base, int64_t off,
                                                        const int BF) {
    if (!BF) return load((const float *)base + off);
    vh x;
    memcpy(&x, (const uint16_t *)base + off, sizeof x);
    const vu u = __builtin_convertvector(x, vu) << 16;
    vf r;
    memcpy(&r, &u, sizeof r);
    return r;
}

static inline __attribute__((always_inline)) float kv_get(const void *base, int64_t off,
                                                          const int BF) {
    if (!BF) return ((const float *)base)[off];
    const uint32_t u = (uint32_t)((const uint16_t *)base)[off] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if W == 16
/* lane j: the sum of a[j]'s lanes (16 vectors reduced at once: 15 shuffle-add pairs) */
static inline vf hsum(vf *a) {
    vf c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)
        c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                       22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                       22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30) +
           __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
}
#else
/* lane j: the sum of a[j]'s lanes (8 vectors reduced at once: 7 shuffle-add pairs) */
static inline vf hsum(vf *a) {
    vf c[4], d[2];
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

/* PV_ROWS: rows whose value products share each value vector's read (`pv_tile`) */
#define PV_ROWS 3 /* 3 rows x 4 vectors: 12 accumulators, 7 loads for 12 products (a row alone:
                     9 for 8) */
_Static_assert(PV_ROWS == 3, "part() dispatches tiles of 1 to 3 rows to pv_tile");

/* rows [r0, r0 + TR) over the same n keys (values from element offset vj of vp, vn apart):
 * acc[r] = acc[r] * cr[r] + sum_i sc[r, i] v_i, CV of the row's NV vectors at a time (TR CV
 * accumulators in registers), each row's vector the sum a row alone gets: the same products,
 * each added in key order. */
static inline __attribute__((always_inline)) void
pv_tile(float *acc, const float *sc, const float *cr, const void *vp, int64_t vj, int64_t vn,
        int64_t n, int64_t r0, int64_t D, const int NV, const int TR, const int CV) {
    for (int c0 = 0; c0 < NV; c0 += CV) {
        vf o[TR][CV];
        for (int r = 0; r < TR; r++)
            for (int c = 0; c < CV; c++)
                o[r][c] = load(acc + (r0 + r) * D + W * (c0 + c)) * cr[r0 + r];
        for (int64_t i = 0; i < n; i++) {
            const int64_t at = vj + i * vn + W * c0;
            for (int c = 0; c < CV; c++) {
                const vf x = kv_load(vp, at + W * c, 0);
                for (int r = 0; r < TR; r++) o[r][c] += sc[(r0 + r) * BLOCK + i] * x;
            }
        }
        for (int r = 0; r < TR; r++)
            for (int c = 0; c < CV; c++) store(acc + (r0 + r) * D + W * (c0 + c), o[r][c]);
    }
}

/* QK_ROWS: rows whose scores share each key vector's read (`qk_tile`), by head size in
 * vectors. A decode step's GQA group (3 rows a KV head for SmolLM2) is a tile. One layer's
 * call against row by row (`benchmarks/attend_ab.py --baseline 5d273ba`, a 2-vCPU Zen 4
 * EPYC, medians of 12 alternated rounds, 1 / 2 threads): decode over 8k float32 keys 1.19 /
 * 1.17x for one sequence and 1.29 / 1.23x for 16, a verify pass's 33 rows 1.14 / 1.15x
 * (thirty-seventh session). Built for Zen 3 (AVX2's 16 registers, head size 64 in 8 vectors:
 * tiles of at most 2 rows) the same calls ran 0.98-1.07x on one thread, so there a tile is
 * one row, the loop it replaced. */
#define QK_ROWS(NV) (W == 16 ? ((NV) <= 4 ? 4 : 2) : 1)

/* rows [r0, r0 + TR) over the same n keys (key i's elements at kr + (a + i) kn of kp): each
 * row's scores of the first n - n % W keys into sc [R, BLOCK], each key's vectors read once
 * for the tile and each score the sum a row alone gets (the same products, added in the same
 * order, reduced by the same `hsum`) */
static inline __attribute__((always_inline)) void
qk_tile(float *sc, const float *qb, const void *kp, int64_t kr, int64_t kn, int64_t a,
        int64_t n, int64_t r0, int64_t D, const int NV, const int TR, float scale) {
    vf qv[TR][NV];
    for (int r = 0; r < TR; r++)
        for (int c = 0; c < NV; c++) qv[r][c] = load(qb + (r0 + r) * D + W * c);
    for (int64_t i = 0; i + W <= n; i += W) {
        vf dots[TR][W];
        for (int j = 0; j < W; j++) {
            const int64_t kj = kr + (a + i + j) * kn;
            for (int r = 0; r < TR; r++) { /* (the key's loads are the same for every row) */
                dots[r][j] = qv[r][0] * kv_load(kp, kj, 0);
                for (int c = 1; c < NV; c++) dots[r][j] += qv[r][c] * kv_load(kp, kj + W * c, 0);
            }
        }
        for (int r = 0; r < TR; r++) store(sc + (r0 + r) * BLOCK + i, hsum(dots[r]) * scale);
    }
}

/* a voting row r's place among the rows that vote (r % vl >= v0), and how many of R vote */
/* ALiBi's bias on a row's score for key position j, row position qp, as the runner's
 * `Runner._alibi` computes it for a float32 model: ak 0 (MPT's), sl (j - qp); 1 (BLOOM's),
 * sl j; 2 (Falcon's), sl (already bfloat16) j rounded to bfloat16, over sqrt(D) */
static inline float alibi_bias(float sl, int64_t j, int64_t qp, int ak, int64_t D) {
    if (ak == 0) return sl * (float)(j - qp);
    if (ak == 1) return sl * (float)j;
    const uint32_t bits = (uint32_t)bf16_round(sl * (float)j) << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x / (float)sqrt((double)D);
}

static inline int64_t voter(int64_t r, int64_t vl, int64_t v0) {
    return r / vl * (vl - v0) + r % vl - v0;
}

static inline int64_t voters(int64_t R, int64_t vl, int64_t v0) {
    return R / vl * (vl - v0) + (R % vl > v0 ? R % vl - v0 : 0);
}

/* Task t's rows over the keys [j_lo, j_hi) (each row's range clipped to it): the unnormalised
 * output acc [R, D], each row's running max m [R] and sum l [R]; scratch: sc [R, BLOCK] (each
 * row's scores, then weights, in a block), cr [R] (its rescale), ra, rn [R] (its keys in
 * the block: first, count). A block's float32 scores come in tiles of rows over the same
 * keys (`qk_tile`), then each row's weights, then its values in tiles of rows (`pv_tile`):
 * the 33 x 3 rows of a verify pass over 8k keys took 14.9 ms a layer, one thread of a 2-vCPU
 * AVX2 EPYC, row by row, and 13.8 with the values in tiles; the same bits.
 * NV > 0: D = W NV, in vectors (W keys' scores at once, the row's output in registers);
 * NV = 0: any D, in scalar loops. BF: each block's bfloat16 keys and values are widened once
 * into wb (2 BLOCK D floats), which every row then reads: widening is exact, so a row's
 * sums are those of widening as it reads, without widening a block again for each of the
 * GQA group's rows (a draft step's layer, 16 x 2000 keys, 3 rows a KV head, 2 threads, on
 * an AVX2 EPYC: 2.92 ms widening as it read, 1.90 ms widened once).
 * VT (votes): each voting row's weights also go to ss [RV, PART_KEYS] at their keys' places
 * (`voter`: its place among the RV rows that vote), each block's running max after them
 * [RV, PART_BLOCKS], and the first block's start to *first_out; pv 0 (with VT only): no value
 * products. */
static inline __attribute__((always_inline)) void
part(const float *q, const void *k, const void *v, int64_t sb, int64_t sh, int64_t sn,
     const int64_t *lo, const int64_t *hi, int64_t H, int64_t R, int64_t D, const int NV,
     const int BF, float scale, int64_t t, int64_t j_lo, int64_t j_hi, float *acc, float *m,
     float *l, float *sc, float *cr, int64_t *ra, int64_t *rn, float *wb, uint16_t *qh,
     float *ss, int64_t vl, int64_t v0, int64_t RV, int64_t *first_out, const int VT, int pv,
     const float *slope, int ak) {
    const int64_t b = t / H, h = t % H;
    const int64_t kb = b * sb + h * sh; /* the task's keys and values: element offsets */
    const float *qb = q + t * R * D;
    const int64_t *lob = lo + b * R, *hib = hi + b * R;
    int64_t first = INT64_MAX, last = 0;
    for (int64_t r = 0; r < R; r++) {
        m[r] = -FLT_MAX; /* no infinities: built with -ffast-math (vector expf) */
        l[r] = 0.0f;
        const int64_t a = lob[r] > j_lo ? lob[r] : j_lo, e = hib[r] < j_hi ? hib[r] : j_hi;
        if (a < e) {
            if (a < first) first = a;
            if (e > last) last = e;
        }
    }
    if (VT) *first_out = first; /* where the blocks start, for the votes' pass */
    memset(acc, 0, sizeof(float) * (size_t)(R * D));
    /* keys scored as bfloat16 pairs: the rows' queries rounded once (qh [R, D]) */
    const int dot = BF && BF_DOT && NV && D % 32 == 0;
    if (dot)
        for (int64_t i = 0; i < R * D; i++) qh[i] = bf16_round(qb[i]);
    for (int64_t j0 = first; j0 < last; j0 += BLOCK) {
        const int64_t j1 = j0 + BLOCK < last ? j0 + BLOCK : last;
        /* where the rows read the block: key j's elements at kr + j * kn of kp, its value's
           at vr + j * vn of vp */
        const void *kp = k, *vp = v;
        int64_t kr = kb, kn = sn, vr = kb, vn = sn;
        if (BF) {
            float *wk = wb, *wv = wb + BLOCK * D;
            for (int64_t j = j0; j < j1; j++) {
                const int64_t src = kb + j * sn, dst = (j - j0) * D;
                int64_t d = 0;
                for (; NV && d + W <= D; d += W) {
                    if (!dot) store(wk + dst + d, kv_load(k, src + d, 1));
                    store(wv + dst + d, kv_load(v, src + d, 1));
                }
                for (; d < D; d++) {
                    wk[dst + d] = kv_get(k, src + d, 1);
                    wv[dst + d] = kv_get(v, src + d, 1);
                }
            }
            if (!dot) {
                kp = wk;
                kr = -j0 * D;
                kn = D;
            }
            vp = wv;
            vr = -j0 * D;
            vn = D;
        }
        for (int64_t r = 0; r < R; r++) {
            const int64_t a = lob[r] > j0 ? lob[r] : j0, e = hib[r] < j1 ? hib[r] : j1;
            rn[r] = a < e ? e - a : 0;
            ra[r] = a;
        }
        /* float32 scores: consecutive rows over the same keys in tiles (`qk_tile`) */
        if (NV && !dot)
            for (int64_t r = 0; r < R;) {
                if (!rn[r]) {
                    r++;
                    continue;
                }
                int64_t tr = 1;
                while (tr < QK_ROWS(NV) && r + tr < R && rn[r + tr] == rn[r] && ra[r + tr] == ra[r])
                    tr++;
                if (tr == 4)
                    qk_tile(sc, qb, kp, kr, kn, ra[r], rn[r], r, D, NV > 0 ? NV : 1, 4, scale);
                else if (tr == 3)
                    qk_tile(sc, qb, kp, kr, kn, ra[r], rn[r], r, D, NV > 0 ? NV : 1, 3, scale);
                else if (tr == 2)
                    qk_tile(sc, qb, kp, kr, kn, ra[r], rn[r], r, D, NV > 0 ? NV : 1, 2, scale);
                else
                    qk_tile(sc, qb, kp, kr, kn, ra[r], rn[r], r, D, NV > 0 ? NV : 1, 1, scale);
                r += tr;
            }
        for (int64_t r = 0; r < R; r++) {
            if (!rn[r]) continue;
            const int64_t a = ra[r], e = a + rn[r];
            const float *qr = qb + r * D;
            const int64_t n = e - a;
            float *s = sc + r * BLOCK; /* the row's scores, then weights, in this block */
            int64_t i = 0;
#if BF_DOT
            if (dot) {
                __m512i qv[NV > 0 ? NV : 1]; /* NV / 2 vectors of 32 bfloat16 */
                for (int c = 0; c < NV / 2; c++)
                    qv[c] = _mm512_loadu_si512(qh + r * D + 32 * c);
                for (; i + W <= n; i += W) {
                    vf dots[W];
                    for (int j = 0; j < W; j++) {
                        const uint16_t *kj = (const uint16_t *)k + kr + (a + i + j) * kn;
                        __m512 d = _mm512_setzero_ps();
                        for (int c = 0; c < NV / 2; c++)
                            d = _mm512_dpbf16_ps(d, (__m512bh)qv[c],
                                                 (__m512bh)_mm512_loadu_si512(kj + 32 * c));
                        memcpy(&dots[j], &d, sizeof d);
                    }
                    store(s + i, hsum(dots) * scale);
                }
            }
#endif
            if (NV && !dot) i = n - n % W; /* scored by `qk_tile` */
            for (; i < n; i++) { /* the keys past the last W (dot: as bfloat16, in place) */
                const int64_t kj = kr + (a + i) * kn;
                float dot_i = 0.0f;
                for (int64_t d = 0; d < D; d++)
                    dot_i += (dot ? kv_get(qh + r * D, d, 1) : qr[d]) * kv_get(kp, kj + d, dot);
                s[i] = dot_i * scale;
            }
            if (slope) { /* ALiBi: the row's slope times its keys' positions (`alibi_bias`) */
                const float sl = slope[h * R + r];
                const int64_t qp = hib[r] - 1; /* the row's own slot: its position */
                for (i = 0; i < n; i++) s[i] += alibi_bias(sl, a + i, qp, ak, D);
            }
            float mx = m[r];
            for (i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
            const float corr = m[r] == -FLT_MAX ? 0.0f : expf(m[r] - mx);
            float sum = 0.0f;
            for (i = 0; i < n; i++) {
                s[i] = expf(s[i] - mx);
                sum += s[i];
            }
            if (VT && r % vl >= v0) { /* for the votes: the weights, the block's max */
                const int64_t x = voter(r, vl, v0);
                memcpy(ss + x * PART_KEYS + (a - j_lo), s, sizeof(float) * (size_t)n);
                ss[RV * PART_KEYS + x * PART_BLOCKS + (j0 - first) / BLOCK] = mx;
            }
            cr[r] = corr;
            if (!NV && (!VT || pv)) {
                float *ar = acc + r * D;
                for (int64_t d = 0; d < D; d++) ar[d] *= corr;
                for (i = 0; i < n; i++) {
                    const int64_t vj = vr + (a + i) * vn;
                    const float p = s[i];
                    for (int64_t d = 0; d < D; d++) ar[d] += p * kv_get(vp, vj + d, 0);
                }
            }
            l[r] = l[r] * corr + sum;
            m[r] = mx;
        }
        if (!NV || (VT && !pv)) continue;
        /* the values: consecutive rows over the same keys (a GQA group's, a token's) in
           tiles of up to PV_ROWS, each value vector read once for the tile */
        for (int64_t r = 0; r < R;) {
            if (!rn[r]) {
                r++;
                continue;
            }
            int64_t tr = 1;
            while (tr < PV_ROWS && r + tr < R && rn[r + tr] == rn[r] && ra[r + tr] == ra[r]) tr++;
            const int64_t vj0 = vr + ra[r] * vn;
            if (tr == 3)
                pv_tile(acc, sc, cr, vp, vj0, vn, rn[r], r, D, NV, 3, 4);
            else if (tr == 2)
                pv_tile(acc, sc, cr, vp, vj0, vn, rn[r], r, D, NV, 2, 4);
            else
                pv_tile(acc, sc, cr, vp, vj0, vn, rn[r], r, D, NV, 1, NV < 8 ? NV : 8);
            r += tr;
        }
    }
}

static inline __attribute__((always_inline)) int
attend(const float *q, const void *k, const void *v, int64_t sb, int64_t sh, int64_t sn,
       const int64_t *lo, const int64_t *hi, float *out, float *votes, int64_t vs, int64_t vl,
       int64_t v0, int64_t B, int64_t H, int64_t R, int64_t D, float scale, int64_t threads,
       const int BF, const float *slope, int ak) {
    const int64_t tasks = B * H;
    int64_t last = 0;
    for (int64_t i = 0; i < B * R; i++)
        if (lo[i] < hi[i] && hi[i] > last) last = hi[i];
    const int64_t parts = last > 0 ? (last + PART_KEYS - 1) / PART_KEYS : 1;
    /* each unit (task, part): acc [R, D], m [R], l [R], with votes its voting rows' weights
       ss [RV, PART_KEYS] and their blocks' maxima [RV, PART_BLOCKS]; tasks in waves of at most
       SCRATCH_FLOATS of them (the same sums: a task's units are all in its wave) */
    const int64_t RV = votes ? voters(R, vl, v0) : 0; /* the rows that vote */
    const int64_t head = R * (D + 2), stride = head + RV * (PART_KEYS + PART_BLOCKS);
    int64_t wave = SCRATCH_FLOATS / (parts * stride);
    if (wave < 1) wave = 1;
    if (wave > tasks) wave = tasks;
    float *scratch = malloc(sizeof(float) * (size_t)(wave * parts * stride));
    /* with votes, each row's final max and inverse sum [wave, R, 2], and each unit's first
       block's start [wave parts] */
    float *rs = votes ? malloc(sizeof(float) * 2 * (size_t)(wave * R)) : NULL;
    int64_t *uf = votes ? malloc(sizeof(int64_t) * (size_t)(wave * parts)) : NULL;
    if (!scratch || (votes && (!rs || !uf))) {
        free(scratch);
        free(rs);
        free(uf);
        return -1;
    }
    const int pv = out != NULL;
    int failed = 0;
    for (int64_t t0 = 0; t0 < tasks && !failed; t0 += wave) {
        const int64_t nt = tasks - t0 < wave ? tasks - t0 : wave, units = nt * parts;
#pragma omp parallel num_threads(threads)
        {
            float *sc = malloc(sizeof(float) * BLOCK * (size_t)R);
            float *cr = malloc(sizeof(float) * (size_t)R);
            int64_t *ra = malloc(sizeof(int64_t) * 2 * (size_t)R), *rn = ra ? ra + R : NULL;
            float *wb = BF ? malloc(sizeof(float) * 2 * BLOCK * (size_t)D) : NULL;
            uint16_t *qh = BF ? malloc(sizeof(uint16_t) * (size_t)(R * D)) : NULL;
            const int ok = sc && cr && ra && (!BF || (wb && qh));
            if (!ok) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++) {
                if (!ok) continue;
                const int64_t t = t0 + u / parts, p = u % parts;
                const int64_t j_lo = p * PART_KEYS, j_hi = j_lo + PART_KEYS;
                float *acc = scratch + u * stride;
                float *m = acc + R * D, *l = m + R, *ss = votes ? acc + head : NULL;
                /* the common models' head sizes in vectors; votes in their own instances, so
                   a call without them runs the code it ran before they were added */
#define PART(DD, NVV, VT)                                                                   \
    part(q, k, v, sb, sh, sn, lo, hi, H, R, DD, NVV, BF, scale, t, j_lo, j_hi, acc, m, l, sc, \
         cr, ra, rn, wb, qh, ss, vl, v0, RV, uf ? uf + u : NULL, VT, pv, slope, ak)
                if (D == 64)
                    votes ? PART(64, 64 / W, 1) : PART(64, 64 / W, 0);
                else if (D == 128)
                    votes ? PART(128, 128 / W, 1) : PART(128, 128 / W, 0);
                else
                    votes ? PART(D, 0, 1) : PART(D, 0, 0);
#undef PART
            }
            free(sc);
            free(cr);
            free(ra);
            free(wb);
            free(qh);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < nt; i++) {
                float *ob = pv ? out + (t0 + i) * R * D : NULL;
                const float *ut = scratch + i * parts * stride;
                for (int64_t r = 0; r < R; r++) {
                    float mx = -FLT_MAX, total = 0.0f;
                    for (int64_t p = 0; p < parts; p++) {
                        const float mp = ut[p * stride + R * D + r];
                        mx = mp > mx ? mp : mx;
                    }
                    float *o = pv ? ob + r * D : NULL;
                    if (pv) memset(o, 0, sizeof(float) * (size_t)D);
                    for (int64_t p = 0; p < parts; p++) {
                        const float *u = ut + p * stride;
                        const float lp = u[R * D + R + r];
                        if (lp <= 0.0f) continue; /* a part with no keys for this row */
                        const float w = expf(u[R * D + r] - mx);
                        total += w * lp;
                        if (pv)
                            for (int64_t d = 0; d < D; d++) o[d] += w * u[r * D + d];
                    }
                    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                    if (pv)
                        for (int64_t d = 0; d < D; d++) o[d] *= inv;
                    if (votes) {
                        rs[2 * (i * R + r)] = mx;
                        rs[2 * (i * R + r) + 1] = inv;
                    }
                }
            }
            if (votes) {
                /* each unit's keys (the last unit's: on to vs): the rows' weights, in row order */
#pragma omp for schedule(static)
                for (int64_t u = 0; u < units; u++) {
                    const int64_t i = u / parts, p = u % parts, t = t0 + i, b = t / H;
                    const int64_t j_lo = p * PART_KEYS;
                    const int64_t j_hi = p + 1 == parts ? vs : (j_lo + PART_KEYS < vs ? j_lo + PART_KEYS : vs);
                    if (j_lo >= j_hi) continue;
                    float *vt = votes + t * vs;
                    memset(vt + j_lo, 0, sizeof(float) * (size_t)(j_hi - j_lo));
                    const float *ss = scratch + u * stride + head;
                    const int64_t ke = j_lo + PART_KEYS; /* the part's keys, as part() clips */
                    const int64_t first = uf[u]; /* where part() started its blocks */
                    for (int64_t r = 0; r < R; r++) {
                        if (r % vl < v0) continue; /* a row that does not vote */
                        const int64_t a = lo[b * R + r] > j_lo ? lo[b * R + r] : j_lo;
                        const int64_t e = hi[b * R + r] < ke ? hi[b * R + r] : ke;
                        if (a >= e) continue;
                        const float mx = rs[2 * (i * R + r)], inv = rs[2 * (i * R + r) + 1];
                        const int64_t x = voter(r, vl, v0);
                        const float *wr = ss + x * PART_KEYS - j_lo;
                        const float *bm = ss + RV * PART_KEYS + x * PART_BLOCKS;
                        for (int64_t j0 = first + (a - first) / BLOCK * BLOCK; j0 < e; j0 += BLOCK) {
                            const float f = expf(bm[(j0 - first) / BLOCK] - mx) * inv;
                            const int64_t x0 = a > j0 ? a : j0, x1 = e < j0 + BLOCK ? e : j0 + BLOCK;
                            for (int64_t j = x0; j < x1; j++) vt[j] += wr[j] * f;
                        }
                    }
                }
            }
        }
    }
    free(scratch);
    free(rs);
    free(uf);
    return failed ? -1 : 0;
}

int vc_attend_f32(const float *q, const void *k, const void *v, int64_t sb, int64_t sh,
                  int64_t sn, const int64_t *lo, const int64_t *hi, float *out, int64_t B,
                  int64_t H, int64_t R, int64_t D, float scale, int64_t threads) {
    return attend(q, k, v, sb, sh, sn, lo, hi, out, NULL, 0, 1, 0, B, H, R, D, scale, threads,
                  0, NULL, 0);
}

/* 1: bfloat16 keys of a head size that is a multiple of 32 are scored by vdpbf16ps against
 * the query rounded to bfloat16 (BF_DOT) */
int vc_attend_bf16_dot(void) { return BF_DOT; }

int vc_attend_bf16(const float *q, const void *k, const void *v, int64_t sb, int64_t sh,
                   int64_t sn, const int64_t *lo, const int64_t *hi, float *out, int64_t B,
                   int64_t H, int64_t R, int64_t D, float scale, int64_t threads) {
    return attend(q, k, v, sb, sh, sn, lo, hi, out, NULL, 0, 1, 0, B, H, R, D, scale, threads,
                  1, NULL, 0);
}

/* as vc_attend_*, with votes [B H, vs] (vs: at least every row's hi) written, summed over the
 * rows r with r % vl >= v0; out NULL: the votes only */
int vc_attend_votes_f32(const float *q, const void *k, const void *v, int64_t sb, int64_t sh,
                        int64_t sn, const int64_t *lo, const int64_t *hi, float *out,
                        float *votes, int64_t vs, int64_t vl, int64_t v0, int64_t B, int64_t H,
                        int64_t R, int64_t D, float scale, int64_t threads) {
    return attend(q, k, v, sb, sh, sn, lo, hi, out, votes, vs, vl, v0, B, H, R, D, scale,
                  threads, 0, NULL, 0);
}

int vc_attend_votes_bf16(const float *q, const void *k, const void *v, int64_t sb, int64_t sh,
                         int64_t sn, const int64_t *lo, const int64_t *hi, float *out,
                         float *votes, int64_t vs, int64_t vl, int64_t v0, int64_t B, int64_t H,
                         int64_t R, int64_t D, float scale, int64_t threads) {
    return attend(q, k, v, sb, sh, sn, lo, hi, out, votes, vs, vl, v0, B, H, R, D, scale,
                  threads, 1, NULL, 0);
}

/* as vc_attend_votes_f32 (votes NULL: none), over float32 K/V in a dense cache (a key's slot
 * is its position, a row's is hi - 1), each score plus ALiBi's bias: slope [H, R] (each task
 * head's rows' slopes), ak the family's arithmetic (`alibi_bias`) */
int vc_attend_alibi_f32(const float *q, const void *k, const void *v, int64_t sb, int64_t sh,
                        int64_t sn, const int64_t *lo, const int64_t *hi, float *out,
                        float *votes, int64_t vs, int64_t vl, int64_t v0, int64_t B, int64_t H,
                        int64_t R, int64_t D, float scale, int64_t threads, const float *slope,
                        int64_t ak) {
    return attend(q, k, v, sb, sh, sn, lo, hi, out, votes, vs, vl, v0, B, H, R, D, scale,
                  threads, 0, slope, (int)ak);
}
