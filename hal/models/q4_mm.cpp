// Rows times weights as stored on torch's intra-op threads (`hal.models.q4_rows`): the rows are
// quantized once (q4_rows.c), then the weight's output tiles are split across the threads
// (at::parallel_for, torch's own OpenMP runtime: this library links the wheel's libgomp). A
// tile's bits do not depend on the split, so neither thread count nor batch changes a row.
// Also compiled into the native layer loop (layer_loop.cpp includes this file).
#include <ATen/Parallel.h>

#include <cstdint>
#include <exception>
#include <vector>

extern "C" {
#include "q4_rows.c"
}

namespace q4 {

// y [T, N] float32 (row stride N) = x [T, K] (float32 or bfloat16, row stride x_row) @ W.T for
// a packed weight w of N outputs (kind: q4_rows.c's Q4_KIND ... Q40_KIND tiles), the rows quantized to
// codes int8 codes per input (2: hi and lo; 1: hi only, llama.cpp's int8 rows); y_row: y's row stride
// (default N; wider where w is one part of a fused linear)
inline void linear(const uint8_t *w, int kind, int codes, int64_t N, int64_t K, const void *x, int is_bf16,
                   int64_t T, int64_t x_row, float *y, int64_t y_row = 0) {
    int64_t G = K / 32;
    std::vector<int8_t> xq(T * 2 * K);   // per row and group of 32: the hi codes, then the lo codes
    std::vector<float> sxs(T * G * 2);
    std::vector<int32_t> qsum(T * G), qsum16(kind == Q6_KIND ? T * 2 * G : 0);
    q4_quantize_rows(x, is_bf16, T, K, x_row, codes == 1, xq.data(), sxs.data(), qsum.data());
    if (kind == Q6_KIND) q4_half_sums(xq.data(), T, K, qsum16.data());
    at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
        q4_mm_tiles(w, kind, codes == 1, K, xq.data(), sxs.data(), qsum.data(), qsum16.data(), T, y, y_row ? y_row : N,
                    begin, end);
    });
}

}  // namespace q4

extern "C" {

// The Python entry (`hal.models.q4_rows.Q4Weight.mm`); every argument is checked there.
// Returns 0, or 1 when the call failed (nothing of y is then to be trusted).
int64_t q4_mm(const uint8_t *w, int64_t kind, int64_t codes, int64_t N, int64_t K, const void *x, int64_t is_bf16,
              int64_t T, int64_t x_row, float *y) {
    try {
        q4::linear(w, (int)kind, (int)codes, N, K, x, (int)is_bf16, T, x_row, y);
        return 0;
    } catch (const std::exception &) {
        return 1;
    }
}

}  // extern "C"
