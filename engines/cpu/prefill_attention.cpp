// Prefill attention of the engine's CPU library (shared definitions: kernels.h): a
// prompt's causal attention to itself, block by block, float32 in AVX-512 and bfloat16
// on AMX tiles, or by AVX512-BF16 dot products without AMX (prefill_attention_bf16.cpp)
// (engines/cpu/layer_ops.py, `LayerOps.causal_attention`).
#include "kernels.h"

using namespace zpd;

namespace {

// Causal attention of one prompt to itself in float32: q [n, hq, D], k and v [n, hkv, D]
// (a position's rows k_stride / v_stride elements apart), out [n, hq, D]. A work item is
// one KV head and a block of kQBlock positions: its G = hq / hkv query heads' rows (row
// r: position p0 + r / G, head h G + r % G) against keys in blocks of kKBlock, with the
// running maximum and sum of each row (the softmax in one pass), S = Q K^T with 6 rows
// by 64 keys of accumulators and O += P V with 6 or 3 rows by D; keys past a row's
// position are masked. Each KV head's keys are transposed once per call (not per work
// item and block) and values read in place. Later blocks (more keys) are handed out
// first. Measured on SmolLM2's shapes (9/3 heads of 64, 1,024 positions, 2 threads):
// 9.9 ms per layer against 12.3 for torch's flash attention in float32; the softmax's
// exp as a polynomial (exp2_ps) instead of glibc's vector expf over stored rows: 10.5
// -> 8.2 ms; keys transposed once: 7.8 -> 7.3 ms (each pair alternating). On an AMD
// EPYC, Q scaled into log2 units (no multiply per score), masks as vector blends and
// O += P V stopped at the pass's last visible key: 8.78 / 9.01 / 8.73 -> 8.35 / 8.50 /
// 8.30 ms, 2,048 positions 32.0 -> 30.9 (keys in blocks of 128 took longer: 8.2 -> 8.8).
#if defined(__AVX512F__)
constexpr int64_t kQBlock = 64, kKBlock = 64, kRows = 6;

// S = Q K^T for kRows rows of Q (in log2 units) by a block's keys (transposed, KT [D]
// [kKBlock]), keys past `last[i]` (row i's last visible key of the block) masked
template <int64_t D>
inline void scores(const float *Q, const float *KT, float *S, const int64_t *last) {
    constexpr int kC = kKBlock / 16;
    __m512 acc[kRows][kC];
    for (int i = 0; i < kRows; i++)
        for (int c = 0; c < kC; c++) acc[i][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 kt[kC];
        for (int c = 0; c < kC; c++) kt[c] = _mm512_load_ps(KT + d * kKBlock + 16 * c);
        for (int i = 0; i < kRows; i++) {
            const __m512 qv = _mm512_set1_ps(Q[i * D + d]);
            for (int c = 0; c < kC; c++) acc[i][c] = _mm512_fmadd_ps(qv, kt[c], acc[i][c]);
        }
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int i = 0; i < kRows; i++)
        for (int c = 0; c < kC; c++) {
            const __mmask16 hidden = _mm512_cmpgt_epi32_mask(
                _mm512_add_epi32(lane, _mm512_set1_epi32(16 * c)), _mm512_set1_epi32(int(last[i])));
            _mm512_store_ps(S + i * kKBlock + 16 * c, _mm512_mask_mov_ps(acc[i][c], hidden, _mm512_set1_ps(kMasked)));
        }
}

template <int DV>                           // D = 16 DV
void causal_item(const float *q, const float *keys_t, const float *v, int64_t v_stride, int64_t hq,
                 int64_t hkv, int64_t h, int64_t p0, int64_t p1, float scale, float *out, float *work) {
    constexpr int64_t D = 16 * DV, kPV = 24 / DV;          // rows per O += P V pass
    const int64_t G = hq / hkv, rows = (p1 - p0) * G, padded = (rows + kRows - 1) / kRows * kRows;
    float *Q = work, *O = Q + kQBlock * G * D + kRows * D, *S = O + kQBlock * G * D + kRows * D;
    float *m = S + (kQBlock * G + kRows) * kKBlock, *l = m + kQBlock * G + kRows;
    const float log2_scale = scale * kLog2e;               // scores in log2 units: exp2 is the kernel's
    for (int64_t r = 0; r < padded; r++) {
        const float *src = q + ((p0 + r / G) * hq + h * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) {
            Q[r * D + d] = r < rows ? src[d] * log2_scale : 0.f;
            O[r * D + d] = 0.f;
        }
        m[r] = kMasked;
        l[r] = 0.f;
    }
    // the last key row r sees in the block from k0 (a padding row: the last real row's)
    auto last_key = [&](int64_t r, int64_t k0) { return p0 + (r < rows ? r : rows - 1) / G - k0; };
    for (int64_t k0 = 0; k0 < p1; k0 += kKBlock) {
        const float *KT = keys_t + k0 * D, *V = v + k0 * v_stride + h * D;    // this block's keys
        for (int64_t r = 0; r < padded; r += kRows) {      // S = Q K^T, masked
            int64_t last[kRows];
            for (int i = 0; i < kRows; i++) last[i] = last_key(r + i, k0);
            scores<D>(Q + r * D, KT, S + r * kKBlock, last);
        }
        for (int64_t r = 0; r < padded; r += kPV) {        // softmax update, O += P V
            float rescale[kPV];
            for (int i = 0; i < kPV; i++)
                rescale[i] = softmax_update<kKBlock>(S + (r + i) * kKBlock, m[r + i], l[r + i]);
            __m512 acc[kPV][DV];
            for (int i = 0; i < kPV; i++)
                for (int c = 0; c < DV; c++)
                    acc[i][c] = _mm512_mul_ps(_mm512_load_ps(O + (r + i) * D + 16 * c), _mm512_set1_ps(rescale[i]));
            const int64_t seen = last_key(r + kPV - 1, k0) + 1;    // keys past it weigh 0 for all
            for (int64_t j = 0; j < (seen < kKBlock ? seen : kKBlock); j++) {
                __m512 vj[DV];
                for (int c = 0; c < DV; c++) vj[c] = _mm512_loadu_ps(V + j * v_stride + 16 * c);
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
    const int64_t kblocks = (n + kKBlock - 1) / kKBlock, rows = kQBlock * G + kRows;
    const int64_t floats = 2 * rows * D + rows * kKBlock + 2 * rows;
    // each KV head's keys transposed once, per block of kKBlock: [hkv][blocks][D][kKBlock]
    float *kt = static_cast<float *>(std::aligned_alloc(64, sizeof(float) * hkv * kblocks * D * kKBlock));
    if (!kt) return kNoMemory;
    int status = kOk;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t hb = 0; hb < hkv * kblocks; hb++) {
            const int64_t h = hb / kblocks, k0 = hb % kblocks * kKBlock;
            float *dst = kt + hb * D * kKBlock;
            for (int64_t j = 0; j < kKBlock; j++) {
                const float *kj = k + (k0 + j) * k_stride + h * D;
                if (k0 + j < n)
                    for (int64_t d = 0; d < D; d++) dst[d * kKBlock + j] = kj[d];
                else
                    for (int64_t d = 0; d < D; d++) dst[d * kKBlock + j] = 0.f;
            }
        }
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
            const float *head = kt + h * kblocks * D * kKBlock;
            if (D == 64) causal_item<4>(q, head, v, v_stride, hq, hkv, h, p0, p1, scale, out, work);
            else causal_item<8>(q, head, v, v_stride, hq, hkv, h, p0, p1, scale, out, work);
        }
        std::free(work);
    }
    std::free(kt);
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
    const int status = amx_causal_attention(q, k, v, k_stride, v_stride, n, hq, hkv, D, scale, out, threads);
    if (status != kUnsupported) return status;
#endif
    return dot_causal_attention(q, k, v, k_stride, v_stride, n, hq, hkv, D, scale, out, threads);
}

}  // extern "C"
