"""Text generation with LoRA adapters: transformers folders to prefill + decode contexts, and Genie's dialog."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quiver.t2t.dialog import Dialog, DialogState, QueryResult

__all__ = ["Dialog", "DialogState", "QueryResult"]


def __getattr__(name: str) -> Any:  # the dialog loads ONNX Runtime and tokenizers: only when asked for
    if name in __all__:
        from quiver.t2t import dialog

        return getattr(dialog, name)
    raise AttributeError(f"module 'quiver.t2t' has no attribute {name!r}")
