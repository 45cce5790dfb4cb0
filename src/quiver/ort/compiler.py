"""ORT's compile API (`ModelCompiler`) over Quiver: a model becomes an EPContext model whose node holds a
`.qctx` (embedded, or a file beside the model), which `InferenceSession` opens directly.

The same writer serves the session option `ep.context_enable=1`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quiver import errors
from quiver.ir import proto
from quiver.ort.errors import Fail, InvalidArgument, NoSuchFile, ort_error
from quiver.ort.errors import NotImplemented as UnsupportedByProvider
from quiver.ort.options import config_entries
from quiver.ort_package import onnxruntime

if TYPE_CHECKING:
    from quiver.backends.base import Backend

_CHUNK = 1 << 20


def build_ep_context(
    model: proto.ModelProto,
    source: Path | None,
    graph_name: str,
    target: Path,
    embed: bool,
    backend: Backend | str,
    external_data_folder: Path | None = None,
) -> tuple[proto.ModelProto, Path | bytes]:
    """The EPContext model for `target` and its cache: the `.qctx` written beside `target`, or its bytes
    (embedded: nothing is left beside it). Only `target`'s folder is written. `external_data_folder`
    holds the external data of a model given without its path."""
    target.parent.mkdir(parents=True, exist_ok=True)
    from quiver.ort.epcontext import ep_context_model  # with the runtime: imported when something compiles
    from quiver.runtime.context import Context

    builder = Context.create(backend, workdir=target.parent)
    try:
        builder.add_graph(graph_name, source or model, external_data_folder=None if source else external_data_folder)
        qctx = builder.save(target.with_suffix(".qctx"))
        graph = builder.graph(graph_name)
        cache: Path | bytes = qctx.read_bytes() if embed else qctx
        named: str | bytes = cache if isinstance(cache, bytes) else qctx.name  # a file: named relative to the model
        wrapper = ep_context_model(graph_name, graph.inputs, graph.outputs, named)
    finally:
        builder.close()
    if embed:
        qctx.unlink()
    return wrapper, cache


def _load(input_model: str | os.PathLike[str] | bytes) -> tuple[proto.ModelProto, Path | None]:
    model = proto.ModelProto()
    if isinstance(input_model, bytes):
        data, path = input_model, None
    else:
        path = Path(input_model)
        if not path.is_file():
            raise NoSuchFile(f"no model at {path}")
        data = path.read_bytes()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidArgument(f"the input is not an ONNX model ({exc})") from None
    return model, path


class ModelCompiler:
    """`onnxruntime.ModelCompiler`: compiles a model for Quiver's provider into an EPContext model.

    The whole graph goes into one EPContext node, so no initializer is left for
    `external_initializers_file_path`. A model Quiver cannot convert is written unchanged (plain ORT runs
    it), unless `flags` has `ERROR_IF_NO_NODES_COMPILED`.
    """

    def __init__(
        self,
        sess_options: Any,
        input_model_path_or_bytes: str | os.PathLike[str] | bytes,
        embed_compiled_data_into_model: bool = False,
        external_initializers_file_path: str | os.PathLike[str] | None = None,
        external_initializers_size_threshold: int = 1024,
        flags: int = 0,
        graph_optimization_level: Any = None,
        get_initializer_location_func: Callable[..., Any] | None = None,
    ) -> None:
        self._options = sess_options
        self._model, self._path = _load(input_model_path_or_bytes)
        folder = config_entries(sess_options).get("session.model_external_initializers_file_folder_path")
        self._external_data_folder = Path(folder) if folder and self._path is None else None
        self._embed = bool(embed_compiled_data_into_model)
        self._flags = int(flags)

    def set_ep_context_binary_information(self, output_directory: str | os.PathLike[str], model_name: str) -> None:
        """Where a non-embedded context binary goes when compiling to bytes or a stream."""
        self._binary_folder, self._binary_name = Path(output_directory), str(model_name)

    def set_ep_context_data_write_func(self, *_: Any) -> None:
        raise UnsupportedByProvider(
            "QuiverExecutionProvider writes its context binary itself: embed it "
            "(embed_compiled_data_into_model=True) or compile to a file"
        )

    def clear_ep_context_data_write_func(self) -> None:
        """No write function is ever set (see `set_ep_context_data_write_func`)."""

    def compile_to_file(self, output_model_path: str | os.PathLike[str] | None = None) -> None:
        if output_model_path is None:
            if self._path is None:
                raise InvalidArgument("a model given as bytes needs output_model_path")
            output_model_path = self._path.with_name(self._path.stem + "_ctx.onnx")
        target = Path(output_model_path)
        error_if_exists = int(onnxruntime.OrtCompileApiFlags.ERROR_IF_OUTPUT_FILE_EXISTS)
        if self._flags & error_if_exists and target.exists():
            raise Fail(f"Output model path {target} exists already (flags: ERROR_IF_OUTPUT_FILE_EXISTS)")
        compiled = self._compile(target)
        from quiver.ort.epcontext import save_ep_context_model

        save_ep_context_model(compiled, target)

    def compile_to_bytes(self) -> bytes:
        """The compiled model; its context binary embedded, or written to the folder and name given to
        `set_ep_context_binary_information`."""
        folder = getattr(self, "_binary_folder", None)
        if not self._embed and folder is None:
            raise InvalidArgument(
                "compile_to_bytes needs embed_compiled_data_into_model=True, or a folder for the context binary "
                "(set_ep_context_binary_information)"
            )
        if folder is not None and not self._embed:
            return self._compile(folder / f"{self._binary_name}_ctx.onnx").SerializeToString()
        import tempfile  # ~4 ms: imported when something compiles, not with quiver.ort

        with tempfile.TemporaryDirectory(prefix="quiver-compile-") as scratch:
            return self._compile(Path(scratch) / "model_ctx.onnx").SerializeToString()

    def compile_to_stream(self, write_function: Callable[[bytes], Any]) -> None:
        data = self.compile_to_bytes()
        for start in range(0, len(data), _CHUNK):
            try:
                write_function(data[start : start + _CHUNK])
            except Exception as exc:  # ORT hands the function's error back as its own Fail
                raise Fail(f"the write function raised {type(exc).__name__}: {exc}") from exc

    def _compile(self, target: Path) -> proto.ModelProto:
        name = self._model.graph.name or (self._path.stem if self._path else "main")
        try:
            folder = self._external_data_folder
            model, _ = build_ep_context(self._model, self._path, name, target, self._embed, "cpu", folder)
        except errors.ConversionError as exc:
            if self._flags & int(onnxruntime.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED):
                raise Fail(f"Unable to compile any nodes for QuiverExecutionProvider: {exc}") from None
            return self._model  # plain ORT runs it as it is
        except errors.QuiverError as exc:
            raise ort_error(exc) from None
        return model
