/* Attention for a batch of sequences at once, reading each key and value once per KV head:
 * the runner's fast path for passes over pooled caches (`vericache.model.kernels`).
 *
 * For each task t = b * H + h in [t0, t1) (sequence b, KV head h), and each of its R query
 * rows r: out[b, h, r] = softmax(scale * q[b, h, r] . k[b, h, j]) v[b, h, j] over the keys
 * j in [lo[b, r], hi[b, r]) (nothing: zeros). Keys go in blocks of BLOCK: a block is read
 * from memory once and used for every row (GQA's query heads and a verify pass's rows share
 * it), with an online softmax per row (running max and sum), as in FlashAttention.
 *
 * q, out: [B, H, R, D] contiguous float32; k, v: float32 with element strides sb, sh, sn for
 * b, h and the key, and 1 within a key (a pool's slots as they lie); lo, hi: [B, R] int64.
 * lse (NULL, or [B, H, R]): each row's log-sum-exp of its scores (-FLT_MAX: no keys), with
 * which a caller that split the keys between calls combines their outputs.
 * The caller splits [0, B * H), or the keys, between its threads (ctypes drops the GIL).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64

int vc_attend_f32(const float *q, const float *k, const float *v, int64_t sb, int64_t sh,
                  int64_t sn, const int64_t *lo, const int64_t *hi, float *out, int64_t H,
                  int64_t R, int64_t D, float scale, int64_t t0, int64_t t1, float *lse) {
    float *acc = malloc(sizeof(float) * (size_t)(R * D + 2 * R + BLOCK));
    if (!acc) return -1;
    float *m = acc + R * D, *l = m + R, *s = l + R;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t b = t / H, h = t % H;
        const float *kb = k + b * sb + h * sh, *vb = v + b * sb + h * sh;
        const float *qb = q + t * R * D;
        const int64_t *lob = lo + b * R, *hib = hi + b * R;
        int64_t first = INT64_MAX, last = 0;
        for (int64_t r = 0; r < R; r++) {
            m[r] = -FLT_MAX;  /* no infinities: built with -ffast-math (vector expf) */
            l[r] = 0.0f;
            if (lob[r] < hib[r]) {
                if (lob[r] < first) first = lob[r];
                if (hib[r] > last) last = hib[r];
            }
        }
        memset(acc, 0, sizeof(float) * (size_t)(R * D));
        for (int64_t j0 = first; j0 < last; j0 += BLOCK) {
            const int64_t j1 = j0 + BLOCK < last ? j0 + BLOCK : last;
            for (int64_t r = 0; r < R; r++) {
                const int64_t a = lob[r] > j0 ? lob[r] : j0, e = hib[r] < j1 ? hib[r] : j1;
                if (a >= e) continue;
                const float *qr = qb + r * D;
                const int64_t n = e - a;
                for (int64_t i = 0; i < n; i++) {
                    const float *kj = kb + (a + i) * sn;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < D; d++) dot += qr[d] * kj[d];
                    s[i] = dot * scale;
                }
                float mx = m[r];
                for (int64_t i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
                const float corr = m[r] == -FLT_MAX ? 0.0f : expf(m[r] - mx);
                float sum = 0.0f;
                for (int64_t i = 0; i < n; i++) {
                    s[i] = expf(s[i] - mx);
                    sum += s[i];
                }
                float *ar = acc + r * D;
                for (int64_t d = 0; d < D; d++) ar[d] *= corr;
                for (int64_t i = 0; i < n; i++) {
                    const float *vj = vb + (a + i) * sn;
                    const float p = s[i];
                    for (int64_t d = 0; d < D; d++) ar[d] += p * vj[d];
                }
                l[r] = l[r] * corr + sum;
                m[r] = mx;
            }
        }
        float *ob = out + t * R * D;
        for (int64_t r = 0; r < R; r++) {
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            for (int64_t d = 0; d < D; d++) ob[r * D + d] = acc[r * D + d] * inv;
            if (lse) lse[t * R + r] = l[r] > 0.0f ? m[r] + logf(l[r]) : -FLT_MAX;
        }
    }
    free(acc);
    return 0;
}
