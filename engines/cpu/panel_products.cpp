// Products of the engine's CPU library by weights packed in panels of 16 outputs
// (float32 on AVX-512, bfloat16 on AVX512-BF16), with the packings themselves; shared
// definitions: kernels.h.
#include "kernels.h"

using namespace zpd;

namespace {

// Products of more rows by a weight packed in panels of 16 outputs (engines/
// cpu_products.py, `PanelLinear` and `BPanelLinear`): y[M, N] = x[M, K] w[N, K]^T
// (+ bias[N]), N padded to 16 with zero rows. float32 (AVX-512 FMAs): [N / 16][K][16];
// bfloat16 without AMX (AVX512-BF16 dot products of input pairs, float32 sums):
// [N / 16][K / 2][16][2]. A step is one input (a pair in bfloat16). Up to 64 rows
// (decode steps), each panel streams once (prefetched kPanelAhead steps ahead) into
// blocks of up to kBlockRows rows of x, one FMA per row and step with that row's step
// broadcast, one accumulator of 16 outputs per row; x is first transposed block by
// block, [blocks][steps][stride], so a block's values of one step lie together. The
// rows are shared evenly among the blocks (25 -> 13 + 12, not 24 + 1): a block of
// fewer than ~8 rows waits on its FMAs' latency, not their throughput. Over
// bench_e2e's "mid" model's 43 products on one thread (float32, alternating, median
// ms), 24-row blocks against 16-row ones: 17 rows 9.5 -> 8.4, 20 rows 10.6 -> 9.2, 24
// rows 12.3 -> 10.8, 33 rows 16.7 -> 15.3; 9 and 16 rows the same.
// Past 64 rows (prefills) a pass takes 3 panels and up to 8 rows of x as it is (no
// transposed copy: at 1,024 rows writing it cost as much as the products gained
// from it): SmolLM2's 4 products of a layer, 2 threads of an AMD EPYC, alternating,
// median ms, against 24-row passes of one panel: float32 1,024 rows 39.95 -> 36.56
// (oneDNN's packed products 38.0), 256 rows 10.10 -> 9.74, 65-128 rows the same;
// bfloat16 1,024 rows 18.73 -> 17.51, 128 rows 2.70 -> 2.39; 64 rows and fewer the
// same either way, but x as it is in 24-row passes took 15% longer at 24 and 64 rows.
#if defined(__AVX512F__)
constexpr int64_t kPanelAhead = 64;
constexpr int kBlockRows = 24;        // most rows of x transposed per pass over a panel
constexpr int kWidePanels = 3;        // past kNarrowMaxRows rows: panels per pass
constexpr int kWideRows = 8;          //   and rows of x as it is per pass
constexpr int64_t kNarrowMaxRows = 64;
constexpr int kGatedPanels = 4, kGatedRows = 6;    // SiLU(gate) * up: 2 gate and 2 up panels
static_assert(kWidePanels * kWideRows <= kBlockRows && kGatedPanels * kGatedRows <= kBlockRows,
              "a pass's sums fit panel_linear's kBlockRows accumulators");

struct Float32Panel {
    using T = float;
    using Step = float;                                   // one step of one row of x
    static constexpr int64_t kPerStep = 1;                // inputs per step
    static Step step(const float *x) { return *x; }
    static __m512 madd(__m512 acc, const float *w, Step x) {
        return _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_set1_ps(x), acc);
    }
    static __m512 load_bias(const float *b, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, b); }
    static void store(float *y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }
    static __m512 round(__m512 v) { return v; }           // as stored in T
};
#endif
#if defined(__AVX512BF16__)
struct BFloat16Panel {
    using T = BF16;
    using Step = uint32_t;                                // a pair of inputs
    static constexpr int64_t kPerStep = 2;
    static Step step(const BF16 *x) { Step pair; std::memcpy(&pair, x, 4); return pair; }
    static __m512 madd(__m512 acc, const BF16 *w, Step x) {
        return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_set1_epi32(int(x)));
    }
    static __m512 load_bias(const BF16 *b, __mmask16 mask) { return load_bf16(b, mask); }
    static void store(BF16 *y, __mmask16 mask, __m512 v) { store_bf16(y, mask, v); }
    static __m512 round(__m512 v) { return widen_bf16((__m256i)_mm512_cvtneps_pbh(v)); }
};
#endif
#if defined(__AVX512F__)
template <typename L, bool kTransposed, int P, int R>
inline void panel_block(const typename L::T *x, int64_t stride, const typename L::T *const *panels,
                        int64_t steps, __m512 *sums) {
    constexpr int64_t kWidth = 16 * L::kPerStep;          // elements of a panel per step
    __m512 acc[P][R];
    for (int p = 0; p < P; p++)
        for (int m = 0; m < R; m++) acc[p][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < steps; k++) {
#pragma GCC unroll 4
        for (int p = 0; p < P; p++)
            _mm_prefetch(reinterpret_cast<const char *>(panels[p] + (k + kPanelAhead) * kWidth), _MM_HINT_T0);
#pragma GCC unroll 32
        for (int m = 0; m < R; m++) {
            const typename L::Step xs = L::step(x + (kTransposed ? k * stride + m * L::kPerStep
                                                                 : m * stride + k * L::kPerStep));
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) acc[p][m] = L::madd(acc[p][m], panels[p] + k * kWidth, xs);
        }
    }
    for (int p = 0; p < P; p++)
        for (int m = 0; m < R; m++) sums[p * R + m] = acc[p][m];
}

template <typename L>
using PanelFn = void (*)(const typename L::T *, int64_t, const typename L::T *const *, int64_t, __m512 *);
template <typename L, bool kTransposed, int P, int... R>
constexpr PanelFn<L> panel_fns[] = {panel_block<L, kTransposed, P, R + 1>...};
template <typename L, bool kTransposed, int P, int... R>
PanelFn<L> panel_fn(int rows, std::integer_sequence<int, R...>) {
    return panel_fns<L, kTransposed, P, R...>[rows - 1];
}

// The kernel of a pass over `rows` rows of x: of one panel, from x transposed, or of
// `panels` (1 to kWidePanels, or kGatedPanels), from x as it is
template <typename L>
PanelFn<L> panel_fn(int panels, int rows, bool transposed) {
    using Wide = std::make_integer_sequence<int, kWideRows>;
    if (transposed) return panel_fn<L, true, 1>(rows, std::make_integer_sequence<int, kBlockRows>{});
    switch (panels) {
        case 1: return panel_fn<L, false, 1>(rows, Wide{});
        case 2: return panel_fn<L, false, 2>(rows, Wide{});
        case 3: return panel_fn<L, false, 3>(rows, Wide{});
        default: return panel_fn<L, false, kGatedPanels>(rows, std::make_integer_sequence<int, kGatedRows>{});
    }
}

// SiLU(gate) * up of 16 outputs from their float32 sums, rounded as engines/cpu_layer_ops
// rounds them after an unfused product (its silu_mul): gate and up as stored in T, SiLU's
// result too, then the product
template <typename L>
inline __m512 silu_times(__m512 gate, __m512 up) {
    alignas(64) float g[16], silu[16];
    _mm512_store_ps(g, L::round(gate));
#pragma omp simd
    for (int i = 0; i < 16; i++) silu[i] = g[i] / (1.f + expf(-g[i]));
    return _mm512_mul_ps(L::round(_mm512_load_ps(silu)), L::round(up));
}

// y = x w^T (+ bias), or with `gated` (w: [gate; up], N / 2 outputs of each, N a multiple
// of 64) y = SiLU(x w_gate^T) * (x w_up^T) [M, N / 2], each pass 2 panels of each half
template <typename L>
int panel_linear(const typename L::T *x, const typename L::T *packed, const typename L::T *bias,
                 typename L::T *y, int64_t M, int64_t N, int64_t K, int threads, bool gated = false) {
    using T = typename L::T;
    if (M < 1 || N < 1 || K < 1 || K % L::kPerStep || threads < 1 || (gated && N % 64)) return kBadShape;
    const bool wide = gated || M > kNarrowMaxRows;
    const int64_t panels = (N + 15) / 16, steps = K / L::kPerStep, width_out = gated ? N / 2 : N;
    const int64_t per_pass = gated ? kGatedPanels : wide ? kWidePanels : 1;
    const int64_t groups = (panels + per_pass - 1) / per_pass;
    const int64_t most = gated ? kGatedRows : wide ? kWideRows : kBlockRows, blocks = (M + most - 1) / most;
    const int64_t base = M / blocks, extra = M % blocks;     // block b: base + (b < extra) rows
    auto first_row = [&](int64_t b) { return b * base + (b < extra ? b : extra); };
    auto block_rows = [&](int64_t b) { return int(base + (b < extra)); };
    const int64_t stride = base + (extra > 0);                 // x's rows per step in xt
    T *xt = nullptr;
    if (!wide) {
        const size_t bytes = (sizeof(T) * blocks * K * stride + 63) / 64 * 64;
        if (!(xt = static_cast<T *>(std::aligned_alloc(64, bytes)))) return kNoMemory;
    }
#pragma omp parallel num_threads(threads)
    {
    if (!wide) {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t k = 0; k < steps; k++)
                for (int64_t m = 0; m < stride; m++)
                    for (int64_t j = 0; j < L::kPerStep; j++)
                        xt[((b * steps + k) * stride + m) * L::kPerStep + j] =
                            m < block_rows(b) ? x[(first_row(b) + m) * K + k * L::kPerStep + j] : T{};
    }
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t count = panels - g * per_pass < per_pass ? panels - g * per_pass : per_pass;
        int64_t at[kGatedPanels];                              // the pass's panels (gated: 2 of each half)
        for (int64_t p = 0; p < count; p++) at[p] = gated ? (p / 2) * (panels / 2) + 2 * g + p % 2 : g * per_pass + p;
        const T *from[kGatedPanels];
        __m512 b[kGatedPanels];
        __mmask16 masks[kGatedPanels];
        for (int64_t p = 0; p < count; p++) {
            const int64_t n0 = at[p] * 16, width = N - n0 < 16 ? N - n0 : 16;
            from[p] = packed + n0 * K;
            masks[p] = width == 16 ? 0xffff : __mmask16((1u << width) - 1);
            b[p] = bias ? L::load_bias(bias + n0, masks[p]) : _mm512_setzero_ps();
        }
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int rows = block_rows(blk);
            __m512 sums[kBlockRows];
            panel_fn<L>(int(count), rows, !wide)(
                wide ? x + first_row(blk) * K : xt + blk * steps * stride * L::kPerStep, wide ? K : stride * L::kPerStep,
                from, steps, sums);
            for (int m = 0; m < rows; m++) {
                T *out = y + (first_row(blk) + m) * width_out;
                if (gated)
                    for (int64_t p = 0; p < 2; p++)
                        L::store(out + at[p] * 16, 0xffff, silu_times<L>(_mm512_add_ps(sums[p * rows + m], b[p]),
                                                                     _mm512_add_ps(sums[(p + 2) * rows + m], b[p + 2])));
                else
                    for (int64_t p = 0; p < count; p++)
                        L::store(out + at[p] * 16, masks[p], _mm512_add_ps(sums[p * rows + m], b[p]));
            }
        }
    }
    }
    std::free(xt);
    return kOk;
}
#endif

// bfloat16 panels: [N / 16][K / 2][16][2], element [p, s, n, j] = w[16 p + n][2 s + j]
void bpanel_pack_block(const BF16 *w, BF16 *out, int64_t N, int64_t K, int64_t n0, int64_t) {
    uint32_t *pairs = reinterpret_cast<uint32_t *>(out);     // [j] pairs move as one word
    for (int64_t n = 0; n < 16; n++) {                       // each row of w read in order
        for (int64_t s = 0; s < K / 2; s++) {
            uint32_t pair = 0;
            if (n0 + n < N) std::memcpy(&pair, w + (n0 + n) * K + 2 * s, 4);
            pairs[s * 16 + n] = pair;
        }
    }
}

// panels: [N / 16][K][16], element [p, k, n] = w[16 p + n][k]
void panel_pack_block(const float *w, float *out, int64_t N, int64_t K, int64_t n0, int64_t) {
    for (int64_t n = 0; n < 16; n++) {                  // each row of w read in order
        const float *row = w + (n0 + n) * K;
        for (int64_t k = 0; k < K; k++) out[k * 16 + n] = n0 + n < N ? row[k] : 0.f;
    }
}

}  // namespace

extern "C" {

int zpd_pack_panel_float32(const float *w, float *out, int64_t N, int64_t K, int threads) {
    if (N < 1 || K < 1 || threads < 1) return kBadShape;
    pack_blocks<float, 16, 1>(w, out, N, K, threads, panel_pack_block);
    return kOk;
}

int zpd_linear_panel_float32(const float *x, const float *packed, const float *bias, float *y,
                             int64_t M, int64_t N, int64_t K, int threads) {
#if defined(__AVX512F__)
    return panel_linear<Float32Panel>(x, packed, bias, y, M, N, K, threads);
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AVX-512
#endif
}

int zpd_linear_panel_gated_float32(const float *x, const float *packed, const float *bias, float *y,
                                   int64_t M, int64_t N, int64_t K, int threads) {
#if defined(__AVX512F__)
    return panel_linear<Float32Panel>(x, packed, bias, y, M, N, K, threads, true);
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return kUnsupported;
#endif
}

int zpd_pack_bpanel_bfloat16(const BF16 *w, BF16 *out, int64_t N, int64_t K, int threads) {
    if (N < 1 || K < 2 || K % 2 || threads < 1) return kBadShape;
    pack_blocks<BF16, 16, 2>(w, out, N, K, threads, bpanel_pack_block);
    return kOk;
}

int zpd_linear_bpanel_bfloat16(const BF16 *x, const BF16 *packed, const BF16 *bias, BF16 *y,
                               int64_t M, int64_t N, int64_t K, int threads) {
#if defined(__AVX512BF16__)
    return panel_linear<BFloat16Panel>(x, packed, bias, y, M, N, K, threads);
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AVX512-BF16
#endif
}

int zpd_linear_bpanel_gated_bfloat16(const BF16 *x, const BF16 *packed, const BF16 *bias, BF16 *y,
                                     int64_t M, int64_t N, int64_t K, int threads) {
#if defined(__AVX512BF16__)
    return panel_linear<BFloat16Panel>(x, packed, bias, y, M, N, K, threads, true);
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return kUnsupported;
#endif
}

}  // extern "C"
