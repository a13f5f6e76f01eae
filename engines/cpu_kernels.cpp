// CPU kernels of the engine, built and loaded by engines/cpu_kernels.py:
// - decode attention read straight from the paged KV pool;
// - products of up to 8 rows by a row-major weight, float32 (AVX-512) or bfloat16
//   (AVX512-BF16);
// - bfloat16 products of any number of rows by a weight packed for AMX tiles, and
//   float32 products of 9-64 rows by a weight packed in panels of 16 outputs;
// - the layers' element-wise steps, each in one pass: RMSNorm (after a residual
//   addition), SiLU(gate) * up, and rotary embedding with the write of K and V into the
//   pool;
// - each row's first maximum (greedy sampling), as torch.argmax picks it;
// - a prompt's causal attention to itself (prefill), block by block: float32 in
//   AVX-512, bfloat16 on AMX tiles.
//
// Decode attention:
// torch's path gathers every sequence's K and V out of the pool into a dense copy, then
// multiplies; here each (sequence, KV head) pair walks its own pool rows once for the
// scores and once for the weighted sum of V, in float32 whatever the storage dtype, and
// the pairs are shared among OpenMP threads (torch's own runtime: the library links the
// libgomp.so.1 torch has loaded). See engines/cpu_kernels.py for the arguments.
//
// Compiled with -ffast-math (at compile time only, so the library does not switch the
// process's denormals off): the reductions below are reordered and vectorised, and the
// exp loop calls glibc's vector expf. No infinity or NaN is relied on: a row's maximum
// starts at its first score, and every row holds at least one position.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ZPD_AMX 1
#endif

namespace {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kAhead = 4;          // positions to prefetch ahead

enum Status { kOk = 0, kBadShape = -1, kNoMemory = -2, kBadRow = -3, kUnsupported = -4 };

struct BF16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void store(float *dst, float x) { *dst = x; }
inline void store(BF16 *dst, float x) {             // round to nearest even; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { dst->bits = uint16_t((u >> 16) | 0x40); return; }
    dst->bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline void prefetch(const void *p, int64_t bytes) {
    const char *c = static_cast<const char *>(p);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

template <typename T>
inline void load_row(const T *src, float *dst, int64_t D) {
#pragma omp simd
    for (int64_t d = 0; d < D; d++) dst[d] = to_float(src[d]);
}

// Query heads [h0 * G, h1 * G) of one sequence, over its n >= 1 positions: each
// position's K (then V) rows of KV heads h0..h1-1 are adjacent in the pool, read as one
// run, and the rows a few positions ahead are prefetched (pages lie anywhere in the pool).
// work: room for (h1 - h0) * G * (n + 2 * D) floats.
template <typename T>
void attend(const T *q, const T *k, const T *v, const int64_t *rows, int64_t n,
            int64_t kv_heads, int64_t h0, int64_t h1, int64_t G, int64_t D, float scale, T *out,
            float *work) {
    const int64_t H = (h1 - h0) * G, span = (h1 - h0) * D;     // query heads; elements per run
    float *scores = work, *qf = work + H * n, *acc = qf + H * D;
    alignas(64) float row[kMaxHeadDim];
    for (int64_t i = 0; i < H; i++) {
        load_row(q + i * D, qf + i * D, D);
        for (int64_t d = 0; d < D; d++) { qf[i * D + d] *= scale; acc[i * D + d] = 0.f; }
    }
    // f(s, h, row) for each position s and KV head h (of h0..h1-1), `row` that head's
    // K or V at s in float32; the pool rows kAhead positions on are prefetched
    auto each_row = [&](const T *pool, auto f) {
        for (int64_t s = 0; s < n; s++) {
            if (s + kAhead < n) prefetch(pool + (rows[s + kAhead] * kv_heads + h0) * D, span * sizeof(T));
            const T *run = pool + (rows[s] * kv_heads + h0) * D;
            for (int64_t h = 0; h < h1 - h0; h++) {
                load_row(run + h * D, row, D);
                f(s, h, row);
            }
        }
    };
    each_row(k, [&](int64_t s, int64_t h, const float *kr) {            // scores = q . k
        for (int64_t g = 0; g < G; g++) {
            const float *qi = qf + (h * G + g) * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qi[d] * kr[d];
            scores[(h * G + g) * n + s] = dot;
        }
    });
    for (int64_t i = 0; i < H; i++) {                        // softmax of each head's scores
        float *p = scores + i * n, top = p[0], sum = 0.f;
#pragma omp simd reduction(max : top)
        for (int64_t s = 1; s < n; s++) top = p[s] > top ? p[s] : top;
#pragma omp simd
        for (int64_t s = 0; s < n; s++) p[s] = expf(p[s] - top);
#pragma omp simd reduction(+ : sum)
        for (int64_t s = 0; s < n; s++) sum += p[s];
        const float inv = 1.f / sum;                         // sum >= 1: the maximum's term is 1
#pragma omp simd
        for (int64_t s = 0; s < n; s++) p[s] *= inv;
    }
    each_row(v, [&](int64_t s, int64_t h, const float *vr) {            // out = softmax . v
        for (int64_t g = 0; g < G; g++) {
            const float w = scores[(h * G + g) * n + s];
            float *a = acc + (h * G + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) a[d] += w * vr[d];
        }
    });
    for (int64_t i = 0; i < H; i++)
        for (int64_t d = 0; d < D; d++) store(out + i * D + d, acc[i * D + d]);
}

template <typename T>
int decode_attention(const T *q, const T *k, const T *v, int64_t pool_rows, const int64_t *rows,
                     const int64_t *lengths, int64_t batch, int64_t width, int64_t q_heads,
                     int64_t kv_heads, int64_t D, float scale, T *out, int threads) {
    if (batch < 0 || width < 1 || kv_heads < 1 || q_heads % kv_heads || D < 1 || D > kMaxHeadDim
        || threads < 1)
        return kBadShape;
    const int64_t G = q_heads / kv_heads;
    for (int64_t b = 0; b < batch; b++) {                    // every read inside the pool
        if (lengths[b] < 1 || lengths[b] > width) return kBadShape;
        for (int64_t s = 0; s < lengths[b]; s++) {
            const int64_t r = rows[b * width + s];
            if (r < 0 || r >= pool_rows) return kBadRow;
        }
    }
    // a work item is one sequence with all its heads (reading whole runs of the pool), or,
    // when sequences are too few to keep the threads busy, one sequence and one KV head
    const int64_t per_item = batch >= threads ? kv_heads : 1, items = batch * (kv_heads / per_item);
    int status = kOk;
#pragma omp parallel num_threads(threads)
    {
        const int64_t H = per_item * G;
        float *work = static_cast<float *>(std::malloc(sizeof(float) * H * (width + 2 * D)));
        if (!work) {
#pragma omp atomic write
            status = kNoMemory;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (!work) continue;
            const int64_t b = item / (kv_heads / per_item), h0 = item % (kv_heads / per_item) * per_item;
            const int64_t first = b * q_heads + h0 * G;
            attend(q + first * D, k, v, rows + b * width, lengths[b], kv_heads, h0, h0 + per_item,
                   G, D, scale, out + first * D, work);
        }
        std::free(work);
    }
    return status;
}

// Small-batch products: y[M, N] = x[M, K] w[N, K]^T (+ bias[N]) for 1 <= M <= 8, w
// row-major. Each weight row is loaded once per vector of K and multiplied into all M
// rows (R x M independent accumulator chains), while the next R weight rows are
// prefetched; K's last elements are read through a mask. float32 by AVX-512 FMAs,
// bfloat16 by AVX512-BF16 dot products (32 pairs per instruction) with float32 sums.
#if defined(__AVX512F__)
struct Float32Lanes {
    using T = float;
    using Vec = __m512;
    static constexpr int64_t kStep = 16;
    static Vec load(const float *p) { return _mm512_loadu_ps(p); }
    static Vec load_first(const float *p, int64_t n) {
        return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
    }
    static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
};
#endif
#if defined(__AVX512BF16__)
struct BFloat16Lanes {
    using T = BF16;
    using Vec = __m512bh;
    static constexpr int64_t kStep = 32;
    static Vec load(const BF16 *p) { return (__m512bh)_mm512_loadu_si512(p); }
    static Vec load_first(const BF16 *p, int64_t n) {
        return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
    }
    static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

#if defined(__AVX512F__)
template <class L, int R, int M>
inline void product_block(const typename L::T *x, const typename L::T *w, const typename L::T *bias,
                          typename L::T *y, int64_t n, int64_t N, int64_t K) {
    __m512 acc[R][M];
    for (int i = 0; i < R; i++)
        for (int m = 0; m < M; m++) acc[i][m] = _mm512_setzero_ps();
    const typename L::T *base = w + n * K;
    const bool ahead = n + 2 * R <= N;
    int64_t k = 0;
    for (; k + L::kStep <= K; k += L::kStep) {
        typename L::Vec wv[R];
        for (int i = 0; i < R; i++) {
            if (ahead) _mm_prefetch(reinterpret_cast<const char *>(base + (R + i) * K + k), _MM_HINT_T0);
            wv[i] = L::load(base + i * K + k);
        }
        for (int m = 0; m < M; m++) {
            const typename L::Vec xv = L::load(x + m * K + k);
            for (int i = 0; i < R; i++) acc[i][m] = L::madd(acc[i][m], wv[i], xv);
        }
    }
    if (k < K) {
        for (int m = 0; m < M; m++) {
            const typename L::Vec xv = L::load_first(x + m * K + k, K - k);
            for (int i = 0; i < R; i++)
                acc[i][m] = L::madd(acc[i][m], L::load_first(base + i * K + k, K - k), xv);
        }
    }
    for (int i = 0; i < R; i++) {
        const float b = bias ? to_float(bias[n + i]) : 0.f;
        for (int m = 0; m < M; m++) store(y + m * N + n + i, _mm512_reduce_add_ps(acc[i][m]) + b);
    }
}

template <class L, int M>
void product(const typename L::T *x, const typename L::T *w, const typename L::T *bias,
             typename L::T *y, int64_t N, int64_t K, int threads) {
    constexpr int R = M <= 2 ? 8 : 16 / M > 1 ? 16 / M : 1;      // R * M <= 16 accumulators
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n += R) {
        if (n + R <= N) {
            product_block<L, R, M>(x, w, bias, y, n, N, K);
        } else {
            for (int64_t i = n; i < N; i++) product_block<L, 1, M>(x, w, bias, y, i, N, K);
        }
    }
}

template <class L>
int linear(const typename L::T *x, const typename L::T *w, const typename L::T *bias,
           typename L::T *y, int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 1 || M > 8 || N < 0 || K < 1 || threads < 1) return kBadShape;
    switch (M) {
        case 1: product<L, 1>(x, w, bias, y, N, K, threads); break;
        case 2: product<L, 2>(x, w, bias, y, N, K, threads); break;
        case 3: product<L, 3>(x, w, bias, y, N, K, threads); break;
        case 4: product<L, 4>(x, w, bias, y, N, K, threads); break;
        case 5: product<L, 5>(x, w, bias, y, N, K, threads); break;
        case 6: product<L, 6>(x, w, bias, y, N, K, threads); break;
        case 7: product<L, 7>(x, w, bias, y, N, K, threads); break;
        default: product<L, 8>(x, w, bias, y, N, K, threads); break;
    }
    return kOk;
}
#endif

// float32 products of more rows: y[M, N] = x[M, K] w[N, K]^T (+ bias[N]), w packed by
// engines/cpu_kernels.py (`PanelLinear.pack`) in panels of 16 outputs, [N / 16][K][16]
// (N padded to 16 with zero rows). Each panel streams once (prefetched kPanelAhead
// inputs ahead) into 16 rows of x at a time, one FMA per row and input with that input
// broadcast, 16 accumulators of 16 outputs; x is first transposed in blocks of 16 rows,
// [M / 16][K][16], so each input's 16 values are one cache line.
#if defined(__AVX512F__)
constexpr int64_t kPanelAhead = 64;

template <int R>
inline void panel_block(const float *xt, const float *panel, int64_t K, __m512 *sums) {
    __m512 acc[R];
    for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch(reinterpret_cast<const char *>(panel + (k + kPanelAhead) * 16), _MM_HINT_T0);
        const __m512 w = _mm512_loadu_ps(panel + k * 16);
        for (int m = 0; m < R; m++) acc[m] = _mm512_fmadd_ps(w, _mm512_set1_ps(xt[k * 16 + m]), acc[m]);
    }
    for (int m = 0; m < R; m++) sums[m] = acc[m];
}

using PanelFn = void (*)(const float *, const float *, int64_t, __m512 *);
template <int... R>
constexpr PanelFn panel_fns[] = {panel_block<R + 1>...};

template <int... R>
PanelFn panel_fn(int rows, std::integer_sequence<int, R...>) { return panel_fns<R...>[rows - 1]; }

int panel_linear(const float *x, const float *packed, const float *bias, float *y, int64_t M,
                 int64_t N, int64_t K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return kBadShape;
    const int64_t panels = (N + 15) / 16, blocks = (M + 15) / 16;
    float *xt = static_cast<float *>(std::aligned_alloc(64, sizeof(float) * blocks * K * 16));
    if (!xt) return kNoMemory;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t m = 0; m < 16; m++) {
                const int64_t row = b * 16 + m;
                xt[(b * K + k) * 16 + m] = row < M ? x[row * K + k] : 0.f;
            }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * 16, width = N - n0 < 16 ? N - n0 : 16;
        const __mmask16 mask = width == 16 ? 0xffff : __mmask16((1u << width) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int rows = int(M - blk * 16 < 16 ? M - blk * 16 : 16);
            __m512 sums[16];
            panel_fn(rows, std::make_integer_sequence<int, 16>{})(xt + blk * K * 16, packed + p * K * 16, K, sums);
            for (int m = 0; m < rows; m++)
                _mm512_mask_storeu_ps(y + (blk * 16 + m) * N + n0, mask, _mm512_add_ps(sums[m], b));
        }
    }
    std::free(xt);
    return kOk;
}
#endif

// The packings of engines/cpu_kernels.py (`AmxLinear.layout`, `PanelLinear.layout` say
// the same in torch), from a row-major w [N, K], written in order, blocks shared among
// threads: torch's strided copy took 5x (AMX) and 2.5x (panels) as long, and a weight
// update repacks every weight on the next step.
template <typename T, int64_t kOut, int64_t kIn>
void pack_blocks(const T *w, T *out, int64_t N, int64_t K, int threads,
                 void (*block)(const T *, T *, int64_t, int64_t, int64_t, int64_t)) {
    const int64_t blocks = (N + kOut - 1) / kOut;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) block(w, out + b * kOut * K, N, K, b * kOut, kIn);
}

// AMX: [N / 32][K / 32][2][16][16][2], element [b, s, h, r, n, j] = w[32 b + 16 h + n][32 s + 2 r + j]
void amx_pack_block(const BF16 *w, BF16 *out, int64_t N, int64_t K, int64_t n0, int64_t) {
    uint32_t *pairs = reinterpret_cast<uint32_t *>(out);     // [j] pairs move as one word
    for (int64_t s = 0; s < K / 32; s++)
        for (int64_t h = 0; h < 2; h++)
            for (int64_t r = 0; r < 16; r++)
                for (int64_t n = 0; n < 16; n++) {
                    const int64_t row = n0 + 16 * h + n;
                    uint32_t pair = 0;
                    if (row < N) std::memcpy(&pair, w + row * K + 32 * s + 2 * r, 4);
                    *pairs++ = pair;
                }
}

// panels: [N / 16][K][16], element [p, k, n] = w[16 p + n][k]
void panel_pack_block(const float *w, float *out, int64_t N, int64_t K, int64_t n0, int64_t) {
    for (int64_t n = 0; n < 16; n++) {                  // each row of w read in order
        const float *row = w + (n0 + n) * K;
        for (int64_t k = 0; k < K; k++) out[k * 16 + n] = n0 + n < N ? row[k] : 0.f;
    }
}

// bfloat16 products on AMX tiles: y[M, N] = x[M, K] w[N, K]^T (+ bias[N]), K a multiple of
// 32, w packed by engines/cpu_kernels.py (`AmxLinear.pack`) as [N / 32][K / 32][2][16][16][2]:
// for each 32 outputs and 32 inputs two 1 KB B tiles (outputs 0-15 and 16-31), each row
// of a tile the pair of inputs 2r, 2r + 1 for its 16 outputs, the layout TDPBF16PS reads.
// N is padded to 32 with zero rows. Threads share the blocks of 32 outputs; each block
// streams its packed weight once (prefetched kPackAhead steps ahead), multiplied into up
// to 32 rows of x at a time: tiles 0-3 hold float32 sums for rows 0-15 / 16-31 by outputs
// 0-15 / 16-31, tiles 4-5 those rows of x, 6-7 the weight's two tiles. Each call
// configures the tiles of the threads it runs on and releases them at the end, so
// oneDNN's AMX kernels, which configure their own on every call, are not disturbed.
#if defined(ZPD_AMX)
constexpr int64_t kPackAhead = 4;

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

bool amx_permitted() {             // Linux hands out AMX state only to a process that asks
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return ok;
}

// GCC does not see ldtilecfg read the whole 64 bytes: without the barrier it dropped
// the stores of a config filled in a loop (tilezero then faulted on unconfigured tiles)
inline void load_tile_config(const TileConfig &c) {
    asm volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

void configure_tiles(int r0, int r1) {     // r0 rows in the first 16, r1 in the second
    TileConfig c;
    std::memset(&c, 0, sizeof c);
    c.palette = 1;
    auto set = [&](int tile, int rows) { c.rows[tile] = uint8_t(rows); c.colsb[tile] = 64; };
    set(0, r0), set(1, r0), set(4, r0), set(6, 16), set(7, 16);
    if (r1) set(2, r1), set(3, r1), set(5, r1);
    load_tile_config(c);
}

inline void prefetch_step(const BF16 *packed) {           // one step's two weight tiles
    const char *p = reinterpret_cast<const char *>(packed);
    for (int off = 0; off < 2048; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

inline __m512 load_bias(const BF16 *bias, __mmask16 mask) {
    if (!bias) return _mm512_setzero_ps();
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Rows m0..m0+mr-1 (mr <= 32) of outputs n0..n0+31 into `sums` [32][32].
void amx_block(const BF16 *x, const BF16 *packed, int64_t K, int64_t mr, float (*sums)[32]) {
    const int64_t steps = K / 32, stride = K * 2;
    _tile_zero(0);
    _tile_zero(1);
    if (mr > 16) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++) {
            if (s + kPackAhead < steps) prefetch_step(packed + (s + kPackAhead) * 1024);
            _tile_loadd(4, x + s * 32, stride);
            _tile_loadd(5, x + 16 * K + s * 32, stride);
            _tile_loadd(6, packed + s * 1024, 64);
            _tile_loadd(7, packed + s * 1024 + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, &sums[16][0], 128);
        _tile_stored(3, &sums[16][16], 128);
    } else {
        for (int64_t s = 0; s < steps; s++) {
            if (s + kPackAhead < steps) prefetch_step(packed + (s + kPackAhead) * 1024);
            _tile_loadd(4, x + s * 32, stride);
            _tile_loadd(6, packed + s * 1024, 64);
            _tile_loadd(7, packed + s * 1024 + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, &sums[0][0], 128);
    _tile_stored(1, &sums[0][16], 128);
}

int amx_linear(const BF16 *x, const BF16 *packed, const BF16 *bias, BF16 *y, int64_t M, int64_t N,
               int64_t K, int threads) {
    if (M < 1 || N < 1 || K < 32 || K % 32 || threads < 1) return kBadShape;
    if (!amx_permitted()) return kUnsupported;
    const int64_t blocks = (N + 31) / 32;
#pragma omp parallel num_threads(threads)
    {
        alignas(64) float sums[32][32];
        int64_t configured = 0;                  // rows the tiles are set up for (0: none)
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            const int64_t n0 = nb * 32, width = N - n0 < 32 ? N - n0 : 32;
            const __mmask16 lo = width >= 16 ? 0xffff : __mmask16((1u << width) - 1);
            const __mmask16 hi = width <= 16 ? 0 : __mmask16((1u << (width - 16)) - 1);
            const __m512 b0 = load_bias(bias ? bias + n0 : nullptr, lo);
            const __m512 b1 = load_bias(bias ? bias + n0 + 16 : nullptr, hi);
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                const int64_t mr = M - m0 < 32 ? M - m0 : 32;
                if (mr != configured) {
                    configure_tiles(int(mr < 16 ? mr : 16), int(mr > 16 ? mr - 16 : 0));
                    configured = mr;
                }
                amx_block(x + m0 * K, packed + nb * (K / 32) * 1024, K, mr, sums);
                for (int64_t m = 0; m < mr; m++) {
                    BF16 *out = y + (m0 + m) * N + n0;
                    _mm256_mask_storeu_epi16(out, lo, (__m256i)_mm512_cvtneps_pbh(
                        _mm512_add_ps(_mm512_load_ps(sums[m]), b0)));
                    _mm256_mask_storeu_epi16(out + 16, hi, (__m256i)_mm512_cvtneps_pbh(
                        _mm512_add_ps(_mm512_load_ps(sums[m] + 16), b1)));
                }
            }
        }
        if (configured) _tile_release();
    }
    return kOk;
}
#endif

// The layers' element-wise steps, float32 or bfloat16, rounding to the storage dtype
// where torch's own ops do (after each op), so they give torch's results to within
// float32 reordering. Rows are shared among threads when there are enough of them.
template <typename T>
inline float rounded(float x) {            // x as stored in T, back in float32
    T t;
    store(&t, x);
    return to_float(t);
}

constexpr int64_t kRowsPerThread = 16;

// out = weight * T(s * rsqrt(mean(s^2) + eps)), s = x (+ residual, stored in T into `sum`)
template <typename T>
void rms_norm(const T *x, const T *residual, const T *weight, float eps, T *out, T *sum,
              int64_t rows, int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= kRowsPerThread * 2)
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * dim;
        float ss = 0.f;
        if (residual) {
            T *sr = sum + r * dim;
            for (int64_t d = 0; d < dim; d++) {
                store(sr + d, to_float(xr[d]) + to_float(residual[r * dim + d]));
                const float v = to_float(sr[d]);
                ss += v * v;
            }
            xr = sr;                                   // the rounded sum is what is normed
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < dim; d++) ss += to_float(xr[d]) * to_float(xr[d]);
        }
        const float inv = 1.f / std::sqrt(ss / float(dim) + eps);
        T *o = out + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) store(o + d, to_float(weight[d]) * rounded<T>(to_float(xr[d]) * inv));
    }
}

// out[r, i] = T(silu(gate)) * up, gate_up = [rows, 2 * inter] (gate first)
template <typename T>
void silu_mul(const T *gate_up, T *out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= kRowsPerThread * 2)
    for (int64_t r = 0; r < rows; r++) {
        const T *g = gate_up + r * 2 * inter, *u = g + inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float x = to_float(g[i]);
            store(out + r * inter + i, rounded<T>(x / (1.f + expf(-x))) * to_float(u[i]));
        }
    }
}

// Rotary embedding of queries and keys from the fused projection qkv [rows, (hq + 2 hkv) D]
// (half-split convention, x * cos + roll(x) * sin with the sign in sin's table, each
// product rounded to T as torch's ops round them); rotated queries to q [rows, hq, D],
// rotated keys and the values to pool rows write_rows[r] of k_pool and v_pool (and the
// rotated keys to k_out [rows, hkv, D] too where it is given: a prefill attends to them).
template <typename T>
int rope_write(const T *qkv, const T *cos, const T *sin, const int64_t *write_rows, int64_t pool_rows,
               int64_t rows, int64_t hq, int64_t hkv, int64_t D, T *q, T *k_pool, T *v_pool,
               T *k_out, int threads) {
    if (D % 2 || D > kMaxHeadDim) return kBadShape;
    for (int64_t r = 0; r < rows; r++)
        if (write_rows[r] < 0 || write_rows[r] >= pool_rows) return kBadRow;
    const int64_t width = (hq + 2 * hkv) * D, half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= kRowsPerThread * 2)
    for (int64_t r = 0; r < rows; r++) {
        const T *src = qkv + r * width, *c = cos + r * D, *s = sin + r * D;
        for (int64_t h = 0; h < hq + hkv; h++) {
            const T *x = src + h * D;
            T *dst = h < hq ? q + (r * hq + h) * D : k_pool + (write_rows[r] * hkv + h - hq) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) {
                const float rolled = to_float(x[d < half ? d + half : d - half]);
                store(dst + d, rounded<T>(to_float(x[d]) * to_float(c[d]))
                                   + rounded<T>(rolled * to_float(s[d])));
            }
            if (h >= hq && k_out) std::memcpy(k_out + (r * hkv + h - hq) * D, dst, sizeof(T) * D);
        }
        std::memcpy(v_pool + write_rows[r] * hkv * D, src + (hq + hkv) * D, sizeof(T) * hkv * D);
    }
    return kOk;
}

// out[r] = index of the first maximum of row r of x [rows, n], a NaN counting as the
// maximum (torch.argmax's answer). The NaN test looks at the bits, which -ffast-math
// cannot assume away; the maximum and then its first position are found by vector
// passes (a block of 64 at a time, scanned only where it holds the maximum).
inline bool is_nan(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return (u & 0x7fffffffu) > 0x7f800000u;
}

template <typename T>
int64_t row_argmax(const T *x, int64_t n) {
    int nan = 0;
    float top = to_float(x[0]);
#pragma omp simd reduction(| : nan) reduction(max : top)
    for (int64_t i = 0; i < n; i++) {
        const float v = to_float(x[i]);
        nan |= int(is_nan(v));
        top = v > top ? v : top;
    }
    if (nan) {
        for (int64_t i = 0; i < n; i++)
            if (is_nan(to_float(x[i]))) return i;
    }
    constexpr int64_t kBlock = 64;
    for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t end = b + kBlock < n ? b + kBlock : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = b; i < end; i++) hit |= int(to_float(x[i]) == top);
        if (hit) {
            for (int64_t i = b; i < end; i++)
                if (to_float(x[i]) == top) return i;
        }
    }
    return 0;                                        // not reached: the maximum is in the row
}

template <typename T>
void argmax_rows(const T *x, int64_t rows, int64_t n, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * n, n);
}

// Causal attention of one prompt to itself in float32: q [n, hq, D], k and v [n, hkv, D]
// (a position's rows k_stride / v_stride elements apart), out [n, hq, D]. A work item is
// one KV head and a block of kQBlock positions: its G = hq / hkv query heads' rows (row
// r: position p0 + r / G, head h G + r % G) against keys in blocks of kKBlock, with the
// running maximum and sum of each row (the softmax in one pass), S = Q K^T with 6 rows
// by 64 keys of accumulators and O += P V with 6 or 3 rows by D; keys past a row's
// position are masked. Later blocks (more keys) are handed out first. Measured on
// SmolLM2's shapes (9/3 heads of 64, 1,024 positions, 2 threads): 9.9 ms per layer
// against 12.3 for torch's flash attention in float32; the softmax's exp as a polynomial
// (exp2_ps) instead of glibc's vector expf over stored rows: 10.5 -> 8.2 ms.
#if defined(__AVX512F__)
constexpr int64_t kQBlock = 64, kKBlock = 64, kRows = 6;
constexpr float kMasked = -1e30f;           // finite: -ffast-math assumes no infinities

constexpr float kLog2e = 1.44269504f;

// 2^x for x <= 0 (-1e30 included: 0), as 2^n 2^f with n = round(x), |f| <= 1/2, 2^f by
// its Taylor series in f ln 2 to the 6th power (relative error ~1e-7), where glibc's
// vector expf over a stored row cost a quarter of the float32 kernel's time.
inline __m512 exp2_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.69314718f));
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

template <int DV>                           // D = 16 DV
void causal_item(const float *q, const float *k, const float *v, int64_t k_stride, int64_t v_stride,
                 int64_t hq, int64_t hkv, int64_t h, int64_t p0, int64_t p1, float scale,
                 float *out, float *work) {
    constexpr int64_t D = 16 * DV, kPV = 24 / DV;          // rows per O += P V pass
    const int64_t G = hq / hkv, rows = (p1 - p0) * G, padded = (rows + kRows - 1) / kRows * kRows;
    float *Q = work, *O = Q + kQBlock * G * D + kRows * D, *S = O + kQBlock * G * D + kRows * D;
    float *KT = S + (kQBlock * G + kRows) * kKBlock, *V = KT + D * kKBlock;
    float *m = V + kKBlock * D, *l = m + kQBlock * G + kRows;
    for (int64_t r = 0; r < padded; r++) {
        const float *src = q + ((p0 + r / G) * hq + h * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) {
            Q[r * D + d] = r < rows ? src[d] * scale : 0.f;
            O[r * D + d] = 0.f;
        }
        m[r] = kMasked;
        l[r] = 0.f;
    }
    for (int64_t k0 = 0; k0 < p1; k0 += kKBlock) {
        const int64_t nk = p1 - k0 < kKBlock ? p1 - k0 : kKBlock;
        for (int64_t j = 0; j < kKBlock; j++) {            // this block's keys, transposed
            const float *kj = k + ((k0 + j) * k_stride) + h * D, *vj = v + ((k0 + j) * v_stride) + h * D;
            for (int64_t d = 0; d < D; d++) {
                KT[d * kKBlock + j] = j < nk ? kj[d] : 0.f;
                V[j * D + d] = j < nk ? vj[d] : 0.f;
            }
        }
        for (int64_t r = 0; r < padded; r += kRows) {      // S = Q K^T, masked
            __m512 acc[kRows][kKBlock / 16];
            for (int i = 0; i < kRows; i++)
                for (int c = 0; c < kKBlock / 16; c++) acc[i][c] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                __m512 kt[kKBlock / 16];
                for (int c = 0; c < kKBlock / 16; c++) kt[c] = _mm512_load_ps(KT + d * kKBlock + 16 * c);
                for (int i = 0; i < kRows; i++) {
                    const __m512 qv = _mm512_set1_ps(Q[(r + i) * D + d]);
                    for (int c = 0; c < kKBlock / 16; c++) acc[i][c] = _mm512_fmadd_ps(qv, kt[c], acc[i][c]);
                }
            }
            for (int i = 0; i < kRows; i++) {
                float *srow = S + (r + i) * kKBlock;
                for (int c = 0; c < kKBlock / 16; c++) _mm512_store_ps(srow + 16 * c, acc[i][c]);
                const int64_t seen = r + i < rows ? p0 + (r + i) / G - k0 : -1;   // keys 0..seen
                for (int64_t j = seen + 1 > 0 ? seen + 1 : 0; j < kKBlock; j++) srow[j] = kMasked;
                for (int64_t j = nk; j < kKBlock; j++) srow[j] = kMasked;
            }
        }
        for (int64_t r = 0; r < padded; r += kPV) {        // softmax update, O += P V
            float rescale[kPV];
            for (int i = 0; i < kPV; i++) {
                float *srow = S + (r + i) * kKBlock;
                __m512 s[kKBlock / 16], most = _mm512_set1_ps(m[r + i]), sums = _mm512_setzero_ps();
                for (int c = 0; c < kKBlock / 16; c++) {
                    s[c] = _mm512_load_ps(srow + 16 * c);
                    most = _mm512_max_ps(most, s[c]);
                }
                const float top = _mm512_reduce_max_ps(most);
                const __m512 t = _mm512_set1_ps(top), log2e = _mm512_set1_ps(kLog2e);
                for (int c = 0; c < kKBlock / 16; c++) {
                    const __m512 e = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(s[c], t), log2e));
                    _mm512_store_ps(srow + 16 * c, e);
                    sums = _mm512_add_ps(sums, e);
                }
                const float sum = _mm512_reduce_add_ps(sums);
                rescale[i] = expf(m[r + i] - top);
                l[r + i] = l[r + i] * rescale[i] + sum;
                m[r + i] = top;
            }
            __m512 acc[kPV][DV];
            for (int i = 0; i < kPV; i++)
                for (int c = 0; c < DV; c++)
                    acc[i][c] = _mm512_mul_ps(_mm512_load_ps(O + (r + i) * D + 16 * c), _mm512_set1_ps(rescale[i]));
            for (int64_t j = 0; j < nk; j++) {
                __m512 vj[DV];
                for (int c = 0; c < DV; c++) vj[c] = _mm512_load_ps(V + j * D + 16 * c);
                for (int i = 0; i < kPV; i++) {
                    const __m512 p = _mm512_set1_ps(S[(r + i) * kKBlock + j]);
                    for (int c = 0; c < DV; c++) acc[i][c] = _mm512_fmadd_ps(p, vj[c], acc[i][c]);
                }
            }
            for (int i = 0; i < kPV; i++)
                for (int c = 0; c < DV; c++) _mm512_store_ps(O + (r + i) * D + 16 * c, acc[i][c]);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = out + ((p0 + r / G) * hq + h * G + r % G) * D;
        const float inv = 1.f / l[r];                      // l >= 1: the maximum's term is 1
        for (int64_t d = 0; d < D; d++) dst[d] = O[r * D + d] * inv;
    }
}

int causal_attention(const float *q, const float *k, const float *v, int64_t k_stride, int64_t v_stride,
                     int64_t n, int64_t hq, int64_t hkv, int64_t D, float scale, float *out, int threads) {
    if (n < 1 || hkv < 1 || hq % hkv || threads < 1) return kBadShape;
    if (D != 64 && D != 128) return kUnsupported;
    const int64_t G = hq / hkv, blocks = (n + kQBlock - 1) / kQBlock, items = blocks * hkv;
    const int64_t rows = kQBlock * G + kRows;
    const int64_t floats = 2 * rows * D + rows * kKBlock + 2 * D * kKBlock + 2 * rows;
    int status = kOk;
#pragma omp parallel num_threads(threads)
    {
        float *work = static_cast<float *>(std::aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64));
        if (!work) {
#pragma omp atomic write
            status = kNoMemory;
        }
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < items; item++) {
            if (!work) continue;
            const int64_t b = blocks - 1 - item / hkv, h = item % hkv;
            const int64_t p0 = b * kQBlock, p1 = p0 + kQBlock < n ? p0 + kQBlock : n;
            if (D == 64) causal_item<4>(q, k, v, k_stride, v_stride, hq, hkv, h, p0, p1, scale, out, work);
            else causal_item<8>(q, k, v, k_stride, v_stride, hq, hkv, h, p0, p1, scale, out, work);
        }
        std::free(work);
    }
    return status;
}
#endif


// Causal attention of one bfloat16 prompt to itself on AMX tiles, the arguments of the
// float32 kernel above. K and V are first packed per KV head in blocks of 32 keys (zeros
// past n) as the B tiles of S = Q K^T ([2][D / 32][16][16][2]: element [h, c, r, j, e] =
// k[key 16 h + j][d 32 c + 2 r + e]) and of O += P V ([D / 16][16][16][2]: element
// [c, r, j, e] = v[key 2 r + e][d 16 c + j]). A work item is one query head and 16
// positions against keys in blocks of 64: S in four float32 tiles, the softmax update in
// AVX-512 (exp as a polynomial; the running maximum and sum per row), P rounded to
// bfloat16, and O, float32 in memory, loaded into four tiles at a time, P V added, stored.
// Products in bfloat16 with float32 sums, weights rounded to bfloat16 before P V, as in
// torch's flash attention. On SmolLM2's shapes (9/3 heads of 64, 1,024 positions, 2
// threads): 2.4 ms per layer against 4.8 for torch's flash attention, alternating.
#if defined(ZPD_AMX)
constexpr int64_t kAmxMaxHeadDim = 128;

void pack_kv_block(const BF16 *k, const BF16 *v, int64_t k_stride, int64_t v_stride, int64_t n,
                   int64_t D, int64_t h, int64_t b, BF16 *out) {
    const BF16 zero{0};
    for (int64_t half = 0; half < 2; half++)
        for (int64_t c = 0; c < D / 32; c++)
            for (int64_t r = 0; r < 16; r++)
                for (int64_t j = 0; j < 16; j++) {
                    const int64_t key = 32 * b + 16 * half + j;
                    for (int64_t e = 0; e < 2; e++)
                        *out++ = key < n ? k[key * k_stride + h * D + 32 * c + 2 * r + e] : zero;
                }
    for (int64_t c = 0; c < D / 16; c++)
        for (int64_t r = 0; r < 16; r++)
            for (int64_t j = 0; j < 16; j++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t key = 32 * b + 2 * r + e;
                    *out++ = key < n ? v[key * v_stride + h * D + 16 * c + j] : zero;
                }
}

// S for 16 rows (Q, [16][D]) by the 64 keys of two packed blocks, into S [16][64].
inline void amx_scores(const BF16 *Q, const BF16 *k0, const BF16 *k1, int64_t D, float (*S)[64]) {
    const int64_t cq = D / 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t c = 0; c < cq; c++) {
        _tile_loadd(2, Q + 32 * c, D * 2);
        _tile_loadd(3, k0 + c * 512, 64);
        _tile_loadd(6, k0 + (cq + c) * 512, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 6);
        _tile_loadd(7, k1 + c * 512, 64);
        _tile_loadd(3, k1 + (cq + c) * 512, 64);
        _tile_dpbf16ps(4, 2, 7);
        _tile_dpbf16ps(5, 2, 3);
    }
    _tile_stored(0, &S[0][0], 256);
    _tile_stored(1, &S[0][16], 256);
    _tile_stored(4, &S[0][32], 256);
    _tile_stored(5, &S[0][48], 256);
}

// O [16][D] += P [16][64] V, V the two packed blocks' value tiles.
inline void amx_add_pv(const BF16 (*P)[64], const BF16 *v0, const BF16 *v1, int64_t D, float *O) {
    _tile_loadd(2, &P[0][0], 128);
    _tile_loadd(7, &P[0][32], 128);
    for (int64_t c = 0; c < D / 16; c += 4) {
        _tile_loadd(0, O + 16 * c, D * 4);
        _tile_loadd(1, O + 16 * (c + 1), D * 4);
        _tile_loadd(4, O + 16 * (c + 2), D * 4);
        _tile_loadd(5, O + 16 * (c + 3), D * 4);
        _tile_loadd(3, v0 + c * 512, 64);
        _tile_loadd(6, v1 + c * 512, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(0, 7, 6);
        _tile_loadd(3, v0 + (c + 1) * 512, 64);
        _tile_loadd(6, v1 + (c + 1) * 512, 64);
        _tile_dpbf16ps(1, 2, 3);
        _tile_dpbf16ps(1, 7, 6);
        _tile_loadd(3, v0 + (c + 2) * 512, 64);
        _tile_loadd(6, v1 + (c + 2) * 512, 64);
        _tile_dpbf16ps(4, 2, 3);
        _tile_dpbf16ps(4, 7, 6);
        _tile_loadd(3, v0 + (c + 3) * 512, 64);
        _tile_loadd(6, v1 + (c + 3) * 512, 64);
        _tile_dpbf16ps(5, 2, 3);
        _tile_dpbf16ps(5, 7, 6);
        _tile_stored(0, O + 16 * c, D * 4);
        _tile_stored(1, O + 16 * (c + 1), D * 4);
        _tile_stored(4, O + 16 * (c + 2), D * 4);
        _tile_stored(5, O + 16 * (c + 3), D * 4);
    }
}

void amx_causal_item(const BF16 *q, const BF16 *packed, int64_t n, int64_t hq, int64_t D, int64_t qh,
                     int64_t p0, float scale, BF16 *out) {
    alignas(64) BF16 Q[16 * kAmxMaxHeadDim], P[16][64];
    alignas(64) float O[16 * kAmxMaxHeadDim], S[16][64];
    alignas(64) float m[16], l[16], top[16], alpha[16], sums[16];
    const int64_t rows = n - p0 < 16 ? n - p0 : 16, blocks = (p0 + rows + 63) / 64;
    const __m512 log2e_scale = _mm512_set1_ps(scale * kLog2e), masked = _mm512_set1_ps(kMasked);
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t i = 0; i < 16; i++) {                     // rows past n: zeros, not written
        if (i < rows) std::memcpy(Q + i * D, q + ((p0 + i) * hq + qh) * D, D * 2);
        else std::memset(Q + i * D, 0, D * 2);
        for (int64_t d = 0; d < D; d++) O[i * D + d] = 0.f;
        m[i] = kMasked, l[i] = 0.f;
    }
    for (int64_t b = 0; b < blocks; b++) {
        const BF16 *k0 = packed + 2 * b * 64 * D, *k1 = k0 + 64 * D;     // keys 0-31, 32-63
        amx_scores(Q, k0, k1, D, S);
        const bool edge = 64 * b + 63 > p0 || 64 * b + 64 > n;         // a key past a row
        for (int64_t i = 0; i < 16; i++) {                 // mask; each row's maximum
            __m512 s[4];
            for (int j = 0; j < 4; j++) s[j] = _mm512_load_ps(S[i] + 16 * j);
            if (edge) {
                const __m512i last = _mm512_set1_epi32(int((p0 + i < n ? p0 + i : n - 1) - 64 * b));
                for (int j = 0; j < 4; j++) {
                    const __m512i key = _mm512_add_epi32(lanes, _mm512_set1_epi32(16 * j));
                    s[j] = _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(key, last), masked, s[j]);
                    _mm512_store_ps(S[i] + 16 * j, s[j]);
                }
            }
            top[i] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3])));
        }
        const __m512 before = _mm512_load_ps(m), now = _mm512_max_ps(before, _mm512_load_ps(top));
        _mm512_store_ps(alpha, exp2_ps(_mm512_mul_ps(_mm512_sub_ps(before, now), log2e_scale)));
        _mm512_store_ps(m, now);
        for (int64_t i = 0; i < 16; i++) {                 // P = e^(scale (S - m)); rescale O
            const __m512 t = _mm512_set1_ps(m[i]);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < 4; j++) {
                const __m512 e = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(S[i] + 16 * j), t), log2e_scale));
                sum = _mm512_add_ps(sum, e);
                _mm256_store_si256(reinterpret_cast<__m256i *>(P[i] + 16 * j), (__m256i)_mm512_cvtneps_pbh(e));
            }
            sums[i] = _mm512_reduce_add_ps(sum);
            if (alpha[i] != 1.f)
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_store_ps(O + i * D + d, _mm512_mul_ps(_mm512_load_ps(O + i * D + d), _mm512_set1_ps(alpha[i])));
        }
        _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), _mm512_load_ps(alpha), _mm512_load_ps(sums)));
        amx_add_pv(P, k0 + 32 * D, k1 + 32 * D, D, O);
    }
    for (int64_t i = 0; i < rows; i++) {
        BF16 *dst = out + ((p0 + i) * hq + qh) * D;
        const __m512 inv = _mm512_set1_ps(1.f / l[i]);     // l >= 1: the maximum's term is 1
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(O + i * D + d), inv)));
    }
}

int amx_causal_attention(const BF16 *q, const BF16 *k, const BF16 *v, int64_t k_stride, int64_t v_stride,
                         int64_t n, int64_t hq, int64_t hkv, int64_t D, float scale, BF16 *out, int threads) {
    if (n < 1 || hkv < 1 || hq % hkv || threads < 1) return kBadShape;
    if ((D != 64 && D != 128) || !amx_permitted()) return kUnsupported;
    const int64_t kblocks = (n + 63) / 64 * 2, per = 64 * D;      // 32 keys' K and V: 64 D
    BF16 *packed = static_cast<BF16 *>(std::aligned_alloc(64, sizeof(BF16) * hkv * kblocks * per));
    if (!packed) return kNoMemory;
    const int64_t G = hq / hkv, qblocks = (n + 15) / 16;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < hkv * kblocks; item++) {
            const int64_t h = item / kblocks, b = item % kblocks;
            pack_kv_block(k, v, k_stride, v_stride, n, D, h, b, packed + item * per);
        }
        TileConfig c;                                      // eight tiles of 16 x 64 bytes
        std::memset(&c, 0, sizeof c);
        c.palette = 1;
        for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
        load_tile_config(c);
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < hq * qblocks; item++) {  // later positions (more keys) first
            const int64_t b = qblocks - 1 - item / hq, qh = item % hq;
            amx_causal_item(q, packed + qh / G * kblocks * per, n, hq, D, qh, 16 * b, scale, out);
        }
        _tile_release();
    }
    std::free(packed);
    return kOk;
}
#endif

}  // namespace

extern "C" {

int zpd_decode_attention_float32(const float *q, const float *k, const float *v,
                                 int64_t pool_rows, const int64_t *rows, const int64_t *lengths,
                                 int64_t batch, int64_t width, int64_t q_heads, int64_t kv_heads,
                                 int64_t head_dim, float scale, float *out, int threads) {
    return decode_attention(q, k, v, pool_rows, rows, lengths, batch, width, q_heads, kv_heads,
                            head_dim, scale, out, threads);
}

int zpd_decode_attention_bfloat16(const BF16 *q, const BF16 *k, const BF16 *v,
                                  int64_t pool_rows, const int64_t *rows, const int64_t *lengths,
                                  int64_t batch, int64_t width, int64_t q_heads, int64_t kv_heads,
                                  int64_t head_dim, float scale, BF16 *out, int threads) {
    return decode_attention(q, k, v, pool_rows, rows, lengths, batch, width, q_heads, kv_heads,
                            head_dim, scale, out, threads);
}

int zpd_linear_float32(const float *x, const float *w, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int threads) {
#if defined(__AVX512F__)
    return linear<Float32Lanes>(x, w, bias, y, M, N, K, threads);
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AVX-512
#endif
}

int zpd_linear_bfloat16(const BF16 *x, const BF16 *w, const BF16 *bias, BF16 *y, int64_t M,
                        int64_t N, int64_t K, int threads) {
#if defined(__AVX512BF16__)
    return linear<BFloat16Lanes>(x, w, bias, y, M, N, K, threads);
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AVX512-BF16
#endif
}

int zpd_causal_attention_float32(const float *q, const float *k, const float *v, int64_t k_stride,
                                 int64_t v_stride, int64_t n, int64_t hq, int64_t hkv, int64_t D,
                                 float scale, float *out, int threads) {
#if defined(__AVX512F__)
    return causal_attention(q, k, v, k_stride, v_stride, n, hq, hkv, D, scale, out, threads);
#else
    (void)q, (void)k, (void)v, (void)k_stride, (void)v_stride, (void)n, (void)hq, (void)hkv, (void)D;
    (void)scale, (void)out, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AVX-512
#endif
}

int zpd_causal_attention_bfloat16(const BF16 *q, const BF16 *k, const BF16 *v, int64_t k_stride,
                                  int64_t v_stride, int64_t n, int64_t hq, int64_t hkv, int64_t D,
                                  float scale, BF16 *out, int threads) {
#if defined(ZPD_AMX)
    return amx_causal_attention(q, k, v, k_stride, v_stride, n, hq, hkv, D, scale, out, threads);
#else
    (void)q, (void)k, (void)v, (void)k_stride, (void)v_stride, (void)n, (void)hq, (void)hkv, (void)D;
    (void)scale, (void)out, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AMX-BF16
#endif
}

int zpd_pack_amx_bfloat16(const BF16 *w, BF16 *out, int64_t N, int64_t K, int threads) {
    if (N < 1 || K < 32 || K % 32 || threads < 1) return kBadShape;
    pack_blocks<BF16, 32, 32>(w, out, N, K, threads, amx_pack_block);
    return kOk;
}

int zpd_pack_panel_float32(const float *w, float *out, int64_t N, int64_t K, int threads) {
    if (N < 1 || K < 1 || threads < 1) return kBadShape;
    pack_blocks<float, 16, 1>(w, out, N, K, threads, panel_pack_block);
    return kOk;
}

int zpd_linear_panel_float32(const float *x, const float *packed, const float *bias, float *y,
                             int64_t M, int64_t N, int64_t K, int threads) {
#if defined(__AVX512F__)
    return panel_linear(x, packed, bias, y, M, N, K, threads);
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AVX-512
#endif
}

int zpd_linear_amx_bfloat16(const BF16 *x, const BF16 *packed, const BF16 *bias, BF16 *y,
                            int64_t M, int64_t N, int64_t K, int threads) {
#if defined(ZPD_AMX)
    return amx_linear(x, packed, bias, y, M, N, K, threads);
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return kUnsupported;         // this CPU (or compiler) lacks AMX-BF16
#endif
}

#define ZPD_ELEMENTWISE(name, T)                                                                  \
    void zpd_rms_norm_##name(const T *x, const T *residual, const T *weight, float eps, T *out,  \
                             T *sum, int64_t rows, int64_t dim, int threads) {                   \
        rms_norm(x, residual, weight, eps, out, sum, rows, dim, threads);                        \
    }                                                                                             \
    void zpd_silu_mul_##name(const T *gate_up, T *out, int64_t rows, int64_t inter, int threads) { \
        silu_mul(gate_up, out, rows, inter, threads);                                            \
    }                                                                                             \
    void zpd_argmax_##name(const T *x, int64_t rows, int64_t n, int64_t *out, int threads) {     \
        argmax_rows(x, rows, n, out, threads);                                                   \
    }                                                                                             \
    int zpd_rope_write_##name(const T *qkv, const T *cos, const T *sin, const int64_t *write_rows,  \
                              int64_t pool_rows, int64_t rows, int64_t hq, int64_t hkv, int64_t D,  \
                              T *q, T *k_pool, T *v_pool, T *k_out, int threads) {                \
        return rope_write(qkv, cos, sin, write_rows, pool_rows, rows, hq, hkv, D, q, k_pool, v_pool, \
                          k_out, threads);                                                        \
    }
ZPD_ELEMENTWISE(float32, float)
ZPD_ELEMENTWISE(bfloat16, BF16)

}  // extern "C"
