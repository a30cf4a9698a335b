/* y = x w^T (+ b) for skinny x: the runner's decode, draft and small verify products
 * (`vericache.model.kernels`), bound by reading the weights once.
 *
 * x: [m, k], w: [n, k], y: [m, n], b: [n] or NULL; float32, contiguous.
 * Output features go in blocks of JB and rows in blocks of at most IB: each block of JB
 * weight rows is read from memory once for every PANEL rows (it stays in L1 across their
 * row blocks, and the panel's x in L2), each (row, feature) pair accumulating in a vector
 * register over k. The feature blocks are split between `threads` OpenMP threads (the
 * runtime torch itself uses: the library links the libgomp.so.1 torch has loaded). A row's
 * sum is in a fixed order that depends on k alone, not on m, the threads or the other rows.
 */
#include <stdint.h>
#include <math.h>
#include <string.h>

#define VL 16 /* floats in a vector (the compiler splits it where registers are narrower) */
#define JB 4
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

/* rows [i0, i0 + MI) x features [j0, j0 + JB) */
#define BLOCK(MI)                                                                          \
    static inline void block##MI(const float *x, const float *w, const float *b, float *y, \
                                 int64_t n, int64_t k, int64_t i0, int64_t j0) {           \
        vf acc[MI][JB];                                                                    \
        memset(acc, 0, sizeof acc);                                                        \
        const int64_t kv = k - k % VL;                                                     \
        for (int64_t kk = 0; kk < kv; kk += VL) {                                          \
            vf wv[JB], xv[MI];                                                             \
            for (int j = 0; j < JB; j++) wv[j] = load(w + (j0 + j) * k + kk);              \
            for (int i = 0; i < MI; i++) xv[i] = load(x + (i0 + i) * k + kk);              \
            for (int i = 0; i < MI; i++)                                                   \
                for (int j = 0; j < JB; j++) acc[i][j] += xv[i] * wv[j];                   \
        }                                                                                  \
        for (int i = 0; i < MI; i++)                                                       \
            for (int j = 0; j < JB; j++) {                                                 \
                float s = hsum(acc[i][j]);                                                 \
                const float *xr = x + (i0 + i) * k, *wr = w + (j0 + j) * k;                \
                for (int64_t kk = kv; kk < k; kk++) s += xr[kk] * wr[kk];                  \
                y[(i0 + i) * n + j0 + j] = b ? s + b[j0 + j] : s;                          \
            }                                                                              \
    }
BLOCK(1)
BLOCK(2)
BLOCK(3)
BLOCK(4)

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
    /* rows in panels of PANEL: a panel of x stays in L2 while every weight block passes */
    for (int64_t p0 = 0; p0 < m; p0 += PANEL) {
        const int64_t p1 = p0 + PANEL < m ? p0 + PANEL : m;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t jb = 0; jb < blocks; jb++) {
            const int64_t j0 = jb * JB;
            int64_t i0 = p0;
            for (; i0 + IB <= p1; i0 += IB) block4(x, w, b, y, n, k, i0, j0);
            switch (p1 - i0) {
            case 3: block3(x, w, b, y, n, k, i0, j0); break;
            case 2: block2(x, w, b, y, n, k, i0, j0); break;
            case 1: block1(x, w, b, y, n, k, i0, j0); break;
            default: break;
            }
        }
    }
    if (n % JB) tail(x, w, b, y, m, n, k, blocks * JB, n % JB);
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
