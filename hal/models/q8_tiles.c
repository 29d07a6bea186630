/* The tiles of one byte a code: Q8 (Q8_0 as stored) and Q6 (Q6_K's 6-bit codes unpacked to bytes).
 * Their layouts and arithmetic: q4_rows.c's header, which includes this file after its Q4 tiles'
 * macros, so the same vector path is compiled (AVX-512 VNNI, AVX2 or C). */
/* One tile's 16 outputs of a Q8 weight for R rows: y[r][lane] over every group in order. */
#if defined(Q4_AVX512)
#define Q8_TILE_OF(NAME, R, LO)                                                                        \
    static void NAME##_##R(const uint8_t *wt, int64_t G, const int8_t *xq, int64_t K, const float *sxs, \
                            const int32_t *qsum, float *y, int64_t y_row) {                            \
        __m512 out[R];                                                                                 \
        for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();                                      \
        for (int64_t g = 0; g < G; g++) {                                                              \
            const uint8_t *blk = wt + g * Q8_TILE_BYTES;                                               \
            __m512i acc[R], acc2[R];   /* per row: the hi codes' chain, the lo codes' chain */        \
            for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm512_setzero_si512();                     \
            for (int s = 0; s < 8; s++) {                                                              \
                __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * s));   /* q + 128 */          \
                for (int r = 0; r < R; r++) {                                                          \
                    const int8_t *xr = xq + r * 2 * K + 64 * g + 4 * s;                                \
                    acc[r] = _mm512_dpbusd_epi32(acc[r], v, _mm512_set1_epi32(q4_x4(xr)));                     \
                    if (LO) acc2[r] = _mm512_dpbusd_epi32(acc2[r], v, _mm512_set1_epi32(q4_x4(xr + 32)));       \
                }                                                                                      \
            }                                                                                          \
            for (int r = 0; r < R; r++)   /* sum (q + 128)(128 hi + lo), exact in int32 */            \
                acc[r] = _mm512_add_epi32(_mm512_slli_epi32(acc[r], 7), acc2[r]);                     \
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 512)));              \
            for (int r = 0; r < R; r++) {                                                              \
                __m512i isum = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(128 * qsum[r * G + g]));     \
                __m512 t = _mm512_mul_ps(_mm512_set1_ps(sxs[2 * (r * G + g)]), _mm512_cvtepi32_ps(isum));     \
                out[r] = _mm512_add_ps(out[r], _mm512_mul_ps(d, t));                                   \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * y_row, out[r]);                          \
    }
#elif defined(Q4_AVX2)
/* One step of signed codes w (one per byte) times a row's hi and lo codes (xr, xr + 32: four each,
 * broadcast), added into acc and acc2. AVX2 has no signed-by-signed byte product, so |q| times
 * sign(q)·x: each 16-bit pair sum <= 2 * 128 * 127, no saturation. */
static inline void q8_step_avx2(__m256i w, const int8_t *xr, __m256i *acc, __m256i *acc2, int lo) {
    const __m256i ones = _mm256_set1_epi16(1), aw = _mm256_sign_epi8(w, w);
    __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(q4_x4(xr)), w));
    *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(p, ones));
    if (lo) {   /* (a one-code row's lo codes are 0: left out) */
        __m256i pl = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(q4_x4(xr + 32)), w));
        *acc2 = _mm256_add_epi32(*acc2, _mm256_madd_epi16(pl, ones));
    }
}
#define Q8_TILE_OF(NAME, R, LO)                                                                        \
    static void NAME##_##R(const uint8_t *wt, int64_t G, const int8_t *xq, int64_t K, const float *sxs, \
                            const int32_t *qsum, float *y, int64_t y_row) {                            \
        const __m256i flip = _mm256_set1_epi8((char)0x80);                                             \
        (void)qsum;                                                                                    \
        for (int half = 0; half < 2; half++) {                                                         \
            __m256 out[R];                                                                             \
            for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                                  \
            for (int64_t g = 0; g < G; g++) {                                                          \
                const uint8_t *blk = wt + g * Q8_TILE_BYTES;                                           \
                __m256i acc[R], acc2[R];                                                               \
                for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm256_setzero_si256();                 \
                for (int s = 0; s < 8; s++) {                                                          \
                    __m256i w = _mm256_xor_si256(                                                      \
                        _mm256_loadu_si256((const __m256i *)(blk + 64 * s + 32 * half)), flip);  /* q */ \
                    for (int r = 0; r < R; r++)                                                        \
                        q8_step_avx2(w, xq + r * 2 * K + 64 * g + 4 * s, &acc[r], &acc2[r], LO);    \
                }                                                                                      \
                for (int r = 0; r < R; r++) acc[r] = _mm256_add_epi32(_mm256_slli_epi32(acc[r], 7), acc2[r]); \
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 512 + 16 * half))); \
                for (int r = 0; r < R; r++) {                                                          \
                    __m256 t = _mm256_mul_ps(_mm256_set1_ps(sxs[2 * (r * G + g)]), _mm256_cvtepi32_ps(acc[r])); \
                    out[r] = _mm256_add_ps(out[r], _mm256_mul_ps(d, t));                               \
                }                                                                                      \
            }                                                                                          \
            for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * y_row + 8 * half, out[r]);            \
        }                                                                                              \
    }
#else
#define Q8_TILE_OF(NAME, R, LO)                                                                        \
    static void NAME##_##R(const uint8_t *wt, int64_t G, const int8_t *xq, int64_t K, const float *sxs, \
                            const int32_t *qsum, float *y, int64_t y_row) {                            \
        (void)qsum;                                                                                    \
        for (int r = 0; r < R; r++)                                                                    \
            for (int lane = 0; lane < 16; lane++) {                                                    \
                float out = 0.f;                                                                       \
                for (int64_t g = 0; g < G; g++) {                                                      \
                    const uint8_t *blk = wt + g * Q8_TILE_BYTES;                                       \
                    const int8_t *x = xq + r * 2 * K + 64 * g, *xl = x + 32;                            \
                    int32_t acc = 0;                                                                   \
                    for (int s = 0; s < 8; s++)                                                        \
                        for (int j = 0; j < 4; j++)                                                    \
                            acc += ((int)blk[64 * s + 4 * lane + j] - 128) * (128 * x[4 * s + j] + xl[4 * s + j]); \
                    uint16_t dh;                                                                       \
                    memcpy(&dh, blk + 512 + 2 * lane, 2);                                              \
                    float t = sxs[2 * (r * G + g)] * (float)acc;                                              \
                    out = out + q4_half(dh) * t;                                                       \
                }                                                                                      \
                y[r * y_row + lane] = out;                                                             \
            }                                                                                          \
    }
#endif
/* One tile's 16 outputs of a Q6 weight for R rows; qsum16 [R, 2G]: each half-group's sum of
 * (128 hi + lo) (the AVX-512 path's -32 correction). Step s's codes (the Q8 tile's byte order)
 * are the low nibbles of nibble block s / 2 (s odd: its high nibbles) with, as bits 4-5, bits
 * 2i..2i+1 of high block s / 4 (i = s % 4). */
#if defined(Q4_AVX512)
#define Q6_TILE_OF(NAME, R, LO)                                                                        \
    static void NAME##_##R(const uint8_t *wt, int64_t G, const int8_t *xq, int64_t K, const float *sxs, \
                            const int32_t *qsum16, float *y, int64_t y_row) {                          \
        const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);                      \
        __m512 out[R];                                                                                 \
        for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();                                      \
        for (int64_t g = 0; g < G; g++) {                                                              \
            const uint8_t *blk = Q6_GROUP(wt, g);                                                      \
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)Q6_SUPER(wt, g)));          \
            for (int h = 0; h < 2; h++) {                                                              \
                __m512i hb = _mm512_loadu_si512((const void *)(blk + 256 + 64 * h));                   \
                __m512i acc[R], acc2[R];                                                               \
                for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm512_setzero_si512();                 \
                for (int i = 0; i < 4; i++) {                                                          \
                    int s = 4 * h + i;                                                                 \
                    __m512i nb = _mm512_loadu_si512((const void *)(blk + 64 * (s >> 1)));              \
                    __m512i lo = _mm512_and_si512(s & 1 ? _mm512_srli_epi16(nb, 4) : nb, m4);          \
                    /* bits 2i..2i+1 of each byte moved to bits 4-5 (16-bit shifts: what crosses bytes \
                     * lands outside them), then lo | (that & 0x30) in one ternary-logic op */          \
                    __m512i top = i == 0 ? _mm512_slli_epi16(hb, 4) : i == 1 ? _mm512_slli_epi16(hb, 2)  \
                                : i == 2 ? hb : _mm512_srli_epi16(hb, 2);                              \
                    __m512i v = _mm512_ternarylogic_epi32(lo, top, m30, 0xF8);   /* the code, 0..63 */ \
                    for (int r = 0; r < R; r++) {                                                      \
                        const int8_t *xr = xq + r * 2 * K + 64 * g + 4 * s;                            \
                        acc[r] = _mm512_dpbusd_epi32(acc[r], v, _mm512_set1_epi32(q4_x4(xr)));                 \
                        if (LO) acc2[r] = _mm512_dpbusd_epi32(acc2[r], v, _mm512_set1_epi32(q4_x4(xr + 32)));   \
                    }                                                                                  \
                }                                                                                      \
                __m512 sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                 \
                    _mm_loadu_si128((const __m128i *)(blk + 384 + 16 * h)))));   /* d * scale: exact */ \
                for (int r = 0; r < R; r++) {                                                          \
                    __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(acc[r], 7), acc2[r]), \
                                                    _mm512_set1_epi32(32 * qsum16[r * 2 * G + 2 * g + h])); \
                    __m512 t = _mm512_mul_ps(_mm512_set1_ps(sxs[2 * (r * G + g)]), _mm512_cvtepi32_ps(isum)); \
                    out[r] = _mm512_add_ps(out[r], _mm512_mul_ps(sc, t));                              \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * y_row, out[r]);                          \
    }
#elif defined(Q4_AVX2)
#define Q6_TILE_OF(NAME, R, LO)                                                                        \
    static void NAME##_##R(const uint8_t *wt, int64_t G, const int8_t *xq, int64_t K, const float *sxs, \
                            const int32_t *qsum16, float *y, int64_t y_row) {                          \
        const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03);                        \
        const __m256i c32 = _mm256_set1_epi8(32);                                                      \
        (void)qsum16;                                                                                  \
        for (int half = 0; half < 2; half++) {   /* lanes 0..7, then 8..15 */                         \
            __m256 out[R];                                                                             \
            for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                                  \
            for (int64_t g = 0; g < G; g++) {                                                          \
                const uint8_t *blk = Q6_GROUP(wt, g);                                                  \
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(Q6_SUPER(wt, g) + 16 * half))); \
                for (int h = 0; h < 2; h++) {   /* the group's inputs 0..15, then 16..31 */           \
                    __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 256 + 64 * h + 32 * half));  \
                    __m256i acc[R], acc2[R];                                                           \
                    for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm256_setzero_si256();             \
                    for (int i = 0; i < 4; i++) {                                                      \
                        int s = 4 * h + i;                                                             \
                        __m256i nb = _mm256_loadu_si256((const __m256i *)(blk + 64 * (s >> 1) + 32 * half)); \
                        __m256i lo = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(nb, 4) : nb, m4);      \
                        __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * i)), m2); \
                        __m256i w = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), c32);  /* q */ \
                        for (int r = 0; r < R; r++)                                                    \
                            q8_step_avx2(w, xq + r * 2 * K + 64 * g + 4 * s, &acc[r], &acc2[r], LO);\
                    }                                                                                  \
                    __m256 sc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(              \
                        _mm_loadl_epi64((const __m128i *)(blk + 384 + 16 * h + 8 * half)))));          \
                    for (int r = 0; r < R; r++) {                                                      \
                        __m256i isum = _mm256_add_epi32(_mm256_slli_epi32(acc[r], 7), acc2[r]);        \
                        __m256 t = _mm256_mul_ps(_mm256_set1_ps(sxs[2 * (r * G + g)]), _mm256_cvtepi32_ps(isum)); \
                        out[r] = _mm256_add_ps(out[r], _mm256_mul_ps(sc, t));                          \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
            for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * y_row + 8 * half, out[r]);            \
        }                                                                                              \
    }
#else
#define Q6_TILE_OF(NAME, R, LO)                                                                        \
    static void NAME##_##R(const uint8_t *wt, int64_t G, const int8_t *xq, int64_t K, const float *sxs, \
                            const int32_t *qsum16, float *y, int64_t y_row) {                          \
        (void)qsum16;                                                                                  \
        for (int r = 0; r < R; r++)                                                                    \
            for (int lane = 0; lane < 16; lane++) {                                                    \
                float out = 0.f;                                                                       \
                for (int64_t g = 0; g < G; g++) {                                                      \
                    const uint8_t *blk = Q6_GROUP(wt, g);                                              \
                    const int8_t *x = xq + r * 2 * K + 64 * g, *xl = x + 32;                            \
                    uint16_t dh;                                                                       \
                    memcpy(&dh, Q6_SUPER(wt, g) + 2 * lane, 2);                                        \
                    for (int h = 0; h < 2; h++) {                                                      \
                        int32_t acc = 0;                                                               \
                        for (int i = 0; i < 4; i++)                                                    \
                            for (int j = 0; j < 4; j++) {                                              \
                                int s = 4 * h + i, b = 4 * lane + j;                                   \
                                int lo = (blk[64 * (s >> 1) + b] >> (4 * (s & 1))) & 15;               \
                                int hi = (blk[256 + 64 * h + b] >> (2 * i)) & 3;                       \
                                acc += ((lo | (hi << 4)) - 32) * (128 * x[4 * s + j] + xl[4 * s + j]); \
                            }                                                                          \
                        float sc = q4_half(dh) * (float)(int8_t)blk[384 + 16 * h + lane];              \
                        float t = sxs[2 * (r * G + g)] * (float)acc;                                          \
                        out = out + sc * t;                                                            \
                    }                                                                                  \
                }                                                                                      \
                y[r * y_row + lane] = out;                                                             \
            }                                                                                          \
    }
#endif
