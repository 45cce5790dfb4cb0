/* Quiver's 4-bit MatMul for ONNX Runtime's CPU provider: op `MatMul4Bits` in domain `ai.quiver`.
 *
 * Y[..., N] = A[..., K] W, W [K, N] in blocks of 32 along K with a scale and a minimum each, as GGUF's
 * Q4_1 holds them: w = s q + m, q in 0..15. Inputs: A (float); B (uint8 [N, K/32, 16], MatMulNBits'
 * layout: two values a byte, the low nibble first); the blocks' scales and minimums (float16 [N, 2, K/32]:
 * a column's scales, then its minimums). Two more float inputs may follow (MatMulNBits' scales and the
 * minimums' product beside it, for ORT's operators in this one's place): this kernel does not read them.
 * The weights are read where they lie (nothing is packed or copied when a session is made). A's blocks
 * are rounded to 16 bits each for a few rows (exact to ~2e-5 of the float product, where ORT's fast
 * kernel rounds them to 8 bits; at accuracy level 4 a node not marked few_rows takes 8, as ORT); for many (a prompt: AVX-512 VNNI) to 8 bits, as MLAS does, 16 columns of
 * weights widened at a time for VNNI's u8 x s8 products, or (attribute accuracy_level below 4) to 8 bits
 * twice, A then what that loses (~16 bits). Built by
 * quiver.backends.cpu.native_ops with the machine's own compiler (-march=native), beside the other ops
 * of Quiver's library (register.c); ONNX Runtime's C ABI as ort_abi.h declares it. */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#define FAST 1 /* AVX-512: 32 blocks' 16-bit products a VNNI instruction */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FAST 2 /* AVX2: one block's a pair of vpmaddwd */
#else
#define FAST 0
#endif

#define BLOCK 32
#define TASK_BYTES (48 * 1024) /* the least weight bytes a task reads */
#define MAX_TASKS 16           /* tasks a group of rows is cut into, at most */
#ifndef MANY_ROWS
#define MANY_ROWS 8            /* from this many rows of A on, 8-bit activations (a prompt) */
#endif

/* ---- A's rows, prepared: each block rounded to 16 bits, laid out for the kernel --------------------- */

/* Per pair of blocks: the even elements (32 int16: block 2p's 16, then 2p+1's), the odd ones, and the
 * blocks' scales spread over the 8 lanes each fills. Then the blocks' float sums (the minimums' factor),
 * zeros up to a multiple of 16. */
typedef struct {
  int16_t *even, *odd;
  float *scale, *sum;
} Row;

static int64_t round16(int64_t count) { return (count + 15) / 16 * 16; }

static size_t row_bytes(int64_t k) {
  const int64_t blocks = k / BLOCK, pairs = (blocks + 1) / 2;
  return (size_t)(pairs * 192 + round16(blocks) * 4);
}

static Row row_at(char *memory, int64_t k) {
  const int64_t pairs = (k / BLOCK + 1) / 2;
  Row r = {(int16_t *)memory, (int16_t *)(memory + pairs * 64), (float *)(memory + pairs * 128),
           (float *)(memory + pairs * 192)};
  return r;
}

static void prepare_row(const float *x, int64_t k, Row r) {
  const int64_t blocks = k / BLOCK;
  memset(r.even, 0, row_bytes(k)); /* a missing second block of the last pair, and the padding: zeros */
  for (int64_t b = 0; b < blocks; b++) {
    const float *xb = x + b * BLOCK;
    float largest = 0.f, sum = 0.f;
    for (int i = 0; i < BLOCK; i++) {
      const float a = fabsf(xb[i]);
      largest = a > largest ? a : largest;
      sum += xb[i];
    }
    r.sum[b] = sum;
    const float inverse = largest > 0.f ? 32767.f / largest : 0.f;
    const int64_t pair = b / 2, half = b % 2;
    int16_t *even = r.even + pair * 32 + half * 16, *odd = r.odd + pair * 32 + half * 16;
    for (int j = 0; j < 16; j++) {
      even[j] = (int16_t)lrintf(xb[2 * j] * inverse);
      odd[j] = (int16_t)lrintf(xb[2 * j + 1] * inverse);
    }
    float *scale = r.scale + pair * 16 + half * 8;
    for (int i = 0; i < 8; i++) scale[i] = largest / 32767.f;
  }
}

/* ---- the products --------------------------------------------------------------------------------- */

#if FAST == 1
/* One pair of blocks of one column into a float accumulator: the 32 bytes widened to 16 bits, low
 * nibbles against the even elements and high against the odd (VNNI's 16-bit dot product), each block's
 * integer sum, over its 8 lanes, scaled by the column's and the row's scales for it. */
#define PAIR(column_bytes, column_scales, pair, whole, f)                                                   \
  {                                                                                                         \
    const __m512i w_ = _mm512_cvtepu8_epi16(WEIGHTS((column_bytes) + (pair) * 32, whole));                 \
    __m512i dot_ = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_and_si512(w_, low), even);            \
    dot_ = _mm512_dpwssd_epi32(dot_, _mm512_srli_epi16(w_, 4), odd);                                        \
    const __m512 scale_ = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(HALF_PAIR((column_scales) + (pair) * 2))); \
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_), _mm512_mul_ps(scale_, row_scale), f);                    \
  }

/* A pair's 32 bytes; the last pair of an odd count has one block (16 bytes: a masked load, as the
 * column's end may be the tensor's). */
#define WEIGHTS(at, whole) \
  ((whole) ? _mm256_loadu_si256((const __m256i *)(at)) : _mm256_maskz_loadu_epi8(0xFFFFu, (at)))

#define ROW_PARTS(r, pair)                                                                                  \
  const __m512i even = _mm512_load_si512((r).even + (pair) * 32), odd = _mm512_load_si512((r).odd + (pair) * 32); \
  const __m512 row_scale = _mm512_load_ps((r).scale + (pair) * 16);

/* Two float16 scales (a pair's), as floats in the low lanes. */
static inline __m128 HALF_PAIR(const uint16_t *at) {
  uint32_t bits;
  memcpy(&bits, at, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128((int)bits));
}

/* The column's minimums times the row's block sums, added to f: sixteen blocks at a time. */
static inline __m512 with_minimums(__m512 f, const uint16_t *minimums, const float *sums, int64_t blocks) {
  for (int64_t b = 0; b < blocks; b += 16) {
    const __mmask16 keep = blocks - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (blocks - b)) - 1);
    const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, minimums + b));
    f = _mm512_fmadd_ps(m, _mm512_load_ps(sums + b), f);
  }
  return f;
}

/* Columns [n0, n1) of one row, four at a time. */
static void one_row(Row r, const uint8_t *B, const uint16_t *halves16, int64_t k, int64_t n0, int64_t n1, float *y) {
  const int64_t blocks = k / BLOCK, pairs = (blocks + 1) / 2, whole_pairs = blocks / 2;
  const __m512i low = _mm512_set1_epi16(0x0F);
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const int64_t column = blocks * 16, planes = 2 * blocks;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    const uint8_t *b = B + n * column;
    const uint16_t *s = halves16 + n * planes;
#define FOUR_COLUMNS(p, whole)                                                                              \
  {                                                                                                         \
    ROW_PARTS(r, p)                                                                                         \
    PAIR(b, s, p, whole, f0)                                                                                \
    PAIR(b + column, s + planes, p, whole, f1)                                                              \
    PAIR(b + 2 * column, s + 2 * planes, p, whole, f2)                                                      \
    PAIR(b + 3 * column, s + 3 * planes, p, whole, f3)                                                      \
  }
    /* the next four columns' bytes, asked for while these are read: they lie right after (128 bytes a pair) */
    const char *next = (const char *)(b + 4 * column);
    const int ahead = n + 8 <= n1;
    for (int64_t p = 0; p < whole_pairs; p++) {
      if (ahead) {
        _mm_prefetch(next + p * 128, _MM_HINT_T0);
        _mm_prefetch(next + p * 128 + 64, _MM_HINT_T0);
      }
      FOUR_COLUMNS(p, 1)
    }
    if (whole_pairs < pairs) FOUR_COLUMNS(whole_pairs, 0)
    y[n] = _mm512_reduce_add_ps(with_minimums(f0, s + blocks, r.sum, blocks));
    y[n + 1] = _mm512_reduce_add_ps(with_minimums(f1, s + planes + blocks, r.sum, blocks));
    y[n + 2] = _mm512_reduce_add_ps(with_minimums(f2, s + 2 * planes + blocks, r.sum, blocks));
    y[n + 3] = _mm512_reduce_add_ps(with_minimums(f3, s + 3 * planes + blocks, r.sum, blocks));
  }
  for (; n < n1; n++) {
    __m512 f0 = _mm512_setzero_ps();
    const uint16_t *s = halves16 + n * planes;
    for (int64_t p = 0; p < pairs; p++) {
      ROW_PARTS(r, p)
      PAIR(B + n * column, s, p, p < whole_pairs, f0)
    }
    y[n] = _mm512_reduce_add_ps(with_minimums(f0, s + blocks, r.sum, blocks));
  }
}

/* Columns [n0, n1) of four rows: each pair of blocks widened once for the four. */
static void four_rows(const Row *r, const uint8_t *B, const uint16_t *halves16, int64_t k, int64_t n0, int64_t n1,
                      float *y, int64_t ldy) {
  const int64_t blocks = k / BLOCK, pairs = (blocks + 1) / 2;
  const __m512i low = _mm512_set1_epi16(0x0F);
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const int64_t column = blocks * 16, planes = 2 * blocks;
  for (int64_t n = n0; n < n1; n++) {
    __m512 f[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const uint8_t *b = B + n * column;
    const uint16_t *s = halves16 + n * planes;
    for (int64_t p = 0; p < pairs; p++) {
      const __m512i w = _mm512_cvtepu8_epi16(WEIGHTS(b + p * 32, 2 * p + 1 < blocks));
      const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_srli_epi16(w, 4);
      const __m512 scale = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(HALF_PAIR(s + p * 2)));
      for (int i = 0; i < 4; i++) {
        __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(r[i].even + p * 32));
        dot = _mm512_dpwssd_epi32(dot, hi, _mm512_load_si512(r[i].odd + p * 32));
        f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_load_ps(r[i].scale + p * 16)), f[i]);
      }
    }
    for (int i = 0; i < 4; i++) y[i * ldy + n] = _mm512_reduce_add_ps(with_minimums(f[i], s + blocks, r[i].sum, blocks));
  }
}

/* Many rows (a prompt), MLAS's way: A's blocks rounded to 8 bits (a scale each, and their float sums for
 * the minimums), 16 columns of weights at a time laid out for VNNI's u8 x s8 product (the 4-bit values as
 * they are: 0..15 is the unsigned side) and every row against them, several rows a pass. */
typedef struct {
  int8_t *q;      /* [m, blocks, 32]: a block's even elements, then its odd ones */
  float *scale;   /* [m, blocks] */
  float *sum;     /* [m, blocks] */
} Rows8;

static size_t rows8_bytes(int64_t m, int64_t k) {
  return (size_t)m * (size_t)k + 2 * (size_t)m * (size_t)(k / BLOCK) * sizeof(float);
}

static Rows8 rows8_at(char *memory, int64_t m, int64_t k) {
  Rows8 r = {(int8_t *)memory, (float *)(memory + m * k), (float *)(memory + m * k) + m * (k / BLOCK)};
  return r;
}

/* Row x's blocks on 8 bits: q, the scales and the sums; with `rest` (a prompt at accuracy levels
 * below 4), what that loses too, as a second row on 8 bits of its own (255 times finer: the two together
 * are within ~2^-15 of x, as the few rows' 16 bits), its sums zero (the minimums' term is x's alone).
 * Without it a block's sum is that of its 8-bit values: the minimums' term then multiplies the very row
 * the products do, and the result is W's dequantized weights times the rounded row (x's own sums would add
 * m times the rounding's sum to it: -z s times it, for blocks with zero points). */
static void prepare_row8(const float *x, int64_t k, int8_t *q, float *scale, float *sum, int8_t *rest,
                         float *rest_scale, float *rest_sum) {
  const int64_t blocks = k / BLOCK;
  const __m512 sign = _mm512_set1_ps(-0.f);
  /* even elements to a block's first 16 bytes, odd to the next (the nibbles' order) */
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t b = 0; b < blocks; b++) {
    const __m512 lo = _mm512_loadu_ps(x + b * BLOCK), hi = _mm512_loadu_ps(x + b * BLOCK + 16);
    __m512 e = _mm512_permutex2var_ps(lo, evens, hi), o = _mm512_permutex2var_ps(lo, odds, hi);
    if (rest) sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi)); /* else the 8-bit row's, below */
    for (int pass = 0; pass < (rest ? 2 : 1); pass++) {
      const float largest =
          _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, e), _mm512_andnot_ps(sign, o)));
      const float step = largest / 127.f;
      const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
      const __m512i qe = _mm512_cvtps_epi32(_mm512_mul_ps(e, inverse));
      const __m512i qo = _mm512_cvtps_epi32(_mm512_mul_ps(o, inverse));
      int8_t *to = pass ? rest + b * BLOCK : q + b * BLOCK;
      _mm_storeu_si128((__m128i *)to, _mm512_cvtsepi32_epi8(qe));
      _mm_storeu_si128((__m128i *)(to + 16), _mm512_cvtsepi32_epi8(qo));
      if (pass) {
        rest_scale[b] = step;
        rest_sum[b] = 0.f;
      } else {
        scale[b] = step;
        if (!rest) sum[b] = step * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qe, qo));
        /* what the 8 bits lose: the next pass's row */
        e = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qe), _mm512_set1_ps(step), e);
        o = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qo), _mm512_set1_ps(step), o);
      }
    }
  }
}

/* 16 columns' weights for VNNI: per block, 8 groups of 16 dwords, a dword holding 4 of one column's values
 * (groups 0-3 the low nibbles of its bytes 0-15, groups 4-7 the high: the even elements, then the odd);
 * then the 16 scales and the 16 minimums as floats. Columns past n1 are zeros. */
static void tile_of(const uint8_t *B, const uint16_t *halves16, int64_t blocks, int64_t n, int64_t width,
                    uint32_t *tile) {
  /* four columns at a time, each read in order (16 columns side by side would be 16 streams a column's
   * length apart, which alias in the first-level cache when K is large): a 4 x 4 transpose of their words.
   * A column past the end reads one block of zeros over and over (stride 0). */
  static const uint8_t zero_bytes[16] = {0};
  static const uint16_t zero_halves[1] = {0};
  for (int64_t c = 0; c < 16; c += 4) {
    const uint8_t *bytes[4];
    const uint16_t *scales[4], *minimums[4];
    int64_t stride[4];
    for (int i = 0; i < 4; i++) {
      const int there = c + i < width;
      bytes[i] = there ? B + (n + c + i) * blocks * 16 : zero_bytes;
      scales[i] = there ? halves16 + (n + c + i) * 2 * blocks : zero_halves;
      minimums[i] = there ? scales[i] + blocks : zero_halves;
      stride[i] = there;
    }
    for (int64_t b = 0; b < blocks; b++) {
      __m128 r0 = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(bytes[0] + b * stride[0] * 16)));
      __m128 r1 = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(bytes[1] + b * stride[1] * 16)));
      __m128 r2 = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(bytes[2] + b * stride[2] * 16)));
      __m128 r3 = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(bytes[3] + b * stride[3] * 16)));
      _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
      uint32_t *t = tile + b * 160 + c;
      _mm_store_ps((float *)t, r0);
      _mm_store_ps((float *)t + 16, r1);
      _mm_store_ps((float *)t + 32, r2);
      _mm_store_ps((float *)t + 48, r3);
      const __m256 f = _mm256_cvtph_ps(_mm_setr_epi16(
          (short)scales[0][b * stride[0]], (short)scales[1][b * stride[1]], (short)scales[2][b * stride[2]],
          (short)scales[3][b * stride[3]], (short)minimums[0][b * stride[0]], (short)minimums[1][b * stride[1]],
          (short)minimums[2][b * stride[2]], (short)minimums[3][b * stride[3]]));
      _mm_store_ps((float *)t + 128, _mm256_castps256_ps128(f));
      _mm_store_ps((float *)t + 144, _mm256_extractf128_ps(f, 1));
    }
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; b++) {
    uint32_t *t = tile + b * 160;
    for (int g = 0; g < 4; g++) {
      const __m512i v = _mm512_load_si512(t + g * 16);
      _mm512_store_si512(t + g * 16, _mm512_and_si512(v, low));
      _mm512_store_si512(t + (g + 4) * 16, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
  }
}

/* R rows against one tile: per block, 8 VNNI products a row into integer sums, then scaled into floats. */
static inline __attribute__((always_inline)) void rows_on_tile(const int R, Rows8 a, int64_t first, int64_t blocks,
                                                               const uint32_t *tile, float *y, int64_t ldy,
                                                               __mmask16 keep, int add) {
  __m512 f[8];
  for (int i = 0; i < R; i++) f[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint32_t *t = tile + b * 160;
    __m512i dot[8];
    for (int i = 0; i < R; i++) dot[i] = _mm512_setzero_si512();
    for (int g = 0; g < 8; g++) {
      const __m512i w = _mm512_load_si512(t + g * 16);
      for (int i = 0; i < R; i++) {
        int32_t word;
        memcpy(&word, a.q + ((first + i) * blocks + b) * BLOCK + g * 4, 4);
        dot[i] = _mm512_dpbusd_epi32(dot[i], w, _mm512_set1_epi32(word));
      }
    }
    const __m512 scale = _mm512_load_ps((const float *)t + 128), minimum = _mm512_load_ps((const float *)t + 144);
    for (int i = 0; i < R; i++) {
      const int64_t at = (first + i) * blocks + b;
      f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(scale, _mm512_set1_ps(a.scale[at])), f[i]);
      f[i] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(a.sum[at]), f[i]);
    }
  }
  for (int i = 0; i < R; i++) {
    float *out = y + (first + i) * ldy;
    if (add) f[i] = _mm512_add_ps(f[i], _mm512_maskz_loadu_ps(keep, out));
    _mm512_mask_storeu_ps(out, keep, f[i]);
  }
}

/* Rows [first, last) of `a` into y's rows [0, last - first) (added to them with `add`), one tile. */
static void rows_of_tile(Rows8 a, int64_t first, int64_t last, int64_t blocks, const uint32_t *tile, float *y,
                         int64_t ldy, __mmask16 keep, int add) {
  int64_t r = first;
  y -= first * ldy;
  for (; r + 8 <= last; r += 8) rows_on_tile(8, a, r, blocks, tile, y, ldy, keep, add);
  switch (last - r) {
    case 7: rows_on_tile(7, a, r, blocks, tile, y, ldy, keep, add); break;
    case 6: rows_on_tile(6, a, r, blocks, tile, y, ldy, keep, add); break;
    case 5: rows_on_tile(5, a, r, blocks, tile, y, ldy, keep, add); break;
    case 4: rows_on_tile(4, a, r, blocks, tile, y, ldy, keep, add); break;
    case 3: rows_on_tile(3, a, r, blocks, tile, y, ldy, keep, add); break;
    case 2: rows_on_tile(2, a, r, blocks, tile, y, ldy, keep, add); break;
    case 1: rows_on_tile(1, a, r, blocks, tile, y, ldy, keep, add); break;
    default: break;
  }
}

/* `a` holds m rows, then (`exact`) their remainders as m more: those are added to the first ones' products. */
static void many_rows(Rows8 a, int64_t m, int exact, const uint8_t *B, const uint16_t *halves16, int64_t k,
                      int64_t n0, int64_t n1, float *y, int64_t ldy, uint32_t *tile) {
  const int64_t blocks = k / BLOCK;
  for (int64_t n = n0; n < n1; n += 16) {
    const int64_t width = n1 - n < 16 ? n1 - n : 16;
    tile_of(B, halves16, blocks, n, width, tile);
    const __mmask16 keep = (__mmask16)((1u << width) - 1);
    rows_of_tile(a, 0, m, blocks, tile, y + n, ldy, keep, 0);
    if (exact) rows_of_tile(a, m, 2 * m, blocks, tile, y + n, ldy, keep, 1);
  }
}

/* A few rows on 8 bits (accuracy level 4, a node not marked few_rows: `rtn`'s decode step, as MLAS rounds
 * it): per row, each group of four blocks as 64 even elements then 64 odd ones (the order of a column's 64
 * bytes' low and high nibbles), each block's scale over its 4 lanes, and the blocks' float sums. */
typedef struct {
  int8_t *q;
  float *scale, *sum;
} Few8;

static size_t few8_bytes(int64_t k) {
  const int64_t blocks = k / BLOCK, groups = (blocks + 3) / 4;
  return (size_t)(groups * 192 + round16(blocks) * 4);
}

static Few8 few8_at(char *memory, int64_t k) {
  const int64_t groups = (k / BLOCK + 3) / 4;
  Few8 r = {(int8_t *)memory, (float *)(memory + groups * 128), (float *)(memory + groups * 192)};
  return r;
}

static void prepare_few8(const float *x, int64_t k, Few8 r) {
  const int64_t blocks = k / BLOCK;
  memset(r.q, 0, few8_bytes(k)); /* the last group's missing blocks, and the sums' padding: zeros */
  for (int64_t b = 0; b < blocks; b++) {
    int8_t block[BLOCK]; /* its evens, then its odds */
    float scale;
    prepare_row8(x + b * BLOCK, BLOCK, block, &scale, r.sum + b, NULL, NULL, NULL);
    int8_t *group = r.q + (b / 4) * 128;
    memcpy(group + (b % 4) * 16, block, 16);
    memcpy(group + 64 + (b % 4) * 16, block + 16, 16);
    for (int i = 0; i < 4; i++) r.scale[(b / 4) * 16 + (b % 4) * 4 + i] = scale;
  }
}

/* Columns [n0, n1) of R rows (1 to 4), two columns at a time: a column's four blocks a 64-byte load, its
 * low and high nibbles against the rows' even and odd elements (VNNI's u8 x s8 products), each block's
 * integer sum over its 4 lanes scaled by the column's and the row's scales. */
static inline __attribute__((always_inline)) void few8_columns(const int R, const Few8 *r, const uint8_t *B,
                                                               const uint16_t *halves16, int64_t k, int64_t n0,
                                                               int64_t n1, float *y, int64_t ldy) {
  const int64_t blocks = k / BLOCK, groups = (blocks + 3) / 4, whole = blocks / 4, column = blocks * 16;
  const int64_t planes = 2 * blocks;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const int left = (int)(blocks - whole * 4); /* the last group's blocks, if it is not whole */
  const __mmask64 tail_bytes = left ? (((__mmask64)1 << (left * 16)) - 1) : 0;
  const __mmask8 tail_scales = (__mmask8)((1u << left) - 1);
  for (int64_t n = n0; n < n1; n += 2) {
    const int C = n + 1 < n1 ? 2 : 1;
    __m512 f[2][4];
    for (int c = 0; c < 2; c++)
      for (int i = 0; i < R; i++) f[c][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
      for (int c = 0; c < C; c++) {
        const uint8_t *b = B + (n + c) * column + g * 64;
        const uint16_t *s = halves16 + (n + c) * planes + g * 4;
        if (n + 2 + c < n1) _mm_prefetch((const char *)(b + 2 * column), _MM_HINT_T0);
        __m512i w;
        __m128 sc;
        if (g < whole) {
          w = _mm512_loadu_si512(b);
          sc = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)s));
        } else { /* masked: the column's end may be the tensor's */
          w = _mm512_maskz_loadu_epi8(tail_bytes, b);
          sc = _mm_cvtph_ps(_mm_maskz_loadu_epi16(tail_scales, s));
        }
        const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(sc));
        for (int i = 0; i < R; i++) {
          __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(r[i].q + g * 128));
          dot = _mm512_dpbusd_epi32(dot, hi, _mm512_load_si512(r[i].q + g * 128 + 64));
          f[c][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_load_ps(r[i].scale + g * 16)),
                                    f[c][i]);
        }
      }
    }
    for (int c = 0; c < C; c++) {
      const uint16_t *minimums = halves16 + (n + c) * planes + blocks;
      for (int i = 0; i < R; i++) y[i * ldy + n + c] = _mm512_reduce_add_ps(with_minimums(f[c][i], minimums, r[i].sum, blocks));
    }
  }
}

static void few8_rows(const Few8 *r, int rows, const uint8_t *B, const uint16_t *halves16, int64_t k, int64_t n0,
                      int64_t n1, float *y, int64_t ldy) {
  switch (rows) {
    case 4: few8_columns(4, r, B, halves16, k, n0, n1, y, ldy); break;
    case 3: few8_columns(3, r, B, halves16, k, n0, n1, y, ldy); break;
    case 2: few8_columns(2, r, B, halves16, k, n0, n1, y, ldy); break;
    default: few8_columns(1, r, B, halves16, k, n0, n1, y, ldy); break;
  }
}
#elif FAST == 2
/* The column's minimums times the row's block sums, added to f: eight blocks at a time. */
static inline __m256 with_minimums8(__m256 f, const uint16_t *minimums, const float *sums, int64_t blocks) {
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8)
    f = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(minimums + b))), _mm256_load_ps(sums + b), f);
  if (b < blocks) { /* the last few: the sums are zeros past the last block */
    uint16_t tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    memcpy(tail, minimums + b, (size_t)(blocks - b) * sizeof(uint16_t));
    f = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tail)), _mm256_load_ps(sums + b), f);
  }
  return f;
}

static inline float sum8(__m256 f) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

/* Columns [n0, n1) of one row, up to four at a time: each block's 16 bytes widened to 16 bits, low nibbles
 * against the even elements and high against the odd (vpmaddwd), scaled by the column's and row's scales. */
static void one_row(Row r, const uint8_t *B, const uint16_t *halves16, int64_t k, int64_t n0, int64_t n1, float *y) {
  const int64_t blocks = k / BLOCK, column = blocks * 16, planes = 2 * blocks;
  const __m256i low = _mm256_set1_epi16(0x0F);
  for (int64_t n = n0; n < n1; n += 4) {
    const int width = n1 - n < 4 ? (int)(n1 - n) : 4;
    __m256 f[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const uint8_t *b = B + n * column;
    const uint16_t *s = halves16 + n * planes;
    for (int64_t q = 0; q < blocks; q++) {
      const int64_t at = (q / 2) * 32 + (q % 2) * 16;
      const __m256i even = _mm256_load_si256((const __m256i *)(r.even + at));
      const __m256i odd = _mm256_load_si256((const __m256i *)(r.odd + at));
      const float row_scale = r.scale[(q / 2) * 16 + (q % 2) * 8];
      for (int c = 0; c < width; c++) {
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + c * column + q * 16)));
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(w, low), even),
                                             _mm256_madd_epi16(_mm256_srli_epi16(w, 4), odd));
        const __m256 scale = _mm256_set1_ps(_cvtsh_ss(s[c * planes + q]) * row_scale);
        f[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, f[c]);
      }
    }
    for (int c = 0; c < width; c++) y[n + c] = sum8(with_minimums8(f[c], s + c * planes + blocks, r.sum, blocks));
  }
}

static void four_rows(const Row *r, const uint8_t *B, const uint16_t *halves16, int64_t k, int64_t n0, int64_t n1,
                      float *y, int64_t ldy) {
  for (int i = 0; i < 4; i++) one_row(r[i], B, halves16, k, n0, n1, y + i * ldy);
}
#else
/* float16 bits to float (a machine without F16C: Quiver does not choose this op there, see quiver_fast) */
static float half_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else { /* subnormal */
      float value = ldexpf((float)mantissa, -24);
      return sign ? -value : value;
    }
  } else if (exponent == 31) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float value;
  memcpy(&value, &bits, 4);
  return value;
}

/* The same sums, portably. */
static void one_row(Row r, const uint8_t *B, const uint16_t *halves16, int64_t k, int64_t n0, int64_t n1, float *y) {
  const int64_t blocks = k / BLOCK;
  for (int64_t n = n0; n < n1; n++) {
    float total = 0.f;
    const uint16_t *s = halves16 + n * 2 * blocks;
    for (int64_t b = 0; b < blocks; b++) {
      const uint8_t *bytes = B + (n * blocks + b) * 16;
      const int16_t *even = r.even + (b / 2) * 32 + (b % 2) * 16, *odd = r.odd + (b / 2) * 32 + (b % 2) * 16;
      int32_t dot = 0;
      for (int j = 0; j < 16; j++) dot += (bytes[j] & 15) * even[j] + (bytes[j] >> 4) * odd[j];
      total += (float)dot * half_float(s[b]) * r.scale[(b / 2) * 16 + (b % 2) * 8] + half_float(s[blocks + b]) * r.sum[b];
    }
    y[n] = total;
  }
}

static void four_rows(const Row *r, const uint8_t *B, const uint16_t *halves16, int64_t k, int64_t n0, int64_t n1,
                      float *y, int64_t ldy) {
  for (int i = 0; i < 4; i++) one_row(r[i], B, halves16, k, n0, n1, y + i * ldy);
}
#endif

/* ---- the kernel ----------------------------------------------------------------------------------- */

typedef struct {
  Api api;
  int64_t k, n;
  int exact_rows; /* many rows' activations on 8 bits twice (x, then what that loses), not once: accuracy
                   * levels below 4, as a float activations' request (4, the default: once) */
  int few_rows;   /* a decode step's node (attribute few_rows): a few rows always on 16 bits */
} Kernel;

typedef struct {
  const float *a;
  const uint8_t *b;
  const uint16_t *halves;
  float *y;
  char *rows;
  int64_t m, k, n, columns_per_task, tasks_per_rows;
  int failed, exact, eight; /* eight: a few rows on 8 bits */
} Work;

static void prepare_task(void *data, size_t i) {
  Work *w = data;
#if FAST == 1
  if (w->eight) {
    prepare_few8(w->a + (int64_t)i * w->k, w->k, few8_at(w->rows + i * few8_bytes(w->k), w->k));
    return;
  }
#endif
  prepare_row(w->a + (int64_t)i * w->k, w->k, row_at(w->rows + i * row_bytes(w->k), w->k));
}

/* Task i: one range of columns, for one group of four rows (or the last rows, one by one). */
static void product_task(void *data, size_t i) {
  Work *w = data;
  const int64_t group = (int64_t)i / w->tasks_per_rows, part = (int64_t)i % w->tasks_per_rows;
  const int64_t n0 = part * w->columns_per_task;
  const int64_t n1 = n0 + w->columns_per_task < w->n ? n0 + w->columns_per_task : w->n;
  const int64_t first = group * 4, last = first + 4 <= w->m ? first + 4 : w->m;
#if FAST == 1
  if (w->eight) { /* the rows on 8 bits */
    Few8 rows[4];
    for (int64_t m = first; m < last; m++) rows[m - first] = few8_at(w->rows + m * few8_bytes(w->k), w->k);
    few8_rows(rows, (int)(last - first), w->b, w->halves, w->k, n0, n1, w->y + first * w->n, w->n);
    return;
  }
#endif
  const size_t bytes = row_bytes(w->k);
  Row rows[4];
  for (int64_t m = first; m < last; m++) rows[m - first] = row_at(w->rows + m * bytes, w->k);
  if (last - first == 4) {
    four_rows(rows, w->b, w->halves, w->k, n0, n1, w->y + first * w->n, w->n);
  } else {
    for (int64_t m = first; m < last; m++) one_row(rows[m - first], w->b, w->halves, w->k, n0, n1, w->y + m * w->n);
  }
}

#if FAST == 1
static void prepare8_task(void *data, size_t i) {
  Work *w = data;
  const int64_t rows = w->exact ? 2 * w->m : w->m, blocks = w->k / BLOCK, at = (int64_t)i, rest = at + w->m;
  const Rows8 r = rows8_at(w->rows, rows, w->k);
  prepare_row8(w->a + at * w->k, w->k, r.q + at * w->k, r.scale + at * blocks, r.sum + at * blocks,
               w->exact ? r.q + rest * w->k : NULL, r.scale + rest * blocks, r.sum + rest * blocks);
}

/* A thread's tile, kept for its next task (a tile is up to ~300 KB: allocating one a task cost the page
 * faults of a fresh mapping each time), freed when the thread ends. */
static pthread_key_t tile_key;
static pthread_once_t tile_once = PTHREAD_ONCE_INIT;
typedef struct {
  uint32_t *tile;
  size_t size;
} Tile;
static void free_tile(void *held) {
  free(((Tile *)held)->tile);
  free(held);
}
static void make_tile_key(void) { (void)pthread_key_create(&tile_key, free_tile); }

static uint32_t *thread_tile(size_t size) {
  (void)pthread_once(&tile_once, make_tile_key);
  Tile *held = pthread_getspecific(tile_key);
  if (!held) {
    held = calloc(1, sizeof(Tile));
    if (!held || pthread_setspecific(tile_key, held)) {
      free(held);
      return NULL;
    }
  }
  if (held->size < size) {
    free(held->tile);
    held->tile = aligned_alloc(64, size);
    held->size = held->tile ? size : 0;
  }
  return held->tile;
}

/* Task i of a prompt's many rows: one range of columns, every row. */
static void many_rows_task(void *data, size_t i) {
  Work *w = data;
  const int64_t n0 = (int64_t)i * w->columns_per_task;
  const int64_t n1 = n0 + w->columns_per_task < w->n ? n0 + w->columns_per_task : w->n;
  uint32_t *tile = thread_tile((size_t)(w->k / BLOCK) * 160 * sizeof(uint32_t));
  if (!tile) {
    __atomic_store_n(&w->failed, 1, __ATOMIC_RELAXED);
    return;
  }
  many_rows(rows8_at(w->rows, w->exact ? 2 * w->m : w->m, w->k), w->m, w->exact, w->b, w->halves, w->k, n0, n1,
            w->y, w->n, tile);
}
#endif


static Status compute(void *kernel, void *context) {
  const Kernel *self = kernel;
  Api api = self->api;
  const int64_t k = self->k, n = self->n, blocks = k / BLOCK;
  size_t inputs = 0;
  Status status = CALL(api, KERNEL_CONTEXT_GET_INPUT_COUNT, get_count_t)(context, &inputs);
  if (status) return status;
  static const int types[3] = {TYPE_FLOAT, TYPE_UINT8, TYPE_FLOAT16};
  const void *data[3];
  int64_t dims[3][8], count[3];
  size_t rank[3];
  for (size_t i = 0; i < 3; i++)
    if ((status = op_input(api, context, inputs, i, types[i], &data[i], dims[i], &rank[i], &count[i]))) return status;
  if (!data[0] || !data[1] || !data[2]) return failure(api, "MatMul4Bits: A, B and the blocks' scales are required");
  if (rank[0] < 1 || dims[0][rank[0] - 1] != k) return failure(api, "MatMul4Bits: A's last dimension is not K");
  if (count[1] != n * blocks * 16) return failure(api, "MatMul4Bits: B does not hold N x K / 32 blocks");
  if (count[2] != n * 2 * blocks) return failure(api, "MatMul4Bits: the scales and minimums are not N x 2 x K / 32");
  const int64_t m = count[0] / k;
  dims[0][rank[0] - 1] = n;
  void *y = NULL;
  if ((status = op_output(api, context, 0, dims[0], rank[0], &y))) return status;
  if (m == 0) return NULL;
  /* Tasks of whole columns, each reading at least TASK_BYTES of weights (a long run the prefetchers follow;
   * a small matrix's tasks cost more to hand out than to compute), at most MAX_TASKS a row group. */
  int64_t tasks = n * blocks * 20 / TASK_BYTES;
  tasks = tasks < 1 ? 1 : tasks > MAX_TASKS ? MAX_TASKS : tasks;
  const int64_t columns = ((n + tasks - 1) / tasks + 3) / 4 * 4;
  Work work = {data[0], data[1], data[2], y, NULL, m, k, n, columns, (n + columns - 1) / columns, 0, 0, 0};
  parallel_for_t parallel = CALL(api, KERNEL_CONTEXT_PARALLEL_FOR, parallel_for_t);
#if FAST == 1
  if (m >= MANY_ROWS) {
    work.exact = self->exact_rows;
    const size_t bytes = rows8_bytes(work.exact ? 2 : 1, k);
    if ((size_t)m > SIZE_MAX / bytes) return failure(api, "MatMul4Bits: too many rows");
    work.rows = aligned_alloc(64, (bytes * (size_t)m + 63) / 64 * 64);
    if (!work.rows) return out_of_memory(api, "MatMul4Bits: out of memory");
    work.columns_per_task = ((n + 31) / 32 + 15) / 16 * 16; /* about 32 tasks, whole tiles of 16 columns */
    status = parallel(context, prepare8_task, (size_t)m, 0, &work);
    if (!status)
      status = parallel(context, many_rows_task, (size_t)((n + work.columns_per_task - 1) / work.columns_per_task), 0, &work);
    free(work.rows);
    if (!status && work.failed) status = out_of_memory(api, "MatMul4Bits: out of memory");
    return status;
  }
#endif
#if FAST == 1
  work.eight = !self->exact_rows && !self->few_rows; /* as MLAS rounds them (ORT's level 4) */
  const size_t bytes = work.eight ? few8_bytes(k) : row_bytes(k);
#else
  const size_t bytes = row_bytes(k);
#endif
  if ((size_t)m > SIZE_MAX / bytes) return failure(api, "MatMul4Bits: too many rows");
  work.rows = aligned_alloc(64, bytes * (size_t)m);
  if (!work.rows) return out_of_memory(api, "MatMul4Bits: out of memory");
  if (m == 1) {
    prepare_task(&work, 0);
  } else {
    status = parallel(context, prepare_task, (size_t)m, 0, &work);
  }
  if (!status) status = parallel(context, product_task, (size_t)(((m + 3) / 4) * work.tasks_per_rows), 0, &work);
  free(work.rows);
  return status;
}

static Status create_kernel(const OrtCustomOp *op, Api api, const void *info, void **kernel) {
  (void)op;
  int64_t k = 0, n = 0, block = BLOCK, level = 4, few_rows = 0;
  Status status = CALL(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, attribute_t)(info, "K", &k);
  if (!status) status = CALL(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, attribute_t)(info, "N", &n);
  if (status) return status;
  int_attribute(api, info, "block_size", BLOCK, &block);
  /* as MatMulNBits': 4 lets the activations round to 8 bits (a decode step's too, unless few_rows); below,
   * a prompt's to ~16 (two 8-bit rows) */
  int_attribute(api, info, "accuracy_level", 4, &level);
  int_attribute(api, info, "few_rows", 0, &few_rows);
  /* at most 2^31 each: N x K / 32 x 20 (the task sizing) fits in int64 */
  if (block != BLOCK || k <= 0 || n <= 0 || k % BLOCK || k > (INT64_C(1) << 31) || n > (INT64_C(1) << 31))
    return failure(api, "MatMul4Bits: K and N must be positive, K a multiple of 32, in blocks of 32");
  Kernel *self = malloc(sizeof(Kernel));
  if (!self) return out_of_memory(api, "MatMul4Bits: out of memory");
  self->api = api;
  self->k = k;
  self->n = n;
  self->exact_rows = level < 4;
  self->few_rows = few_rows != 0;
  *kernel = self;
  return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "MatMul4Bits"; }
static int input_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == 1 ? TYPE_UINT8 : i == 2 ? TYPE_FLOAT16 : TYPE_FLOAT;
}
static size_t input_count(const OrtCustomOp *op) { (void)op; return 5; }
static size_t output_count(const OrtCustomOp *op) { (void)op; return 1; }
static int input_kind(const OrtCustomOp *op, size_t i) { (void)op; return i >= 3 ? OPTIONAL : REQUIRED; }

static const OrtCustomOp MATMUL_4BITS = {
    OP_VERSION, NULL, op_name, cpu_provider, input_type, input_count, float_outputs, output_count, NULL,
    destroy_kernel, input_kind, required_outputs, cpu_memory, no_variadic, no_variadic, no_variadic, no_variadic,
    create_kernel, compute, NULL, first_version, any_version, {NULL, NULL, NULL, NULL},
};

const OrtCustomOp *quiver_matmul_4bits(void) { return &MATMUL_4BITS; }

/* Which fast path this build has (1: AVX-512 VNNI, 2: AVX2; 0: none): Quiver uses the ops only where it has one. */
int quiver_fast(void) { return FAST; }
