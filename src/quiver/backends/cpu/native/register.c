/* The entry point of Quiver's custom-op library for ONNX Runtime: its ops in domain `ai.quiver`. */
#include <stddef.h>
#include <stdint.h>

#include "ort_abi.h"

typedef Status (*create_domain_t)(const char *, void **);
typedef Status (*domain_add_t)(void *, const OrtCustomOp *);
typedef Status (*add_domain_t)(void *, void *);
typedef void (*release_domain_t)(void *);

/* ORT's entry point for a custom-op library (SessionOptions.register_custom_ops_library, or called with
 * the C library's own OrtApiBase). A domain of its own for each session options: ORT's Python API may
 * release the domains of the options it drops, so one is never handed out twice (each is ~100 bytes,
 * kept for the process, as sessions keep pointing at it). */
Status RegisterCustomOps(void *options, const OrtApiBase *base) {
  Api api = base->GetApi(OP_VERSION);
  if (!api) return NULL; /* an ORT older than 1.17: nothing registered, its session fails on the ops */
  void *domain = NULL;
  Status status = CALL(api, CREATE_CUSTOM_OP_DOMAIN, create_domain_t)("ai.quiver", &domain);
  if (!status) status = CALL(api, CUSTOM_OP_DOMAIN_ADD, domain_add_t)(domain, quiver_matmul_4bits());
  if (!status) status = CALL(api, CUSTOM_OP_DOMAIN_ADD, domain_add_t)(domain, quiver_decode_attention());
  if (!status) status = CALL(api, ADD_CUSTOM_OP_DOMAIN, add_domain_t)(options, domain);
  if (status && domain) CALL(api, RELEASE_CUSTOM_OP_DOMAIN, release_domain_t)(domain);
  return status;
}
