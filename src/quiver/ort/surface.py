"""What `quiver.ort` does with each public name of onnxruntime: implemented, delegated, or refused.

* **Implemented over Quiver** (defined in this package): `InferenceSession`, `SessionOptions`,
  `RunOptions`, `LoraAdapter`, `NodeArg`, `ModelMetadata`, `IOBinding` / `SessionIOBinding`, the
  provider queries, the error classes, `ModelCompiler`, `set_global_thread_pool_sizes` (ORT's, and
  Quiver's sessions then run on those pools), `set_default_logger_severity` / `_callback` (ORT's, and
  Quiver's sessions then log at that severity), and the `backend` module.
* **Delegated** (`DELEGATED`: ORT's own objects, so values made with either module are interchangeable):
  data types and enums (`OrtValue`, `SparseTensor`, `OrtDevice`, `OrtMemoryInfo`, ...), process-wide
  settings and queries (logging, telemetry, thread pools, seeds, build info, EP libraries), model
  packaging tools, and ORT's subpackages but `backend`: `capi` (ORT's error classes live there;
  Quiver's derive from them), `quantization`, `tools`, `transformers`, `datasets`.
* **Refused** (on `InferenceSession`) with an ORT-typed error that says why: `set_ep_dynamic_options`
  and memory bound on another device than the CPU. `get_provider_graph_assignment_info` answers as
  for a compiling EP: the whole graph is one subgraph of the session's provider.
* `ModelCompiler` (ORT's compile API) is implemented in `compiler.py`.

A name onnxruntime adds in a new release is in none of these lists, and `tests/unit/test_ort_surface.py`
fails until it is decided.
"""

from __future__ import annotations

DELEGATED = frozenset(
    {
        # data types and enums
        "AdapterFormat",
        "ExecutionOrder",
        "OrtAllocatorType",
        "OrtArenaCfg",
        "OrtCompileApiFlags",
        "OrtDevice",
        "OrtDeviceMemoryType",
        "OrtDeviceVendorId",
        "OrtEpAssignedNode",
        "OrtEpAssignedSubgraph",
        "OrtEpContextData",
        "OrtEpContextDataBuffer",
        "OrtEpDevice",
        "OrtExecutionProviderDevicePolicy",
        "OrtExternalInitializerInfo",
        "OrtHardwareDevice",
        "OrtHardwareDeviceType",
        "OrtMemType",
        "OrtMemoryInfo",
        "OrtMemoryInfoDeviceType",
        "OrtSparseFormat",
        "OrtSyncStream",
        "OrtValue",
        "SparseTensor",
        "copy_tensors",
        # model packaging (files, independent of the engine that runs them)
        "ModelPackage",
        "ModelPackageComponentContext",
        "ModelPackageContext",
        "ModelPackageOptions",
        "ModelPackageWriteMode",
        # process-wide settings and queries
        "create_and_register_allocator",
        "create_and_register_allocator_v2",
        "cuda_version",
        "disable_telemetry_events",
        "enable_telemetry_events",
        "get_build_info",
        "get_ep_devices",
        "get_version_string",
        "has_collective_ops",
        "import_capi_exception",
        "onnxruntime_validation",
        "package_name",
        "preload_dlls",
        "print_debug_info",
        "register_execution_provider_library",
        "unregister_execution_provider_library",
        "set_default_logger_verbosity",
        "set_seed",
        "version",
        # modules
        "capi",
        "contextlib",
    }
)

# ORT's subpackages other than `backend` (Quiver's own): its tools work on model files and make their own
# ORT sessions (the quantizer calibrates with ORT), so they are ORT's, reached as attributes.
DELEGATED_MODULES = frozenset({"capi", "datasets", "quantization", "tools", "transformers"})
