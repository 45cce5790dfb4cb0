/* Quiver's decode-step attention for ONNX Runtime's CPU provider: op `DecodeAttention` in domain `ai.quiver`.
 *
 * ORT's GroupQueryAttention (com.microsoft) for a step of a few new rows a sequence, with its inputs
 * (query, or q, k and v packed in it; key; value; past key and value [B, kv heads, P, D]; seqlens_k;
 * total_sequence_length; the rotary cos and sin caches), outputs (the attention, the present key and value
 * [B, kv heads, max(P, total), D]) and the attributes Quiver's exports give it (num_heads, kv_num_heads,
 * scale, do_rotary, rotary_interleaved, local_window_size, softcap), computed as ORT's CPU kernel does:
 * the new keys rotated and written at positions seqlens_k + 1 - S..., each query attending to the keys up
 * to its own position (within the local window), scores scaled, capped, softmaxed in float32. The past
 * and present may be one buffer (past_present_share_buffer, as Quiver binds them): then only the new rows
 * are written. ORT's kernel multiplies each head by GEMMs that pack its keys afresh at every step (1.3 ms
 * a layer of a 3B model at 590 positions, where reading them takes ~0.2); here a task per (sequence, kv
 * head) reads its keys and values once, together, for all the heads that share them (`attend_block`).
 * A prompt's many rows keep ORT's GEMMs: Quiver's export names this op in a decode step's graph only. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define MOST_HEADS_A_KV_HEAD 64 /* query heads sharing one key and value head: GQA's groups are 1-16 */

typedef struct {
  Api api;
  int64_t heads, kv_heads, rotary, interleaved, window;
  float scale, softcap;
} Attention;

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define VECTORS 1
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vset _mm512_set1_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vunpacklo _mm512_unpacklo_ps
#define vunpackhi _mm512_unpackhi_ps
#define vunpacklo_pairs(x, y) _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)))
#define vunpackhi_pairs(x, y) _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)))
#define vmax _mm512_max_ps
#define vbits _mm512_castps_si512
#define vfloats _mm512_castsi512_ps
#define ishift_exponent(i) _mm512_slli_epi32(i, 23)
#define iadd _mm512_add_epi32
#define iset _mm512_set1_epi32
#else
#define LANES 8
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vset _mm256_set1_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vunpacklo _mm256_unpacklo_ps
#define vunpackhi _mm256_unpackhi_ps
#define vunpacklo_pairs(x, y) _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(x), _mm256_castps_pd(y)))
#define vunpackhi_pairs(x, y) _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(x), _mm256_castps_pd(y)))
#define vmax _mm256_max_ps
#define vbits _mm256_castps_si256
#define vfloats _mm256_castsi256_ps
#define ishift_exponent(i) _mm256_slli_epi32(i, 23)
#define iadd _mm256_add_epi32
#define iset _mm256_set1_epi32
#endif
#define MOST_DIMS 256 /* the largest head size whose sums a head keeps in registers */

/* Four vectors' sums within each 128-bit part, the first vector's in its first lane: their lanes added
 * pairwise as floats, then as pairs of floats. */
static inline vec quad_sums(vec a, vec b, vec c, vec e) {
  const vec ab = vadd(vunpacklo(a, b), vunpackhi(a, b)), ce = vadd(vunpacklo(c, e), vunpackhi(c, e));
  return vadd(vunpacklo_pairs(ab, ce), vunpackhi_pairs(ab, ce));
}

/* LANES vectors' sums, one a lane (`quad_sums`, then the 128-bit parts across vectors): ~3 instructions a
 * sum, where each vector's own horizontal sum takes ~8 in a chain of dependent shuffles. */
static inline vec lane_sums(const vec *v) {
  vec quads[LANES / 4];
  for (int i = 0; i < LANES / 4; i++) quads[i] = quad_sums(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
#if LANES == 16
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xdd));
#else
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20), _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
#endif
}

/* e^x for x <= 0 as ORT's softmax computes it (MLAS's constants and steps): x = n ln 2 + r, e^r by a
 * polynomial, 2^n put in the exponent's bits; x below -88.38 gives 0 (n never under -127). */
static inline vec exp_of_nonpositive(vec x) {
  x = vmax(x, vset(-88.3762626647949f));
  const vec biased = vfma(x, vset(1.44269504088896341f), vset(12582912.f)); /* n in the low bits of 1.5 x 2^23 */
  const vec n = vsub(biased, vset(12582912.f));
  x = vfma(n, vset(-6.93145752e-1f), x);
  x = vfma(n, vset(-1.42860677e-6f), x);
  vec p = vset(0x1.694000p-10f);
  p = vfma(p, x, vset(0x1.125edcp-7f));
  p = vfma(p, x, vset(0x1.555b5ap-5f));
  p = vfma(p, x, vset(0x1.555450p-3f));
  p = vfma(p, x, vset(0x1.fffff6p-2f));
  p = vfma(p, x, vset(1.f));
  p = vfma(p, x, vset(1.f));
  return vmul(p, vfloats(iadd(ishift_exponent(vbits(biased)), iset(0x3f800000))));
}

/* One block of LANES positions (keys and values rows of d floats, the first `real` of them real ones) for
 * every head of the group: softmax online, as flash decoding computes it. Per head: the block's scores
 * (LANES independent sums, reduced together by `lane_sums`), the running largest score, and the sum of the
 * exponentials and their products with the values, both rescaled where the largest grows. The keys and
 * the values are read from memory once a block for the group (its other heads find them in the first
 * level's cache) and the next block's of both are asked for meanwhile (`ahead`): two streams a thread,
 * where a pass over the keys and another over the values were one (13 GB/s for a 3B model's 28 layers at
 * 590 positions on two threads against ~28 the machine reads). Inlined for the common head sizes: the
 * rows' offsets are constants, and a head's sums stay in registers. */
static inline __attribute__((always_inline)) void attend_block(const float *queries, const float *k, const float *v,
                                                               int real, int ahead, float *sums, float *largest,
                                                               float *total, int64_t group, int64_t d, float scale,
                                                               float softcap) {
  for (int64_t h = 0; h < group; h++) {
    vec dots[LANES];
    for (int j = 0; j < LANES; j++) dots[j] = vzero();
    for (int64_t c = 0; c < d; c += LANES) {
      const vec q = vload(queries + h * d + c);
      if (h == 0 && ahead)
        for (int j = 0; j < LANES; j++) {
          _mm_prefetch((const char *)(k + (LANES + j) * d + c), _MM_HINT_T0);
          _mm_prefetch((const char *)(v + (LANES + j) * d + c), _MM_HINT_T0);
        }
#pragma GCC unroll 16
      for (int j = 0; j < LANES; j++) dots[j] = vfma(q, vload(k + j * d + c), dots[j]);
    }
    float p[LANES];
    vstore(p, vmul(lane_sums(dots), vset(scale)));
    if (softcap > 0.f)
      for (int j = 0; j < real; j++) p[j] = softcap * tanhf(p[j] / softcap);
    float top = largest[h];
    for (int j = 0; j < real; j++) top = p[j] > top ? p[j] : top;
    for (int j = real; j < LANES; j++) p[j] = -INFINITY; /* e^-inf = 0: no weight */
    const float shrink = expf(largest[h] - top);         /* 0 at the first block (-inf) */
    largest[h] = top;
    vstore(p, exp_of_nonpositive(vsub(vload(p), vset(top))));
    float added = 0.f;
    for (int j = 0; j < LANES; j++) added += p[j];
    total[h] = total[h] * shrink + added;
    vec out[MOST_DIMS / LANES];
    for (int64_t c = 0; c < d / LANES; c++) out[c] = vmul(vload(sums + h * d + c * LANES), vset(shrink));
    for (int j = 0; j < LANES; j++) {
      const vec weight = vset(p[j]);
      for (int64_t c = 0; c < d / LANES; c++) out[c] = vfma(weight, vload(v + j * d + c * LANES), out[c]);
    }
    for (int64_t c = 0; c < d / LANES; c++) vstore(sums + h * d + c * LANES, out[c]);
  }
}

/* One row's output for the group's heads over positions [start, seen), block by block (`attend_block`);
 * the last few positions through `pad` (2 x LANES rows of d: copies of the keys and values, zeros after). */
static inline __attribute__((always_inline)) void attend_online(const float *queries, const float *keys,
                                                                const float *values, float *out, float *sums,
                                                                float *pad, int64_t group, int64_t start,
                                                                int64_t seen, int64_t d, float scale, float softcap) {
  float largest[MOST_HEADS_A_KV_HEAD], total[MOST_HEADS_A_KV_HEAD];
  for (int64_t h = 0; h < group; h++) largest[h] = -INFINITY, total[h] = 0.f;
  memset(sums, 0, (size_t)(group * d) * sizeof(float));
  int64_t t = start;
  for (; t + LANES <= seen; t += LANES)
    attend_block(queries, keys + t * d, values + t * d, LANES, t + 2 * LANES <= seen, sums, largest, total, group, d,
                 scale, softcap);
  if (t < seen) {
    const int64_t real = seen - t;
    memcpy(pad, keys + t * d, (size_t)(real * d) * sizeof(float));
    memset(pad + real * d, 0, (size_t)((LANES - real) * d) * sizeof(float));
    memcpy(pad + LANES * d, values + t * d, (size_t)(real * d) * sizeof(float));
    memset(pad + (LANES + real) * d, 0, (size_t)((LANES - real) * d) * sizeof(float));
    attend_block(queries, pad, pad + LANES * d, (int)real, 0, sums, largest, total, group, d, scale, softcap);
  }
  for (int64_t h = 0; h < group; h++) {
    const vec inverse = vset(1.f / total[h]);
    for (int64_t c = 0; c < d; c += LANES) vstore(out + h * d + c, vmul(vload(sums + h * d + c), inverse));
  }
}

/* `attend_online` with the common head sizes as constants */
static void attend_vectors(const float *queries, const float *keys, const float *values, float *out, float *sums,
                           float *pad, int64_t group, int64_t start, int64_t seen, int64_t d, float scale,
                           float softcap) {
  switch (d) {
    case 64: attend_online(queries, keys, values, out, sums, pad, group, start, seen, 64, scale, softcap); break;
    case 128: attend_online(queries, keys, values, out, sums, pad, group, start, seen, 128, scale, softcap); break;
    case 256: attend_online(queries, keys, values, out, sums, pad, group, start, seen, 256, scale, softcap); break;
    default: attend_online(queries, keys, values, out, sums, pad, group, start, seen, d, scale, softcap);
  }
}
#endif

/* The same, portably, in two passes: every score, their softmax, then the values weighed by it (`scores`:
 * the group's rows of `stride` floats). */
static void attend_scalar(const float *queries, const float *keys, const float *values, float *out, float *scores,
                          int64_t stride, int64_t group, int64_t start, int64_t seen, int64_t d, float scale,
                          float softcap) {
  for (int64_t h = 0; h < group; h++) {
    float *x = scores + h * stride, largest = -INFINITY, sum = 0.f;
    for (int64_t t = start; t < seen; t++) {
      float score = 0.f;
      for (int64_t i = 0; i < d; i++) score += queries[h * d + i] * keys[t * d + i];
      x[t] = softcap > 0.f ? softcap * tanhf(score * scale / softcap) : score * scale;
      largest = x[t] > largest ? x[t] : largest;
    }
    for (int64_t t = start; t < seen; t++) sum += (x[t] = expf(x[t] - largest));
    float *y = out + h * d;
    memset(y, 0, (size_t)d * sizeof(float));
    for (int64_t t = start; t < seen; t++) {
      const float p = x[t] / sum;
      for (int64_t i = 0; i < d; i++) y[i] += p * values[t * d + i];
    }
  }
}

/* x's first 2 `half` dimensions turned by one position's angles: the two halves of them against each
 * other (GPT-NeoX's, Llama's), or each even dimension against the next (`interleaved`: GPT-J's). */
static void rotate(float *x, const float *cos, const float *sin, int64_t half, int64_t interleaved) {
  for (int64_t i = 0; i < half; i++) {
    const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    const float xa = x[a], xb = x[b];
    x[a] = xa * cos[i] - xb * sin[i];
    x[b] = xb * cos[i] + xa * sin[i];
  }
}

typedef struct {
  const Attention *self;
  const float *q, *k, *v; /* row r's heads at q + r * q_stride (k, v: + r * kv_stride) */
  int64_t q_stride, kv_stride;
  const float *past_key, *past_value;
  float *present_key, *present_value, *out;
  const int32_t *seqlens;
  const float *cos, *sin; /* [positions, half] */
  int64_t half, rows, dim, past_length, present_length;
  float scale; /* the node's, else ORT's default: 1 / sqrt(head size) */
  int shared_key, shared_value, failed;
} Work;

/* The keys or values of one (sequence, kv head): the past's rows copied where the present is another
 * buffer (the rest zeros), then the new rows written at their positions, keys turned by theirs. */
static void store_rows(const Work *w, const float *past, float *present, int shared, const float *rows, int64_t head,
                       int64_t first, int turn) {
  const int64_t d = w->dim;
  if (!shared) {
    memcpy(present, past, (size_t)(first * d) * sizeof(float));
    memset(present + first * d, 0, (size_t)((w->present_length - first) * d) * sizeof(float));
  }
  for (int64_t s = 0; s < w->rows; s++) {
    float *to = present + (first + s) * d;
    memcpy(to, rows + s * w->kv_stride + head * d, (size_t)d * sizeof(float));
    if (turn) rotate(to, w->cos + (first + s) * w->half, w->sin + (first + s) * w->half, w->half, w->self->interleaved);
  }
}

/* Task i: sequence i / kv heads, kv head i % kv heads, and the query heads that read it. */
static void attend_task(void *data, size_t i) {
  Work *w = data;
  const Attention *a = w->self;
  const int64_t b = (int64_t)i / a->kv_heads, g = (int64_t)i % a->kv_heads, d = w->dim;
  const int64_t group = a->heads / a->kv_heads, rows = w->rows, total = (int64_t)w->seqlens[b] + 1;
  const int64_t first = total - rows; /* the first new row's position */
  const size_t past_at = (size_t)((b * a->kv_heads + g) * w->past_length * d);
  const size_t present_at = (size_t)((b * a->kv_heads + g) * w->present_length * d);
  float *keys = w->present_key + present_at, *values = w->present_value + present_at;
  store_rows(w, w->past_key + past_at, keys, w->shared_key, w->k + b * rows * w->kv_stride, g, first, w->half > 0);
  store_rows(w, w->past_value + past_at, values, w->shared_value, w->v + b * rows * w->kv_stride, g, first, 0);
  /* per head of the group: its query and its sums; then either path's own: the vectors' copy of the last
   * positions (2 x 16 rows of d at most) or the scalar path's scores over the positions */
  const int64_t own = group * total > 2 * 16 * d ? group * total : 2 * 16 * d;
  float *scratch = malloc((size_t)(group * 2 * d + own) * sizeof(float));
  if (!scratch) {
    __atomic_store_n(&w->failed, 1, __ATOMIC_RELAXED);
    return;
  }
  float *queries = scratch, *sums = scratch + group * d, *scores = sums + group * d;
  for (int64_t s = 0; s < rows; s++) {
    const int64_t position = first + s, seen = position + 1;
    /* ORT's local window: the window's count of keys, the position's own the last (transformers' sliding window) */
    const int64_t start = a->window > 0 && seen > a->window ? seen - a->window : 0;
    const float *row = w->q + (b * rows + s) * w->q_stride;
    for (int64_t h = 0; h < group; h++) {
      memcpy(queries + h * d, row + (g * group + h) * d, (size_t)d * sizeof(float));
      if (w->half) rotate(queries + h * d, w->cos + position * w->half, w->sin + position * w->half, w->half, a->interleaved);
    }
    float *out = w->out + (b * rows + s) * a->heads * d + g * group * d;
#ifdef VECTORS
    if (d % LANES == 0 && d <= MOST_DIMS && group <= MOST_HEADS_A_KV_HEAD) {
      attend_vectors(queries, keys, values, out, sums, scores, group, start, seen, d, w->scale, a->softcap);
      continue;
    }
#endif
    attend_scalar(queries, keys, values, out, scores, total, group, start, seen, d, w->scale, a->softcap);
  }
  free(scratch);
}

static Status compute(void *kernel, void *context) {
  const Attention *self = kernel;
  Api api = self->api;
  size_t count = 0;
  Status status = CALL(api, KERNEL_CONTEXT_GET_INPUT_COUNT, get_count_t)(context, &count);
  if (status) return status;
  const void *data[9];
  int64_t dims[9][8], elements[9];
  size_t rank[9];
  static const int types[9] = {TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT,
                               TYPE_INT32, TYPE_INT32, TYPE_FLOAT, TYPE_FLOAT};
  for (size_t i = 0; i < 9; i++)
    if ((status = op_input(api, context, count, i, types[i], &data[i], dims[i], &rank[i], &elements[i]))) return status;
  if (!data[0] || rank[0] != 3) return failure(api, "DecodeAttention: the query must be [batch, rows, width]");
  const int64_t batch = dims[0][0], rows = dims[0][1], width = dims[0][2], heads = self->heads, kv = self->kv_heads;
  const int packed = !data[1] && !data[2];
  if (!packed && (!data[1] || !data[2])) return failure(api, "DecodeAttention: a key without a value, or a value without a key");
  const int64_t parts = packed ? heads + 2 * kv : heads;
  const int64_t d = width / parts;
  if (d <= 0 || d * parts != width) return failure(api, "DecodeAttention: the query's width is not the heads' whole dimension");
  for (int i = 1; i <= 2 && !packed; i++)
    if (rank[i] != 3 || dims[i][0] != batch || dims[i][1] != rows || dims[i][2] != kv * d)
      return failure(api, "DecodeAttention: the key and value must be [batch, rows, kv heads x head size]");
  if (!data[3] || !data[4]) return failure(api, "DecodeAttention: the past key and value are required");
  for (int i = 3; i <= 4; i++)
    if (rank[i] != 4 || dims[i][0] != batch || dims[i][1] != kv || dims[i][3] != d || dims[i][2] != dims[3][2])
      return failure(api, "DecodeAttention: the past key and value must be [batch, kv heads, length, head size]");
  if (!data[5] || elements[5] != batch) return failure(api, "DecodeAttention: seqlens_k must hold one length a sequence");
  if (!data[6] || elements[6] != 1) return failure(api, "DecodeAttention: total_sequence_length must be one number");
  const int64_t past_length = dims[3][2], total = *(const int32_t *)data[6];
  const int64_t present_length = total > past_length ? total : past_length;
  int64_t half = 0, positions = 0;
  if (self->rotary) {
    if (!data[7] || !data[8] || rank[7] != 2 || rank[8] != 2 || dims[7][0] != dims[8][0] || dims[7][1] != dims[8][1])
      return failure(api, "DecodeAttention: do_rotary needs cos and sin caches of one shape [positions, rotary dims / 2]");
    positions = dims[7][0];
    half = dims[7][1];
    if (half <= 0 || 2 * half > d) return failure(api, "DecodeAttention: the rotary caches are wider than the heads");
  }
  const int32_t *seqlens = data[5];
  for (int64_t b = 0; b < batch; b++) /* a length from outside: its rows, its positions within the buffers */
    if ((int64_t)seqlens[b] + 1 < rows || seqlens[b] >= present_length || (int64_t)seqlens[b] + 1 - rows > past_length ||
        (self->rotary && seqlens[b] >= positions))
      return failure(api, "DecodeAttention: a sequence's seqlens_k is outside its present buffer or the rotary caches");
  if (total < 0 || total > present_length) return failure(api, "DecodeAttention: a bad total_sequence_length");
  const int64_t out_dims[3] = {batch, rows, heads * d}, kv_dims[4] = {batch, kv, present_length, d};
  float *out = NULL, *present_key = NULL, *present_value = NULL;
  if ((status = op_output(api, context, 0, out_dims, 3, (void **)&out))) return status;
  if ((status = op_output(api, context, 1, kv_dims, 4, (void **)&present_key))) return status;
  if ((status = op_output(api, context, 2, kv_dims, 4, (void **)&present_value))) return status;
  const float *q = data[0];
  Work work = {
      self, q, packed ? q + heads * d : data[1], packed ? q + (heads + kv) * d : data[2], width,
      packed ? width : kv * d, data[3], data[4], present_key, present_value, out, seqlens, data[7], data[8],
      half, rows, d, past_length, present_length, self->scale != 0.f ? self->scale : 1.f / sqrtf((float)d),
      (const void *)present_key == data[3],
      (const void *)present_value == data[4], 0,
  };
  if (batch * rows == 0) return NULL;
  status = CALL(api, KERNEL_CONTEXT_PARALLEL_FOR, parallel_for_t)(context, attend_task, (size_t)(batch * kv), 0, &work);
  if (!status && work.failed) status = out_of_memory(api, "DecodeAttention: out of memory");
  return status;
}

static Status create_kernel(const OrtCustomOp *op, Api api, const void *info, void **kernel) {
  (void)op;
  Attention a = {api, 0, 0, 0, 0, -1, 0.f, 0.f};
  Status status = CALL(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, attribute_t)(info, "num_heads", &a.heads);
  if (!status) status = CALL(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, attribute_t)(info, "kv_num_heads", &a.kv_heads);
  if (status) return status;
  int_attribute(api, info, "do_rotary", 0, &a.rotary);
  int_attribute(api, info, "rotary_interleaved", 0, &a.interleaved);
  int_attribute(api, info, "local_window_size", -1, &a.window);
  float_attribute(api, info, "scale", 0.f, &a.scale);
  float_attribute(api, info, "softcap", 0.f, &a.softcap);
  if (a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads || a.heads > (1 << 16))
    return failure(api, "DecodeAttention: num_heads must be a positive multiple of kv_num_heads");
  Attention *self = malloc(sizeof(Attention));
  if (!self) return out_of_memory(api, "DecodeAttention: out of memory");
  *self = a;
  *kernel = self;
  return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "DecodeAttention"; }
static int input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 5 || i == 6 ? TYPE_INT32 : TYPE_FLOAT; }
static size_t input_count(const OrtCustomOp *op) { (void)op; return 9; }
static size_t output_count(const OrtCustomOp *op) { (void)op; return 3; }
static int input_kind(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == 1 || i == 2 || i >= 7 ? OPTIONAL : REQUIRED;
}

static const OrtCustomOp DECODE_ATTENTION = {
    OP_VERSION, NULL, op_name, cpu_provider, input_type, input_count, float_outputs, output_count, NULL,
    destroy_kernel, input_kind, required_outputs, cpu_memory, no_variadic, no_variadic, no_variadic, no_variadic,
    create_kernel, compute, NULL, first_version, any_version, {NULL, NULL, NULL, NULL},
};

const OrtCustomOp *quiver_decode_attention(void) { return &DECODE_ATTENTION; }
