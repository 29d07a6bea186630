// The runner's layer stack in one call (`hal.models.layer_loop`): for layers [first, last) of
// a batch-invariant forward whose linear weights are int4 as stored, the same steps as the
// Python loop of `hal.models.llama.Llama.forward` with the fused row kernels, in the same
// order, on the same kernels (row_kernels.c, compiled into this library with the same flags;
// ATen's int4pack matmul on rows chunked as the plan chunks them, or q4_mm.cpp's kernel for a
// q4q8 plan), so the bits are the Python loop's; what it removes is the Python and dispatch
// between them.
//
// The caller (Python) checks every shape, dtype and pointer before a call; the kernels check
// every cache index; an ATen error is caught and returned as text (nothing escapes to C).
#include <ATen/ATen.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" {
#include "row_kernels.c"
}
#include "q4_mm.cpp"

extern "C" {
// One layer's weights, by name (mirrored by `hal.models.layer_loop.LayerWeights`, a ctypes.Structure):
// the norms (float32 [H]); the int4 linears in the plan's form (packed, and scales-zeros for
// int4pack's form): 0 qkv, 1 o, 2 gate-up, 3 down; the family's extras, NULL where it has none:
// q/k/v biases (float32 [Hq*D + 2*Hkv*D]), the o bias ([H]), per-head q and k norms ([D]); kind[j]:
// a q4q8 plan's linear j's tiles (q4_rows.c's kinds: Q4_KIND, Q40_KIND: a file's Q4_0, Q8_KIND: its Q8_0, Q6_KIND: its Q6_K, Q4K_KIND: its
// Q4_K); rows1[j] > 0: linear j is two parts of different tiles (a Q4_K_M file's Q4_K q, k and Q6_K v), its
// first rows1[j] outputs from packed[j], the rest from packed2[j] (kind2[j]); codes[j]: int8 codes per
// input of the rows linear j quantizes (`hal.models.q4_rows.Q4Weight.codes`: 2, or llama.cpp's 1).
struct LayerWeights {
    const float *attn_norm, *ffn_norm;
    void *packed[4], *sz[4];
    const float *bqkv, *bo, *q_norm, *k_norm;
    int64_t kind[4];
    void *packed2[4];
    int64_t kind2[4], rows1[4], codes[4];
};
}
static_assert(sizeof(LayerWeights) == 18 * sizeof(void *) + 16 * sizeof(int64_t),
              "LayerWeights: 18 pointers and 16 int64, as its ctypes mirror");

extern "C" {
// One forward's shapes, metadata and buffers, shared by every layer, by name (mirrored by
// `hal.models.layer_loop.LoopCall`): T rows of width H; Hq, Hkv heads of D; F the MLP's width;
// the caches' nblocks blocks of bs slots; R requests' block tables [R, nb] (row stride bts) with
// E extra keys each at most; act_bf16 / cache_bf16: bfloat16 activations / caches; interleaved:
// GGUF's RoPE pairs; q4: the weights are q4q8 tiles (q4_rows.c); rot [T, D/2] complex as pairs
// (row stride rs); the per-row indices (`hal.models.invariant.KeyLists`); the plan's chunk
// widths; each layer's weights (layers[i]) and caches (k_caches[i], v_caches[i], contiguous
// [nblocks, bs, Hkv, D]); taps: increasing layer indices whose entering h is copied to tap_out
// [T, ntaps, H] (the layer count: h after the last), each row's taps side by side.
struct LoopCall {
    int64_t T, H, Hq, Hkv, D, F, nblocks, bs, R, nb, bts, E;
    int64_t act_bf16, cache_bf16, interleaved, q4;
    float eps, scale;
    const float *rot;
    int64_t rs;
    const int64_t *slot_of, *bt, *req, *n_cache, *extra, *n_extra, *widths;
    int64_t nwidths;
    const LayerWeights *layers;
    void *const *k_caches, *const *v_caches;
    const int64_t *taps;
    int64_t ntaps;
    float *tap_out;
};
}
static_assert(sizeof(LoopCall) == 16 * sizeof(int64_t) + 2 * sizeof(float) + 16 * sizeof(void *),
              "LoopCall: as its ctypes mirror (16 int64, 2 float, then 16 pointer-sized fields)");

namespace {

using Step = LoopCall;

at::ScalarType act_type(const Step &s) { return s.act_bf16 ? at::kBFloat16 : at::kFloat; }

// x [T, K] @ W.T for an int4 weight (packed [N, K/2] uint8, scales and zeros [K/32, N, 2]),
// each row in a chunk of one of the plan's widths, zero-padded (`LinearPlan.linear`)
at::Tensor int4_mm(const at::Tensor &x, void *packed, void *sz, int64_t N, const Step &s) {
    int64_t K = x.size(1);
    auto w = at::from_blob(packed, {N, K / 2}, at::TensorOptions().dtype(at::kByte));
    auto scales = at::from_blob(sz, {K / 32, N, 2}, at::TensorOptions().dtype(act_type(s)));
    if (s.nwidths == 1 && s.widths[0] == s.T)
        return at::_weight_int4pack_mm_for_cpu(x, w, 32, scales);
    auto out = at::empty({s.T, N}, x.options());
    int64_t start = 0;
    for (int64_t c = 0; c < s.nwidths; c++) {
        int64_t width = s.widths[c], end = std::min(start + width, s.T);
        at::Tensor chunk = x.slice(0, start, end);
        if (end - start < width)
            chunk = at::cat({chunk, at::zeros({width - (end - start), K}, x.options())});
        out.slice(0, start, end).copy_(at::_weight_int4pack_mm_for_cpu(chunk.contiguous(), w, 32, scales)
                                           .slice(0, 0, end - start));
        start = end;
    }
    return out;
}

// x [T, K] (contiguous, the activation dtype) @ W.T for layer weight j of either form, in the
// activation dtype (the q4q8 kernel's float32 product rounded as the Python path rounds it)
at::Tensor stored_mm(const at::Tensor &x, const LayerWeights &lw, int j, int64_t N, const Step &s) {
    if (!s.q4) return int4_mm(x, lw.packed[j], lw.sz[j], N, s);
    auto y = at::empty({s.T, N}, at::TensorOptions().dtype(at::kFloat));
    int64_t n1 = lw.rows1[j] ? lw.rows1[j] : N;
    int codes = (int)lw.codes[j];
    q4::linear((const uint8_t *)lw.packed[j], (int)lw.kind[j], codes, n1, x.size(1), x.data_ptr(), s.act_bf16, s.T,
               x.size(1), y.data_ptr<float>(), N);
    if (lw.rows1[j])   // the second part's outputs, beside the first's
        q4::linear((const uint8_t *)lw.packed2[j], (int)lw.kind2[j], codes, N - n1, x.size(1), x.data_ptr(),
                   s.act_bf16, s.T, x.size(1), y.data_ptr<float>() + n1, N);
    return s.act_bf16 ? y.to(at::kBFloat16) : y;
}

// row_kernels.c's attention with its work units (query row x KV head) split across torch's
// threads where there is enough of it (a unit's bits do not depend on the split): 0, or the
// kernel's error code (every index is checked first, on this thread)
int64_t parallel_attention(const float *q, const void *k_cache, const void *v_cache, float *out, const Step &s) {
    int64_t longest, keys = 0;
    int64_t err = attention_check(s.T, s.bs, s.nblocks, s.bt, s.R, s.nb, s.bts, s.req, s.n_cache, s.extra, s.E,
                                  s.n_extra, &longest);
    if (err) return err;
    for (int64_t t = 0; t < s.T; t++) keys += s.n_cache[t] + s.n_extra[t];
    int64_t units = s.T * s.Hkv, grain = keys * s.Hkv < 4096 ? units : 1;   // small batches: one thread
    std::atomic<int64_t> failed{0};
    at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
        if (attention_units(q, s.Hq, s.D, k_cache, v_cache, s.cache_bf16, s.Hkv, s.bs, s.bt, s.bts, s.req, s.n_cache,
                            s.extra, s.E, s.n_extra, s.scale, out, longest, begin, end))
            failed = 5;
    });
    return failed;
}

// h [T, H] as tap j of tap_out [T, ntaps, H]: each row's taps side by side, the drafter's feature layout
void copy_tap(float *tap_out, int64_t j, int64_t ntaps, const float *h, int64_t T, int64_t H) {
    for (int64_t t = 0; t < T; t++)
        memcpy(tap_out + (t * ntaps + j) * H, h + t * H, sizeof(float) * H);
}

// one layer: h += d (undefined d: nothing to add, the first layer); attention block; h += its
// output; the MLP's output returned (not added)
at::Tensor layer(float *h, const at::Tensor &d, const LayerWeights &lw, int64_t i, const Step &s,
                 void *const *k_caches, void *const *v_caches, const int64_t *taps, int64_t ntaps, float *tap_out) {
    auto opts = at::TensorOptions().dtype(act_type(s));
    auto f32 = at::TensorOptions().dtype(at::kFloat);
    auto x = at::empty({s.T, s.H}, opts);
    add_norm(h, s.H, d.defined() ? d.data_ptr() : nullptr, s.H, s.act_bf16, lw.attn_norm, s.eps, x.data_ptr(), s.H,
             s.act_bf16, s.T, s.H);
    for (int64_t j = 0; j < ntaps; j++)
        if (taps[j] == i) copy_tap(tap_out, j, ntaps, h, s.T, s.H);
    int64_t nq = s.Hq * s.D, nk = s.Hkv * s.D, nqkv = nq + 2 * nk;
    at::Tensor qkv = stored_mm(x, lw, 0, nqkv, s);
    if (lw.bqkv)   // the family's extras, as `hal.models.families.qkv_extras`
        qkv = (qkv + at::from_blob(const_cast<float *>(lw.bqkv), {nqkv}, f32)).to(act_type(s));
    if (lw.q_norm) {   // in place, row_kernels.c's head_norm (the Python loop's `FusedRows.head_norm`)
        qkv = qkv.contiguous();
        head_norm(qkv.data_ptr(), nqkv, (int)s.act_bf16, lw.q_norm, s.eps, s.T, s.Hq, s.D);
        head_norm((char *)qkv.data_ptr() + nq * qkv.element_size(), nqkv, (int)s.act_bf16, lw.k_norm, s.eps, s.T,
                  s.Hkv, s.D);
    }
    qkv = qkv.contiguous();
    auto q = at::empty({s.T, s.Hq, s.D}, at::TensorOptions().dtype(at::kFloat));
    if (rope_kv(qkv.data_ptr(), nqkv, s.act_bf16, s.rot, s.rs, q.data_ptr<float>(), s.T, s.Hq, s.Hkv, s.D,
                s.interleaved, k_caches[i], v_caches[i], s.cache_bf16, s.slot_of, s.nblocks * s.bs))
        throw std::runtime_error("slots: a slot outside the cache");
    auto o = at::empty({s.T, s.Hq, s.D}, at::TensorOptions().dtype(at::kFloat));
    int64_t err = parallel_attention(q.data_ptr<float>(), k_caches[i], v_caches[i], o.data_ptr<float>(), s);
    if (err) throw std::runtime_error("batch: an index outside the cache (attention error " + std::to_string(err) + ")");
    at::Tensor ho = stored_mm(o.view({s.T, nq}).to(act_type(s)), lw, 1, s.H, s);
    if (lw.bo)
        ho = (ho + at::from_blob(const_cast<float *>(lw.bo), {s.H}, f32)).to(ho.scalar_type()).contiguous();
    add_norm(h, s.H, ho.data_ptr(), s.H, s.act_bf16, lw.ffn_norm, s.eps, x.data_ptr(), s.H, s.act_bf16, s.T, s.H);
    at::Tensor gu = stored_mm(x, lw, 2, 2 * s.F, s);
    auto a = at::empty({s.T, s.F}, opts);
    silu_mul(gu.data_ptr(), 2 * s.F, s.F, a.data_ptr(), s.F, s.act_bf16, s.T);
    return stored_mm(a, lw, 3, s.H, s);
}

}  // namespace

extern "C" {

// Layers [first, last) of the forward ``call`` describes: h [T, H] float32 (in place) gets d
// [T, H] (activations: the output of layer first - 1; NULL: none, h is the embedding) added,
// then each layer; the last layer's output is added too. Returns 0, or 1 with a message in err
// (errlen bytes).
int64_t layer_loop(int64_t first, int64_t last, float *h, const void *d, const LoopCall *call, char *err,
                   int64_t errlen) {
    try {
        const Step &s = *call;
        auto opts = at::TensorOptions().dtype(act_type(s));
        at::Tensor dd = d ? at::from_blob(const_cast<void *>(d), {s.T, s.H}, opts) : at::Tensor();
        for (int64_t i = first; i < last; i++)
            dd = layer(h, dd, s.layers[i], i, s, s.k_caches, s.v_caches, s.taps, s.ntaps, s.tap_out);
        add_norm(h, s.H, dd.defined() ? dd.data_ptr() : nullptr, s.H, (int)s.act_bf16, nullptr, s.eps, nullptr, s.H,
                 (int)s.act_bf16, s.T, s.H);
        for (int64_t j = 0; j < s.ntaps; j++)
            if (s.taps[j] == last) copy_tap(s.tap_out, j, s.ntaps, h, s.T, s.H);
        return 0;
    } catch (const std::exception &e) {
        std::strncpy(err, e.what(), errlen - 1);
        err[errlen - 1] = 0;
        return 1;
    }
}

}  // extern "C"
