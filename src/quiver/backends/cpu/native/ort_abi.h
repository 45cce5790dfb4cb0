/* ONNX Runtime's C ABI as Quiver's custom ops use it, declared here from its documented function table
 * (append-only across releases; the indices are positions in it), and what the ops share: a tensor's
 * checked shape, optional attributes, the errors they return. */
#ifndef QUIVER_ORT_ABI_H
#define QUIVER_ORT_ABI_H
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#define OP_VERSION 17          /* the OrtCustomOp fields read: up to GetEndVersion (ORT >= 1.17) */

typedef void *Status; /* OrtStatus*: NULL is success */
typedef void *const *Api;

/* positions in struct OrtApi */
enum {
  CREATE_STATUS = 0, CREATE_CUSTOM_OP_DOMAIN = 26, CUSTOM_OP_DOMAIN_ADD = 27, ADD_CUSTOM_OP_DOMAIN = 28,
  GET_TENSOR_MUTABLE_DATA = 51, GET_TENSOR_ELEMENT_TYPE = 60, GET_DIMENSIONS_COUNT = 61, GET_DIMENSIONS = 62,
  GET_TENSOR_TYPE_AND_SHAPE = 65, KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85, KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86, KERNEL_CONTEXT_GET_INPUT_COUNT = 88,
  KERNEL_CONTEXT_GET_INPUT = 90, KERNEL_CONTEXT_GET_OUTPUT = 91, RELEASE_STATUS = 93,
  RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99, RELEASE_CUSTOM_OP_DOMAIN = 101, KERNEL_CONTEXT_PARALLEL_FOR = 274,
};
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { TYPE_FLOAT = 1, TYPE_UINT8 = 2, TYPE_INT32 = 6, TYPE_FLOAT16 = 10 };
enum { REQUIRED = 0, OPTIONAL = 1 };

typedef struct OrtApiBase {
  Api (*GetApi)(uint32_t version);
  const char *(*GetVersionString)(void);
} OrtApiBase;

typedef struct OrtCustomOp OrtCustomOp;
struct OrtCustomOp {
  uint32_t version;
  void *(*CreateKernel)(const OrtCustomOp *, Api, const void *);
  const char *(*GetName)(const OrtCustomOp *);
  const char *(*GetExecutionProviderType)(const OrtCustomOp *);
  int (*GetInputType)(const OrtCustomOp *, size_t);
  size_t (*GetInputTypeCount)(const OrtCustomOp *);
  int (*GetOutputType)(const OrtCustomOp *, size_t);
  size_t (*GetOutputTypeCount)(const OrtCustomOp *);
  void (*KernelCompute)(void *, void *);
  void (*KernelDestroy)(void *);
  int (*GetInputCharacteristic)(const OrtCustomOp *, size_t);
  int (*GetOutputCharacteristic)(const OrtCustomOp *, size_t);
  int (*GetInputMemoryType)(const OrtCustomOp *, size_t);
  int (*GetVariadicInputMinArity)(const OrtCustomOp *);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp *);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp *);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp *);
  Status (*CreateKernelV2)(const OrtCustomOp *, Api, const void *, void **);
  Status (*KernelComputeV2)(void *, void *);
  Status (*InferOutputShapeFn)(const OrtCustomOp *, void *);
  int (*GetStartVersion)(const OrtCustomOp *);
  int (*GetEndVersion)(const OrtCustomOp *);
  void *later[4]; /* fields of later versions, unread at OP_VERSION */
};

#define CALL(api, index, type) ((type)(api)[index])
typedef Status (*create_status_t)(int, const char *);

static inline Status failure(Api api, const char *message) {
  return CALL(api, CREATE_STATUS, create_status_t)(ORT_INVALID_ARGUMENT, message);
}

static inline Status out_of_memory(Api api, const char *message) {
  return CALL(api, CREATE_STATUS, create_status_t)(ORT_FAIL, message);
}

typedef Status (*attribute_t)(const void *, const char *, int64_t *);
typedef Status (*float_attribute_t)(const void *, const char *, float *);
typedef void (*release_status_t)(void *);

/* An optional int64 attribute: `fallback` where the node has none. */
static inline void int_attribute(Api api, const void *info, const char *name, int64_t fallback, int64_t *value) {
  Status status = CALL(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, attribute_t)(info, name, value);
  if (status) {
    CALL(api, RELEASE_STATUS, release_status_t)(status);
    *value = fallback;
  }
}

/* An optional float attribute: `fallback` where the node has none. */
static inline void float_attribute(Api api, const void *info, const char *name, float fallback, float *value) {
  Status status = CALL(api, KERNEL_INFO_GET_ATTRIBUTE_FLOAT, float_attribute_t)(info, name, value);
  if (status) {
    CALL(api, RELEASE_STATUS, release_status_t)(status);
    *value = fallback;
  }
}

typedef Status (*get_input_t)(const void *, size_t, const void **);
typedef Status (*get_count_t)(const void *, size_t *);
typedef Status (*get_shape_t)(const void *, void **);
typedef Status (*dims_count_t)(const void *, size_t *);
typedef Status (*dims_t)(const void *, int64_t *, size_t);
typedef Status (*element_type_t)(const void *, int *);
typedef void (*release_t)(void *);
typedef Status (*mutable_data_t)(const void *, void **);
typedef Status (*get_output_t)(void *, size_t, const int64_t *, size_t, void **);
typedef Status (*parallel_for_t)(const void *, void (*)(void *, size_t), size_t, size_t, void *);

/* A tensor's element count (its shape checked: at most 8 dimensions, none negative, no overflow) and
 * its element type checked against what the op takes. */
static inline Status shape_of(Api api, const void *value, int type, int64_t *dims, size_t *rank, int64_t *count) {
  void *info = NULL;
  Status status = CALL(api, GET_TENSOR_TYPE_AND_SHAPE, get_shape_t)(value, &info);
  if (status) return status;
  int element = 0;
  status = CALL(api, GET_TENSOR_ELEMENT_TYPE, element_type_t)(info, &element);
  if (!status) status = CALL(api, GET_DIMENSIONS_COUNT, dims_count_t)(info, rank);
  if (!status && *rank > 8) status = failure(api, "a Quiver op: a tensor of more than 8 dimensions");
  if (!status) status = CALL(api, GET_DIMENSIONS, dims_t)(info, dims, *rank);
  CALL(api, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, release_t)(info);
  if (status) return status;
  if (element != type) return failure(api, "a Quiver op: an input of another element type");
  *count = 1;
  for (size_t i = 0; i < *rank; i++) {
    if (dims[i] < 0 || (dims[i] && *count > INT64_MAX / dims[i])) return failure(api, "a Quiver op: a bad shape");
    *count *= dims[i];
  }
  return NULL;
}

/* Input i's data and shape (its element type checked), or NULL data where an optional input is absent. */
static inline Status op_input(Api api, void *context, size_t count, size_t i, int type, const void **data,
                              int64_t *dims, size_t *rank, int64_t *elements) {
  const void *value = NULL;
  *data = NULL;
  *rank = 0;
  *elements = 0;
  if (i >= count) return NULL;
  Status status = CALL(api, KERNEL_CONTEXT_GET_INPUT, get_input_t)(context, i, &value);
  if (status || !value) return status;
  if ((status = shape_of(api, value, type, dims, rank, elements))) return status;
  return CALL(api, GET_TENSOR_MUTABLE_DATA, mutable_data_t)(value, (void **)data);
}

/* Output i of this shape, and its data. */
static inline Status op_output(Api api, void *context, size_t i, const int64_t *dims, size_t rank, void **data) {
  void *value = NULL;
  Status status = CALL(api, KERNEL_CONTEXT_GET_OUTPUT, get_output_t)(context, i, dims, rank, &value);
  if (status) return status;
  return CALL(api, GET_TENSOR_MUTABLE_DATA, mutable_data_t)(value, (void **)data);
}

const OrtCustomOp *quiver_matmul_4bits(void);
const OrtCustomOp *quiver_decode_attention(void);

static inline const char *cpu_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static inline int float_outputs(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static inline int required_outputs(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return REQUIRED; }
static inline int cpu_memory(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static inline int no_variadic(const OrtCustomOp *op) { (void)op; return 0; }
static inline int first_version(const OrtCustomOp *op) { (void)op; return 1; }
static inline int any_version(const OrtCustomOp *op) { (void)op; return INT_MAX; }
#endif
