/* Weights as stored (int4 Q4_0/Q4_1 blocks, int8 Q8_0 blocks) times rows quantized to int8 per
 * 32 (`hal.models.q4_rows`), as integer dot products (AVX-512 VNNI, else AVX2, else plain C):
 * llama.cpp's arithmetic for Q4_1 x Q8_1 and Q8_0 x Q8_0, with a second int8 code per input for
 * the residual, so a row keeps about 15 bits instead of 8. The weights are read once for up to
 * 8 rows, so 8 rows cost a few times one row instead of eight.
 *
 * Glossary (shapes: a weight [N, K], N a multiple of 16, K of 32; G = K / 32 groups):
 * - **codes** q in 0..15 and fp16 ``d``, ``m`` per 32 weights of an output row: w = d*q + m
 *   (a GGUF Q4_1 block as stored; Q4_0 is m = -8d).
 * - **tile**: 16 outputs. Per (tile, group), 256 bytes of codes in 4 steps of 64: byte
 *   4*lane + j of step s holds, low nibble, the code of k = 32g + 8s + j and, high nibble,
 *   of k = 32g + 8s + 4 + j (j = 0..3), for output 16*tile + lane; then ``d`` and ``m`` as
 *   16 fp16 each. So one 64-byte load feeds 16 lanes of 4-byte integer dot products.
 * - **Q8 tile** (Q8_0: w = d*q, q in -128..127): per (tile, group), 512 bytes of codes in 8
 *   steps of 64: byte 4*lane + j of step s holds q + 128 for k = 32g + 4s + j; then 16 fp16 d.
 * - **Q4K tile** (Q4_K: w = d*scale*q - dmin*min per 32 weights, 6-bit scale and min, fp16 d
 *   and dmin per super-block of 256 inputs): per (tile, group), a Q4 tile's 256 bytes of codes,
 *   then 16 u8 scales and 16 u8 mins; per (tile, super-block), before its 8 groups, a head of 16
 *   fp16 d and 16 fp16 -dmin (as the file keeps them: 4.625 bits a weight). Its d and m are
 *   formed as d*scale and (-dmin)*min (exact float32 products), then as Q4.
 * - **Q40 tile** (Q4_0: w = d*(q - 8)): a Q4 tile without its m; the kernel forms m = d*(-8), the
 *   float32 value a Q4 tile would store, so the arithmetic and its bits are the Q4 tile's.
 * - **Q5 tile** (Q5_0: w = d*(q - 16), q in 0..31, fp16 d): a Q40 tile of q's low 4 bits whose m
 *   is d*(-16), then 64 bytes of q's fifth bits: bit 2s of byte 4*lane + j is that of the
 *   low-nibble code of step s, bit 2s + 1 that of the high-nibble code.
 * - **Q5K tile** (Q5_K: Q4_K's arithmetic with codes 0..31): a Q4K tile whose groups each end
 *   with the fifth bits as a Q5 tile's.
 * - **Q6 tile** (Q6_K: w = s*q, q = the 6-bit code c - 32, s = d*scale per 16 weights with fp16
 *   d and int8 scale, so s is a float32 value exactly): per (tile, group), 4 nibble blocks of 64
 *   bytes (block p: c's low 4 bits of steps 2p and, high nibble, 2p + 1, in the Q8 tile's byte
 *   order), 2 high blocks of 64 (block h: bits 2i..2i+1 hold c's top 2 bits of step 4h + i),
 *   16 int8 scales of the group's first 16 inputs and 16 of its last 16; per (tile, super-block
 *   of 256 inputs), before its 8 groups, a head of 16 fp16 d.
 * - **quantized row**: per 32 inputs, amax = max |x|, u = x * (127 / amax), hi = round(u) in
 *   -127..127 and lo = round(128 (u - hi)) in -64..64 (half to even; 0 where amax is 0), so
 *   x ~ unit * (128 hi + lo) with unit = (amax / 127) / 128; qsum = sum(128 hi + lo), xs =
 *   unit * qsum. A group with an inf or NaN gets unit = NaN: its products are NaN. A row of **one
 *   code** (llama.cpp's int8 rows: `Q4Weight.codes` 1) has lo = 0: the same steps, and the tiles
 *   leave the lo chains out (half the integer dot products), so its bits are what the two-code
 *   arithmetic gives for it.
 *
 * Q4: y[n] = sum over g, in order, of: y = y + d*(unit*isum); y = y + m*xs. Q8: y = y +
 * d*(unit*isum). Q6: y = y + s0*(unit*isum0); y = y + s1*(unit*isum1), over the group's two
 * halves (s = d*scale, one exact float32 product). isum = sum of q*(128 hi + lo) over the group (or half), an exact integer on every path
 * (its conversion to float32 rounds to nearest, as every path converts). Every float step is
 * one float32 rounding (no contraction: -ffp-contract=off), the same on every code path, for
 * every row count: a row's bits never depend on its batch-mates or on the CPU's vector width.
 * Single-threaded over a range of tiles; the caller splits tiles across threads (a tile's bits
 * do not depend on the split). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define Q4_AVX512 1
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define Q4_AVX2 1
#endif

enum { Q4_KIND = 0, Q8_KIND = 1, Q6_KIND = 2, Q4K_KIND = 3, Q5_KIND = 4, Q5K_KIND = 5, Q40_KIND = 6 };   /* a packed weight's tiles */
#define Q4_TILE_BYTES 320   /* per (tile, group): 256 bytes of codes, 16 fp16 d, 16 fp16 m */
#define Q8_TILE_BYTES 544   /* per (tile, group): 512 bytes of codes + 128, 16 fp16 d */
#define Q4K_TILE_BYTES 288  /* per (tile, group): 256 bytes of codes, 16 u8 scales, 16 u8 mins; d, -dmin per super-block */
#define Q5_TILE_BYTES 352   /* per (tile, group): a Q40 tile whose m is -16d, then 64 bytes of fifth bits */
#define Q40_TILE_BYTES 288  /* per (tile, group): 256 bytes of codes, 16 fp16 d (m = -8d is formed, not stored) */
#define Q5K_TILE_BYTES 352  /* per (tile, group): a Q4K tile's group, then 64 bytes of fifth bits */
#define Q6_TILE_BYTES 416   /* per (tile, group): 256 + 128 bytes of 6-bit codes, 2 x 16 int8 scales; d per super-block */
/* The K-quant tiles keep their super-block's fp16 values once per 8 groups (256 inputs), as the
 * file does: per (tile, super-block), a head (Q4K, Q5K: 16 d, then 16 -dmin, 64 bytes; Q6: 16 d,
 * 32 bytes) and the 8 groups after it. So K is a multiple of 256 for these kinds. */
enum { Q4K_HEAD = 64, Q6_HEAD = 32 };   /* a super-block head's bytes */
#define Q4_GROUP(wt, g, BYTES, KQ) \
    ((KQ) ? (wt) + ((g) >> 3) * (Q4K_HEAD + 8 * (BYTES)) + Q4K_HEAD + ((g) & 7) * (BYTES) : (wt) + (g) * (BYTES))
#define Q4K_SUPER(wt, g, BYTES) ((wt) + ((g) >> 3) * (Q4K_HEAD + 8 * (BYTES)))
#define Q6_GROUP(wt, g) ((wt) + ((g) >> 3) * (Q6_HEAD + 8 * Q6_TILE_BYTES) + Q6_HEAD + ((g) & 7) * Q6_TILE_BYTES)
#define Q6_SUPER(wt, g) ((wt) + ((g) >> 3) * (Q6_HEAD + 8 * Q6_TILE_BYTES))
/* rows multiplied together per pass over a tile's weights: what the ISA's vector registers hold
 * (per row: an output and two accumulators; AVX-512 has 32 registers, AVX2 16) */
#if defined(Q4_AVX512)
#define Q4_ROWS 8
#else
#define Q4_ROWS 4
#endif

/* four int8 codes as one int32 (a broadcast feeds each lane's 4-byte dot product) */
static inline int32_t q4_x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float q4_half(uint16_t h) {
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, f = h & 1023, u;
    if (e == 0) {
        float v = ldexpf((float)f, -24);
        return s ? -v : v;
    }
    u = e == 31 ? s | 0x7f800000u | (f << 13) : s | ((e + 112) << 23) | (f << 13);
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* Quantize T rows x [T, K] (float32, or bfloat16 where is_bf16; row stride x_row elements)
 * per 32 (see "quantized row"): xq [T, 2K] int8 (per row and group: its 32 hi codes, then its
 * 32 lo codes, so a tile reads one stream of them); sxs [T, G, 2] float32: each group's unit and
 * xs side by side (one stream again); qsum [T, G] int32. */
void q4_quantize_rows(const void *x, int is_bf16, int64_t T, int64_t K, int64_t x_row, int one_code, int8_t *xq,
                      float *sxs, int32_t *qsum) {
    int64_t G = K / 32;
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < G; g++) {
            float v[32], amax = 0.f;
            int bad = 0;
            for (int j = 0; j < 32; j++) {
                int64_t i = t * x_row + g * 32 + j;
                if (is_bf16) {
                    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
                    memcpy(&v[j], &u, 4);
                } else {
                    v[j] = ((const float *)x)[i];
                }
                float a = fabsf(v[j]);
                amax = a > amax ? a : amax;
                bad |= !isfinite(v[j]);
            }
            float inv = amax > 0.f && !bad ? 127.f / amax : 0.f;
            int8_t *hi = xq + t * 2 * K + g * 64, *lo = hi + 32;
            int32_t sum = 0;
            for (int j = 0; j < 32; j++) {
                float u = bad ? 0.f : v[j] * inv;
                float h = nearbyintf(u);   /* the default rounding: half to even */
                h = h > 127.f ? 127.f : (h < -127.f ? -127.f : h);
                float l = one_code ? 0.f : nearbyintf((u - h) * 128.f);   /* |u - h| <= 1/2 (exact): -64..64 */
                hi[j] = (int8_t)h;
                lo[j] = (int8_t)l;
                sum += 128 * hi[j] + lo[j];
            }
            float unit = bad ? NAN : amax / 127.f * 0.0078125f;   /* the step of lo: (amax / 127) / 128 */
            sxs[2 * (t * G + g)] = unit;
            sxs[2 * (t * G + g) + 1] = unit * (float)sum;
            qsum[t * G + g] = sum;
        }
}

/* One tile's 16 outputs for R rows (R a constant in each expansion, so the accumulators stay
 * in registers): y[r][lane] over every group g in order (see the header for the steps). */
#if defined(Q4_AVX512)
static inline __m512i q5_bit_512(__m512i hb, int b) {   /* bit b of each byte moved to bit 4 */
    return b < 4 ? _mm512_slli_epi16(hb, 4 - b) : b == 4 ? hb : _mm512_srli_epi16(hb, b - 4);
}
#define Q4_TILE_OF(NAME, R, BYTES, KQ, Q5, MD, LO)                                                         \
    static void NAME##_##R(const uint8_t *wt, int64_t G, const int8_t *xq, int64_t K, const float *sxs, \
                            float *y, int64_t y_row) {                                                 \
        const __m512i mask = _mm512_set1_epi8(0x0f), fifth = _mm512_set1_epi8(0x10);                   \
        __m512 out[R];                                                                                 \
        for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();                                      \
        for (int64_t g = 0; g < G; g++) {                                                              \
            const uint8_t *blk = Q4_GROUP(wt, g, BYTES, KQ), *dm = KQ ? Q4K_SUPER(wt, g, BYTES) : blk + 256; \
            __m512i acc[R], acc2[R];   /* per row: the hi codes' chain, the lo codes' chain */        \
            for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm512_setzero_si512();                     \
            const __m512i hb = Q5 ? _mm512_loadu_si512((const void *)(blk + 288)) : mask;            \
            for (int s = 0; s < 4; s++) {                                                              \
                __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * s));                          \
                __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask); \
                if (Q5) {   /* bits 2s, 2s + 1 of each byte to bit 4 (16-bit shifts: what crosses bytes \
                             * lands outside bit 4), or-ed in */                                       \
                    lo = _mm512_or_si512(lo, _mm512_and_si512(q5_bit_512(hb, 2 * s), fifth));        \
                    hi = _mm512_or_si512(hi, _mm512_and_si512(q5_bit_512(hb, 2 * s + 1), fifth));    \
                }                                                                                      \
                for (int r = 0; r < R; r++) {                                                          \
                    const int8_t *xr = xq + r * 2 * K + 64 * g + 8 * s;                                \
                    acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(q4_x4(xr)));                    \
                    if (LO) acc2[r] = _mm512_dpbusd_epi32(acc2[r], lo, _mm512_set1_epi32(q4_x4(xr + 32)));      \
                    acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(q4_x4(xr + 4)));                \
                    if (LO) acc2[r] = _mm512_dpbusd_epi32(acc2[r], hi, _mm512_set1_epi32(q4_x4(xr + 36)));  \
                }                                                                                      \
            }                                                                                          \
            for (int r = 0; r < R; r++)                                                                \
                acc[r] = _mm512_add_epi32(_mm512_slli_epi32(acc[r], 7), acc2[r]);   /* 128 hi + lo */  \
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dm));                       \
            __m512 m = MD ? _mm512_mul_ps(d, _mm512_set1_ps(-(float)MD))   /* -MD*d: exact */         \
                          : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm + 32)));           \
            if (KQ) {   /* Q4_K: d*scale and -dmin*min, exact float32 products */                      \
                d = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(                          \
                    _mm_loadu_si128((const __m128i *)(blk + 256)))));                                  \
                m = _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(                          \
                    _mm_loadu_si128((const __m128i *)(blk + 272)))));                                  \
            }                                                                                          \
            for (int r = 0; r < R; r++) {                                                              \
                __m512 t = _mm512_mul_ps(_mm512_set1_ps(sxs[2 * (r * G + g)]), _mm512_cvtepi32_ps(acc[r]));   \
                __m512 u = _mm512_mul_ps(d, t), w = _mm512_mul_ps(m, _mm512_set1_ps(sxs[2 * (r * G + g) + 1]));   \
                out[r] = _mm512_add_ps(_mm512_add_ps(out[r], u), w);                                  \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * y_row, out[r]);                          \
    }
#elif defined(Q4_AVX2)
static inline __m256i q5_bit_256(__m256i hb, int b) {   /* bit b of each byte moved to bit 4 */
    return b < 4 ? _mm256_slli_epi16(hb, 4 - b) : b == 4 ? hb : _mm256_srli_epi16(hb, b - 4);
}
#define Q4_TILE_OF(NAME, R, BYTES, KQ, Q5, MD, LO)                                                         \
    static void NAME##_##R(const uint8_t *wt, int64_t G, const int8_t *xq, int64_t K, const float *sxs, \
                            float *y, int64_t y_row) {                                                 \
        const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);                      \
        const __m256i fifth = _mm256_set1_epi8(0x10);                                                  \
        for (int half = 0; half < 2; half++) {                                                         \
            __m256 out[R];                                                                             \
            for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                                  \
            for (int64_t g = 0; g < G; g++) {                                                          \
                const uint8_t *blk = Q4_GROUP(wt, g, BYTES, KQ), *dm = KQ ? Q4K_SUPER(wt, g, BYTES) : blk + 256; \
                __m256i acc[R], acc2[R];                                                               \
                for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm256_setzero_si256();                 \
                const __m256i hb = Q5 ? _mm256_loadu_si256((const __m256i *)(blk + 288 + 32 * half)) : mask; \
                for (int s = 0; s < 4; s++) {                                                          \
                    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * s + 32 * half));       \
                    __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask); \
                    if (Q5) {   /* codes <= 31: each maddubs pair sum <= 2 * 31 * 127, two <= 15748 */ \
                        lo = _mm256_or_si256(lo, _mm256_and_si256(q5_bit_256(hb, 2 * s), fifth));    \
                        hi = _mm256_or_si256(hi, _mm256_and_si256(q5_bit_256(hb, 2 * s + 1), fifth)); \
                    }                                                                                  \
                    for (int r = 0; r < R; r++) {                                                      \
                        const int8_t *xr = xq + r * 2 * K + 64 * g + 8 * s;                            \
                        /* |each 16-bit pair sum| <= 2 * 15 * 127, their sum <= 4 * 15 * 127: exact */ \
                        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(q4_x4(xr))),   \
                                                     _mm256_maddubs_epi16(hi, _mm256_set1_epi32(q4_x4(xr + 4)))); \
                        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, ones));                 \
                        if (LO) {                                                                      \
                            __m256i q = _mm256_add_epi16(                                              \
                                _mm256_maddubs_epi16(lo, _mm256_set1_epi32(q4_x4(xr + 32))),           \
                                _mm256_maddubs_epi16(hi, _mm256_set1_epi32(q4_x4(xr + 36))));          \
                            acc2[r] = _mm256_add_epi32(acc2[r], _mm256_madd_epi16(q, ones));           \
                        }                                                                              \
                    }                                                                                  \
                }                                                                                      \
                for (int r = 0; r < R; r++) acc[r] = _mm256_add_epi32(_mm256_slli_epi32(acc[r], 7), acc2[r]); \
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + 16 * half)));       \
                __m256 m = MD ? _mm256_mul_ps(d, _mm256_set1_ps(-(float)MD))                          \
                              : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + 32 + 16 * half))); \
                if (KQ) {                                                                              \
                    d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(                      \
                        _mm_loadl_epi64((const __m128i *)(blk + 256 + 8 * half)))));                   \
                    m = _mm256_mul_ps(m, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(                      \
                        _mm_loadl_epi64((const __m128i *)(blk + 272 + 8 * half)))));                   \
                }                                                                                      \
                for (int r = 0; r < R; r++) {                                                          \
                    __m256 t = _mm256_mul_ps(_mm256_set1_ps(sxs[2 * (r * G + g)]), _mm256_cvtepi32_ps(acc[r])); \
                    __m256 u = _mm256_mul_ps(d, t), w = _mm256_mul_ps(m, _mm256_set1_ps(sxs[2 * (r * G + g) + 1])); \
                    out[r] = _mm256_add_ps(_mm256_add_ps(out[r], u), w);                               \
                }                                                                                      \
            }                                                                                          \
            for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * y_row + 8 * half, out[r]);            \
        }                                                                                              \
    }
#else
#define Q4_TILE_OF(NAME, R, BYTES, KQ, Q5, MD, LO)   /* LO unread: a one-code row's lo codes are 0 */     \
    static void NAME##_##R(const uint8_t *wt, int64_t G, const int8_t *xq, int64_t K, const float *sxs, \
                            float *y, int64_t y_row) {                                                 \
        for (int r = 0; r < R; r++)                                                                    \
            for (int lane = 0; lane < 16; lane++) {                                                    \
                float out = 0.f;                                                                       \
                for (int64_t g = 0; g < G; g++) {                                                      \
                    const uint8_t *blk = Q4_GROUP(wt, g, BYTES, KQ), *dm = KQ ? Q4K_SUPER(wt, g, BYTES) : blk + 256; \
                    const int8_t *x = xq + r * 2 * K + 64 * g, *xl = x + 32;                            \
                    int32_t acc = 0;                                                                   \
                    for (int s = 0; s < 4; s++)                                                        \
                        for (int j = 0; j < 4; j++) {                                                  \
                            uint8_t c = blk[64 * s + 4 * lane + j], h = Q5 ? blk[288 + 4 * lane + j] : 0; \
                            int k0 = 8 * s + j, k1 = 8 * s + 4 + j;                                    \
                            int c0 = (c & 15) | (((h >> (2 * s)) & 1) << 4), c1 = (c >> 4) | (((h >> (2 * s + 1)) & 1) << 4); \
                            acc += c0 * (128 * x[k0] + xl[k0]) + c1 * (128 * x[k1] + xl[k1]);          \
                        }                                                                              \
                    uint16_t dh, mh;                                                                   \
                    memcpy(&dh, dm + 2 * lane, 2);                                                     \
                    if (!MD) memcpy(&mh, dm + 32 + 2 * lane, 2);                                       \
                    float t = sxs[2 * (r * G + g)] * (float)acc;                                              \
                    float dd = q4_half(dh), mm = MD ? dd * -(float)MD : q4_half(mh);                   \
                    if (KQ) {                                                                          \
                        dd = dd * (float)blk[256 + lane];                                              \
                        mm = mm * (float)blk[272 + lane];                                              \
                    }                                                                                  \
                    float u = dd * t, w = mm * sxs[2 * (r * G + g) + 1];                                          \
                    out = (out + u) + w;                                                               \
                }                                                                                      \
                y[r * y_row + lane] = out;                                                             \
            }                                                                                          \
    }
#endif
#include "q8_tiles.c"   /* the tiles of one byte a code: Q8 (Q8_0) and Q6 (Q6_K) */
/* Each kind's tile for R = 1..8 rows, twice: for rows of two codes (hi and lo: NAME) and of one
 * (lo all 0, its chains left out: NAME1, the same bits for such rows as NAME's). */
#define Q4_R(M) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8)
#define Q4_FNS(NAME) {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8}
#define Q4_BOTH(NAME, R, BYTES, KQ, Q5, MD) \
    Q4_TILE_OF(NAME, R, BYTES, KQ, Q5, MD, 1) Q4_TILE_OF(NAME##1, R, BYTES, KQ, Q5, MD, 0)
#define Q4_TILE(R) Q4_BOTH(q4_tile, R, Q4_TILE_BYTES, 0, 0, 0)
#define Q40_TILE(R) Q4_BOTH(q40_tile, R, Q40_TILE_BYTES, 0, 0, 8)
#define Q4K_TILE(R) Q4_BOTH(q4k_tile, R, Q4K_TILE_BYTES, 1, 0, 0)
#define Q5_TILE(R) Q4_BOTH(q5_tile, R, Q5_TILE_BYTES, 0, 1, 16)
#define Q5K_TILE(R) Q4_BOTH(q5k_tile, R, Q5K_TILE_BYTES, 1, 1, 0)
#define Q8_TILE(R) Q8_TILE_OF(q8_tile, R, 1) Q8_TILE_OF(q8_tile1, R, 0)
#define Q6_TILE(R) Q6_TILE_OF(q6_tile, R, 1) Q6_TILE_OF(q6_tile1, R, 0)
Q4_R(Q4_TILE)
Q4_R(Q40_TILE)
Q4_R(Q4K_TILE)
Q4_R(Q5_TILE)
Q4_R(Q5K_TILE)
Q4_R(Q8_TILE)
Q4_R(Q6_TILE)

typedef void (*q4_tile_fn)(const uint8_t *, int64_t, const int8_t *, int64_t, const float *, float *, int64_t);
typedef void (*q8_tile_fn)(const uint8_t *, int64_t, const int8_t *, int64_t, const float *, const int32_t *,
                           float *, int64_t);
/* [two codes][R] */
static const q4_tile_fn q4_tiles[2][9] = {Q4_FNS(q4_tile1), Q4_FNS(q4_tile)};
static const q8_tile_fn q8_tiles[2][9] = {Q4_FNS(q8_tile1), Q4_FNS(q8_tile)};
static const q4_tile_fn q40_tiles[2][9] = {Q4_FNS(q40_tile1), Q4_FNS(q40_tile)};
static const q4_tile_fn q4k_tiles[2][9] = {Q4_FNS(q4k_tile1), Q4_FNS(q4k_tile)};
static const q4_tile_fn q5_tiles[2][9] = {Q4_FNS(q5_tile1), Q4_FNS(q5_tile)};
static const q4_tile_fn q5k_tiles[2][9] = {Q4_FNS(q5k_tile1), Q4_FNS(q5k_tile)};
static const q8_tile_fn q6_tiles[2][9] = {Q4_FNS(q6_tile1), Q4_FNS(q6_tile)};

/* Each half-group's sum of (128 hi + lo) of T quantized rows xq [T, 2K]: qsum16 [T, 2G]. */
void q4_half_sums(const int8_t *xq, int64_t T, int64_t K, int32_t *qsum16) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < K / 16; h++) {
            int32_t sum = 0;
            for (int j = 0; j < 16; j++) sum += 128 * xq[t * 2 * K + 64 * (h >> 1) + 16 * (h & 1) + j] + xq[t * 2 * K + 64 * (h >> 1) + 32 + 16 * (h & 1) + j];
            qsum16[t * (K / 16) + h] = sum;
        }
}

/* Output tiles [tile0, tile1) of y [T, N] (float32, row stride y_row) for the quantized rows
 * (xq [T, 2K]; sxs [T, G, 2]; qsum [T, G]; qsum16 [T, 2G], read for Q6 only) and the packed weight w
 * (tiles x groups x the kind's tile bytes; kind: Q4_KIND, Q8_KIND, Q6_KIND, Q4K_KIND, Q5_KIND or Q5K_KIND). */
void q4_mm_tiles(const uint8_t *w, int kind, int one_code, int64_t K, const int8_t *xq, const float *sxs,
                 const int32_t *qsum, const int32_t *qsum16, int64_t T, float *y, int64_t y_row, int64_t tile0,
                 int64_t tile1) {
    int two = !one_code;
    int64_t G = K / 32, bytes = kind == Q8_KIND ? Q8_TILE_BYTES : kind == Q6_KIND ? Q6_TILE_BYTES + Q6_HEAD / 8
                                : kind == Q4K_KIND ? Q4K_TILE_BYTES + Q4K_HEAD / 8 : kind == Q5_KIND ? Q5_TILE_BYTES
                                : kind == Q5K_KIND ? Q5K_TILE_BYTES + Q4K_HEAD / 8 : kind == Q40_KIND ? Q40_TILE_BYTES
                                : Q4_TILE_BYTES;   /* a tile's bytes per group (with its share of the heads) */
    for (int64_t t0 = 0, passes = (T + Q4_ROWS - 1) / Q4_ROWS; t0 < T; passes--) {
        int R = (int)((T - t0 + passes - 1) / passes);   /* rows split evenly: 9 = 5 + 4, not 8 + 1 */
        for (int64_t tile = tile0; tile < tile1; tile++) {
            const uint8_t *wt = w + tile * G * bytes;
            float *yt = y + t0 * y_row + 16 * tile;
            if (kind == Q8_KIND)
                q8_tiles[two][R](wt, G, xq + t0 * 2 * K, K, sxs + 2 * t0 * G, qsum + t0 * G, yt, y_row);
            else if (kind == Q6_KIND)
                q6_tiles[two][R](wt, G, xq + t0 * 2 * K, K, sxs + 2 * t0 * G, qsum16 + t0 * 2 * G, yt, y_row);
            else
                (kind == Q4K_KIND ? q4k_tiles : kind == Q5_KIND ? q5_tiles : kind == Q5K_KIND ? q5k_tiles
                 : kind == Q40_KIND ? q40_tiles : q4_tiles)[two][R](wt, G, xq + t0 * 2 * K, K, sxs + 2 * t0 * G, yt,
                                                             y_row);
        }
        t0 += R;
    }
}
