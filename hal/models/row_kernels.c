/* The runner's per-row work between its matmuls, one call per step of a layer
 * (`hal.models.row_kernels`): RMSNorm (with the residual add before it), SwiGLU, RoPE.
 *
 * Every row is computed by the same code whatever the row count, and nothing here sums
 * across rows, so a row's bits never depend on its batch-mates: decode and verify agree bit
 * for bit, as the batch-invariant runner needs. Sums run in LANES fixed partial sums combined
 * in a fixed tree (a plain loop the compiler can vectorize without reassociating).
 * Activations are float32 or bfloat16 (rounded to nearest even, as torch rounds); the
 * residual stream, norm weights and RoPE tables are float32. Single-threaded by design: the
 * rows are short, and a second OpenMP runtime would fight torch's.
 *
 * The caller (Python) checks every shape, dtype, stride and device before a call. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;
#define LANES 16

static inline bf16 to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);   /* NaN stays NaN */
}

static inline float from_bf16(bf16 b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* one element of an activation row: float32 (is_bf16 == 0) or bfloat16 */
static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? from_bf16(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int is_bf16) {
    if (is_bf16) ((bf16 *)p)[i] = to_bf16(v);
    else ((float *)p)[i] = v;
}

static float sum_squares(const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * x[i + j];
    for (int j = 0; i < n; i++, j++) acc[j] += x[i] * x[i];
    for (int s = LANES / 2; s > 0; s /= 2)
        for (int j = 0; j < s; j++) acc[j] += acc[j + s];
    return acc[0];
}

/* the largest of x[0..n) (-inf for none; NaNs skipped), in LANES partial maxima as `sum_squares`
 * sums: vectorizable, where one compare after another waits on the last. Of +0 and -0 either
 * may come back (a caller subtracting it gets the same bits either way). */
static float max_of(const float *x, int64_t n) {
    float top[LANES];
    for (int j = 0; j < LANES; j++) top[j] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) top[j] = x[i + j] > top[j] ? x[i + j] : top[j];
    for (int j = 0; i < n; i++, j++) top[j] = x[i] > top[j] ? x[i] : top[j];
    for (int s = LANES / 2; s > 0; s /= 2)
        for (int j = 0; j < s; j++) top[j] = top[j + s] > top[j] ? top[j + s] : top[j];
    return top[0];
}

/* exp(x) for float32, a fixed polynomial (Cephes' expf): vectorizable, about 1 ulp;
 * arguments are clamped to [-87.3, 88.7] (results stay finite). */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.7f ? 88.7f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   /* round to nearest (|.| < 2^22) */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

/* h [T, H] (float32, row stride hs) += d (activations, row stride ds; d NULL: no add); then,
 * if out is not NULL, out [T, H] (row stride os) = h * rsqrt(mean(h^2) + eps) * w. */
void add_norm(float *h, int64_t hs, const void *d, int64_t ds, int d_bf16, const float *w, float eps,
              void *out, int64_t os, int out_bf16, int64_t T, int64_t H) {
    for (int64_t t = 0; t < T; t++) {
        float *x = h + t * hs;
        if (d) {
            const char *row = (const char *)d + t * ds * (d_bf16 ? 2 : 4);
            for (int64_t i = 0; i < H; i++) x[i] += load(row, i, d_bf16);
        }
        if (!out) continue;
        float r = 1.0f / sqrtf(sum_squares(x, H) / (float)H + eps);
        char *o = (char *)out + t * os * (out_bf16 ? 2 : 4);
        for (int64_t i = 0; i < H; i++) store(o, i, x[i] * r * w[i], out_bf16);
    }
}

/* x [T, heads * D] (activations, row stride xs elements) RMS-normed per head of D in place:
 * v * rsqrt(mean(v^2) + eps) * w (w [D] float32), in float32, rounded once (Qwen3's q and k norms). */
void head_norm(void *x, int64_t xs, int is_bf16, const float *w, float eps, int64_t T, int64_t heads, int64_t D) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) {
            char *v = (char *)x + (t * xs + h * D) * (is_bf16 ? 2 : 4);
            float ss = 0.f;
            for (int64_t i = 0; i < D; i++) {
                float a = load(v, i, is_bf16);
                ss += a * a;
            }
            float r = 1.0f / sqrtf(ss / (float)D + eps);
            for (int64_t i = 0; i < D; i++) store(v, i, load(v, i, is_bf16) * r * w[i], is_bf16);
        }
}

static inline float silu(float a) {
    return a / (1.0f + exp_f32(-a));
}

/* out [T, F] = silu(gu[:, :F]) * gu[:, F:] (gu row stride gs, out row stride os; one dtype) */
void silu_mul(const void *gu, int64_t gs, int64_t F, void *out, int64_t os, int is_bf16, int64_t T) {
    for (int64_t t = 0; t < T; t++) {
        if (is_bf16) {   /* one loop per dtype: each vectorizes */
            const bf16 *g = (const bf16 *)gu + t * gs, *u = g + F;
            bf16 *o = (bf16 *)out + t * os;
            for (int64_t i = 0; i < F; i++) o[i] = to_bf16(silu(from_bf16(g[i])) * from_bf16(u[i]));
        } else {
            const float *g = (const float *)gu + t * gs, *u = g + F;
            float *o = (float *)out + t * os;
            for (int64_t i = 0; i < F; i++) o[i] = silu(g[i]) * u[i];
        }
    }
}

/* one row's heads [heads, D] (activations) rotated by cs [D/2, 2] (cos, sin) into out
 * [heads, D] (float32 or bfloat16). interleaved: pairs (2j, 2j+1) as GGUF stores them; else
 * (j, j + D/2). */
static void rotate_row(const char *row, int x_bf16, const float *cs, int64_t heads, int64_t D, int interleaved,
                       char *out, int out_bf16) {
    int64_t half = D / 2, a_step = interleaved ? 2 : 1, b_off = interleaved ? 1 : half;
    for (int64_t i = 0; i < heads * D; i += D)
        for (int64_t j = 0; j < half; j++) {
            int64_t ia = i + j * a_step, ib = ia + b_off;
            float a = load(row, ia, x_bf16), b = load(row, ib, x_bf16), c = cs[2 * j], s = cs[2 * j + 1];
            store(out, ia, a * c - b * s, out_bf16);
            store(out, ib, a * s + b * c, out_bf16);
        }
}

/* x [T, heads, D] (activations, row stride xs, head stride D) rotated by rot [T, D/2, 2]
 * (cos, sin; row stride rs) into out [T, heads, D] (float32, contiguous). */
void rope(const void *x, int64_t xs, int x_bf16, const float *rot, int64_t rs, float *out,
          int64_t T, int64_t heads, int64_t D, int interleaved) {
    for (int64_t t = 0; t < T; t++)
        rotate_row((const char *)x + t * xs * (x_bf16 ? 2 : 4), x_bf16, rot + t * rs, heads, D, interleaved,
                   (char *)(out + t * heads * D), 0);
}

/* A layer's q, k and v from its fused projection qkv [T, (Hq + 2 Hkv) D] (activations, row
 * stride xs): q rotated into q_out [T, Hq, D] (float32); k rotated and v as they are written
 * to cache slot slots[t] ([nslots, Hkv, D] caches, contiguous, float32 or bfloat16; -1 skips
 * the row). Returns 0, or 1 (nothing written) when a slot is out of range. */
int64_t rope_kv(const void *qkv, int64_t xs, int x_bf16, const float *rot, int64_t rs, float *q_out, int64_t T,
                int64_t Hq, int64_t Hkv, int64_t D, int interleaved, void *k_cache, void *v_cache, int cache_bf16,
                const int64_t *slots, int64_t nslots) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < -1 || slots[t] >= nslots) return 1;
    int64_t xsz = x_bf16 ? 2 : 4, csz = cache_bf16 ? 2 : 4, kv = Hkv * D;
    for (int64_t t = 0; t < T; t++) {
        const char *row = (const char *)qkv + t * xs * xsz;
        rotate_row(row, x_bf16, rot + t * rs, Hq, D, interleaved, (char *)(q_out + t * Hq * D), 0);
        if (slots[t] < 0) continue;
        rotate_row(row + Hq * D * xsz, x_bf16, rot + t * rs, Hkv, D, interleaved,
                   (char *)k_cache + slots[t] * kv * csz, cache_bf16);
        const char *v = row + (Hq + Hkv) * D * xsz;
        char *vo = (char *)v_cache + slots[t] * kv * csz;
        for (int64_t i = 0; i < kv; i++) store(vo, i, load(v, i, x_bf16), cache_bf16);
    }
    return 0;
}

/* ---- attention ---------------------------------------------------------------------- */
/* VL float lanes per vector: the CPU's widest (AVX-512: 16; else 8, two of which AVX2 and
 * SSE both handle well). Bits differ between the two widths, never between rows. */
#ifdef __AVX512F__
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
#define MAXG 16        /* query heads per KV head the kernel takes */
#define MAXC (128 / VL)   /* vectors per head row (head dim at most 128) */

/* VL cached elements (float32 or bfloat16) as float32 */
static inline vf loadv(const char *p, int is_bf16) {
    vf f;
    if (is_bf16) {
        vh h;
        memcpy(&h, p, sizeof h);
        vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
}

/* the sum of VL lanes in a fixed tree: halves added, then their halves, ... */
static inline float hsum(vf a) {
#if VL == 16
    v8f b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8f b = a;
#endif
    v4f c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    float d0 = c[0] + c[2], d1 = c[1] + c[3];
    return d0 + d1;
}

/* a query head's row (qv: nc vectors) times one key row (k, as float32), lane by lane: lane l sums
 * the products of elements l, l+VL, ... in order (`hsum` then adds the lanes) */
static inline __attribute__((always_inline)) vf dot_lanes(const vf *qv, const vf *k, int64_t nc) {
    vf acc = qv[0] * k[0];
    for (int64_t c = 1; c < nc; c++) acc += qv[c] * k[c];
    return acc;
}

/* lane i: `hsum`(a[i]), for VL vectors at once. Each level adds the very pairs `hsum` adds (halves,
 * then their halves, then lanes 0+2 and 1+3, then those two), for two vectors' worth per
 * shuffle: the same bits as VL calls of `hsum`, in about a quarter of the instructions. */
static inline __attribute__((always_inline)) vf hsum_each(const vf *a) {
#if VL == 16
    vf x[8], y[4], z[2];
    for (int p = 0; p < 8; p++)   /* lanes 0-7: key 2p's halves added; 8-15: key 2p+1's */
        x[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                       31);
    for (int p = 0; p < 4; p++)   /* 4 lanes per key, keys 4p..4p+3 */
        y[p] = __builtin_shufflevector(x[2 * p], x[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(x[2 * p], x[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int p = 0; p < 2; p++)   /* lanes 2i, 2i+1: key 8p+i's c0+c2 and c1+c3 */
        z[p] = __builtin_shufflevector(y[2 * p], y[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(y[2 * p], y[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    vf y[4], z[2];
    for (int p = 0; p < 4; p++)   /* 4 lanes per key, keys 2p, 2p+1 */
        y[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * p], a[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int p = 0; p < 2; p++)   /* lanes 2i, 2i+1: key 4p+i's c0+c2 and c1+c3 */
        z[p] = __builtin_shufflevector(y[2 * p], y[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(y[2 * p], y[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* one query row t of one KV head group: its G heads' rows of q (qg [G, D]) against the key
 * list (slots), D = nc * VL. The dot products: VL lanes (lane l sums the elements l, l+VL,
 * ...) then `hsum` (`hsum_each` for VL keys at once: the same bits); the softmax:
 * e_j = exp(s_j - max), o = sum_j e_j v_j in key order, over
 * sum_j e_j (in LANES partial sums). */
static inline __attribute__((always_inline)) void group_rows_n(
        const float *qg, int64_t G, int64_t nc, const char *kc, const char *vc, int is_bf16, int64_t row_bytes,
        const int64_t *slots, int64_t L, float scale, float *og, float *scores) {
    int64_t D = nc * VL, esz = is_bf16 ? 2 : 4, whole = L - L % VL;
    vf qv[MAXG][MAXC], kb[VL][MAXC], acc[VL];
    for (int64_t h = 0; h < G; h++)
        for (int64_t c = 0; c < nc; c++) memcpy(&qv[h][c], qg + h * D + c * VL, sizeof qv[h][c]);
    for (int64_t j0 = 0; j0 < L; j0 += VL) {   /* VL keys at a time (loaded once): their sums in one tree */
        int64_t n = j0 < whole ? VL : L - whole;
        for (int64_t i = 0; i < n; i++)
            for (int64_t c = 0; c < nc; c++) kb[i][c] = loadv(kc + slots[j0 + i] * row_bytes + c * VL * esz, is_bf16);
        for (int64_t h = 0; h < G; h++) {
            for (int64_t i = 0; i < n; i++) acc[i] = dot_lanes(qv[h], kb[i], nc);
            if (n == VL) {
                vf s = hsum_each(acc) * scale;
                memcpy(scores + h * L + j0, &s, sizeof s);
            } else {
                for (int64_t i = 0; i < n; i++) scores[h * L + j0 + i] = scale * hsum(acc[i]);
            }
        }
    }
    float inv[MAXG];
    vf o[MAXG][MAXC];
    for (int64_t h = 0; h < G; h++) {
        float *e = scores + h * L, m = max_of(e, L), lanes[LANES] = {0};
        for (int64_t j = 0; j < L; j++) e[j] = exp_f32(e[j] - m);
        int64_t j = 0;
        for (; j + LANES <= L; j += LANES)
            for (int l = 0; l < LANES; l++) lanes[l] += e[j + l];
        for (int l = 0; j < L; j++, l++) lanes[l] += e[j];
        for (int s = LANES / 2; s > 0; s /= 2)
            for (int l = 0; l < s; l++) lanes[l] += lanes[l + s];
        inv[h] = L ? 1.0f / lanes[0] : 0.0f;
        for (int64_t c = 0; c < nc; c++) o[h][c] = (vf){0};
    }
    for (int64_t j = 0; j < L; j++) {
        const char *v = vc + slots[j] * row_bytes;
        vf vv[MAXC];
        for (int64_t c = 0; c < nc; c++) vv[c] = loadv(v + c * VL * esz, is_bf16);
        for (int64_t h = 0; h < G; h++) {
            float e = scores[h * L + j];
            for (int64_t c = 0; c < nc; c++) o[h][c] += e * vv[c];
        }
    }
    for (int64_t h = 0; h < G; h++)
        for (int64_t c = 0; c < nc; c++) {
            vf r = o[h][c] * inv[h];
            memcpy(og + h * D + c * VL, &r, sizeof r);
        }
}

/* `group_rows_n` with the vector count and the cache dtype as constants for the compiler */
static void group_rows(const float *qg, int64_t G, int64_t D, const char *kc, const char *vc, int is_bf16,
                       int64_t row_bytes, const int64_t *slots, int64_t L, float scale, float *og, float *scores) {
#define CASE(NC)                                                                                         \
    if (D == VL * NC) {                                                                                  \
        if (is_bf16) group_rows_n(qg, G, NC, kc, vc, 1, row_bytes, slots, L, scale, og, scores);         \
        else group_rows_n(qg, G, NC, kc, vc, 0, row_bytes, slots, L, scale, og, scores);                 \
        return;                                                                                          \
    }
#if VL == 16
    CASE(4) CASE(8) CASE(1) CASE(2) CASE(3) CASE(5) CASE(6) CASE(7)
#else
    CASE(8) CASE(16) CASE(2) CASE(4) CASE(6) CASE(10) CASE(12) CASE(14)
#endif
#undef CASE
}

/* Every index a batch's attention reads, checked before anything is read: 0, or an error code
 * (1 request, 2 key counts, 3 block ids, 4 tree slots); *longest: the longest key list. */
static int64_t attention_check(int64_t T, int64_t bs, int64_t nblocks, const int64_t *block_tables, int64_t R,
                               int64_t nb, int64_t bts, const int64_t *req, const int64_t *n_cache,
                               const int64_t *extra, int64_t E, const int64_t *n_extra, int64_t *longest) {
    *longest = 0;
    for (int64_t t = 0; t < T; t++) {
        if (req[t] < 0 || req[t] >= R) return 1;
        int64_t n = n_cache[t], ne = n_extra[t];
        if (n < 0 || n > nb * bs || ne < 0 || ne > E || n + ne < 1) return 2;   /* a query sees itself */
        const int64_t *bt = block_tables + req[t] * bts;
        for (int64_t b = 0; b * bs < n; b++)
            if (bt[b] < 0 || bt[b] >= nblocks) return 3;
        for (int64_t j = 0; j < ne; j++)
            if (extra[t * E + j] < 0 || extra[t * E + j] >= nblocks * bs) return 4;
        *longest = n + ne > *longest ? n + ne : *longest;
    }
    return 0;
}

/* Work units [w0, w1) of a checked batch (unit w: query row w / Hkv, its KV head w % Hkv's
 * query group): each unit is computed by the same code whichever range it is in, so a caller
 * may split the units across threads. 0, or 5 when scratch memory cannot be had. */
static int64_t attention_units(const float *q, int64_t Hq, int64_t D, const void *k_cache, const void *v_cache,
                               int cache_bf16, int64_t Hkv, int64_t bs, const int64_t *block_tables, int64_t bts,
                               const int64_t *req, const int64_t *n_cache, const int64_t *extra, int64_t E,
                               const int64_t *n_extra, float scale, float *out, int64_t longest, int64_t w0,
                               int64_t w1) {
    int64_t G = Hq / Hkv, row_bytes = Hkv * D * (cache_bf16 ? 2 : 4), head_bytes = D * (cache_bf16 ? 2 : 4);
    float *scores = (float *)malloc(sizeof(float) * (size_t)(G * longest + 1));
    int64_t *slots = (int64_t *)malloc(sizeof(int64_t) * (size_t)(longest + 1));
    if (!scores || !slots) {
        free(scores);
        free(slots);
        return 5;
    }
    for (int64_t w = w0, row = -1; w < w1; w++) {
        int64_t t = w / Hkv, g = w % Hkv, n = n_cache[t], L = n + n_extra[t];
        if (t != row) {   /* this row's key slots: its context in cache order, then its tree keys */
            const int64_t *bt = block_tables + req[t] * bts;
            for (int64_t j = 0; j < n; j++) slots[j] = bt[j / bs] * bs + j % bs;
            for (int64_t j = n; j < L; j++) slots[j] = extra[t * E + (j - n)];
            row = t;
        }
        group_rows(q + (t * Hq + g * G) * D, G, D, (const char *)k_cache + g * head_bytes,
                   (const char *)v_cache + g * head_bytes, cache_bf16, row_bytes, slots, L, scale,
                   out + (t * Hq + g * G) * D, scores);
    }
    free(scores);
    free(slots);
    return 0;
}

/* Causal paged attention, one query row at a time: query t (request req[t]) sees the first
 * n_cache[t] keys of its request in cache order (through its block table row), then the
 * n_extra[t] keys at slots extra[t, :] (a tree's ancestors and itself, in chain order); its
 * output depends only on those keys and their order (`group_rows`).
 *
 * q [T, Hq, D] float32 contiguous, D a multiple of 16 and at most 128, Hq / Hkv at most MAXG;
 * caches [nblocks * bs, Hkv, D] contiguous (float32 or bfloat16, slot = block * bs + offset);
 * block_tables [R, nb] int64 (row stride bts); extra [T, E] int64; out [T, Hq, D] float32.
 * Every index is checked before anything is computed: returns 0, or 1 for a request index,
 * 2 for a key count, 3 for a block id, 4 for a slot out of range, 5 when out of memory. */
int64_t attention(const float *q, int64_t T, int64_t Hq, int64_t D, const void *k_cache, const void *v_cache,
                  int cache_bf16, int64_t Hkv, int64_t bs, int64_t nblocks, const int64_t *block_tables, int64_t R,
                  int64_t nb, int64_t bts, const int64_t *req, const int64_t *n_cache, const int64_t *extra, int64_t E,
                  const int64_t *n_extra, float scale, float *out) {
    int64_t longest, err = attention_check(T, bs, nblocks, block_tables, R, nb, bts, req, n_cache, extra, E, n_extra,
                                           &longest);
    if (err) return err;
    return attention_units(q, Hq, D, k_cache, v_cache, cache_bf16, Hkv, bs, block_tables, bts, req, n_cache, extra, E,
                           n_extra, scale, out, longest, 0, T * Hkv);
}
