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
 * head) reads its keys once and its values once for all the heads that share them. A prompt's many rows
 * keep ORT's GEMMs: Quiver's export names this op in a decode step's graph only. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

typedef struct {
  Api api;
  int64_t heads, kv_heads, rotary, interleaved, window;
  float scale, softcap;
} Attention;

static float dot(const float *a, const float *b, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 s = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s);
  total = _mm512_reduce_add_ps(s);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 s = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_hadd_ps(h, h);
  total = _mm_cvtss_f32(_mm_hadd_ps(h, h));
#endif
  for (; i < n; i++) total += a[i] * b[i];
  return total;
}

/* y += p x */
static void add_scaled(float *y, float p, const float *x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 f = _mm512_set1_ps(p);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(f, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 f = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(f, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; i++) y[i] += p * x[i];
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
  /* per head of the group: its query, its scores over the positions, its output */
  float *scratch = malloc((size_t)(group * (2 * d + total)) * sizeof(float));
  if (!scratch) {
    __atomic_store_n(&w->failed, 1, __ATOMIC_RELAXED);
    return;
  }
  float *queries = scratch, *sums = scratch + group * d, *scores = scratch + 2 * group * d;
  for (int64_t s = 0; s < rows; s++) {
    const int64_t position = first + s, seen = position + 1;
    /* ORT's local window: the window's count of keys, the position's own the last (transformers' sliding window) */
    const int64_t start = a->window > 0 && seen > a->window ? seen - a->window : 0;
    const float *row = w->q + (b * rows + s) * w->q_stride;
    for (int64_t h = 0; h < group; h++) {
      memcpy(queries + h * d, row + (g * group + h) * d, (size_t)d * sizeof(float));
      if (w->half) rotate(queries + h * d, w->cos + position * w->half, w->sin + position * w->half, w->half, a->interleaved);
    }
    for (int64_t t = start; t < seen; t++) { /* each key read once for the group */
      const float *key = keys + t * d;
      for (int64_t h = 0; h < group; h++) scores[h * total + t] = dot(queries + h * d, key, d) * w->scale;
    }
    for (int64_t h = 0; h < group; h++) {
      float *x = scores + h * total;
      if (a->softcap > 0.f)
        for (int64_t t = start; t < seen; t++) x[t] = a->softcap * tanhf(x[t] / a->softcap);
      float largest = -INFINITY, sum = 0.f;
      for (int64_t t = start; t < seen; t++) largest = x[t] > largest ? x[t] : largest;
      for (int64_t t = start; t < seen; t++) sum += (x[t] = expf(x[t] - largest));
      const float inverse = 1.f / sum;
      for (int64_t t = start; t < seen; t++) x[t] *= inverse;
    }
    memset(sums, 0, (size_t)(group * d) * sizeof(float));
    for (int64_t t = start; t < seen; t++) { /* each value read once for the group */
      const float *value = values + t * d;
      for (int64_t h = 0; h < group; h++) add_scaled(sums + h * d, scores[h * total + t], value, d);
    }
    float *out = w->out + (b * rows + s) * a->heads * d + g * group * d;
    memcpy(out, sums, (size_t)(group * d) * sizeof(float));
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
