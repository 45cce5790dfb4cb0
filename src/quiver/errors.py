"""The typed errors Quiver raises; every message says what to do next."""

from __future__ import annotations


class QuiverError(Exception):
    """Base of every error Quiver raises on purpose."""


# --- files --------------------------------------------------------------------------------------
class FileAccessError(QuiverError):
    """A file could not be opened or read (missing, a folder, no permission)."""


class FormatError(QuiverError):
    """A file is not a valid Quiver file."""


class CorruptFileError(FormatError):
    """The file is damaged: rebuild it or fetch it again."""


class BadMagicError(CorruptFileError):
    """The file does not start with the expected magic bytes."""


class TruncatedFileError(CorruptFileError):
    """The file is shorter than its preamble says."""


class FileChangedError(CorruptFileError):
    """A loaded file was truncated or rewritten in place; files in use must be replaced instead."""


class HeaderTooLargeError(CorruptFileError):
    """The header length exceeds the format's bound."""


class ChecksumMismatchError(CorruptFileError):
    """A region's SHA-256 does not match the recorded one."""


class InvalidHeaderError(CorruptFileError):
    """The header is not valid JSON or breaks a MUST rule of the format."""


class OutOfBoundsError(CorruptFileError):
    """A recorded offset or length points outside its region."""


class OverlappingRegionsError(CorruptFileError):
    """Two recorded regions overlap or are not in ascending order."""


class MisalignedTensorError(CorruptFileError):
    """A tensor's offset breaks the alignment rule."""


class UnsupportedVersionError(FormatError):
    """The file was written by an incompatible version of the format."""


# --- models and graphs --------------------------------------------------------------------------
class ModelLoadError(QuiverError):
    """An ONNX model could not be read."""


class ConversionError(QuiverError):
    """An ONNX model could not be turned into a Quiver graph."""


class UnsupportedOperatorError(ConversionError):
    """The model uses operators Quiver does not support; all of them are listed."""

    def __init__(self, message: str, operators: list[str]) -> None:
        super().__init__(message)
        self.operators = operators


class UnknownGraphError(QuiverError, KeyError):
    """No graph of that name in the context (or it was not enabled)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateGraphError(QuiverError):
    """A graph of that name is already in the context."""


class ContextStateError(QuiverError):
    """The call does not fit the context's state (e.g. adding graphs after finalize)."""


# --- execution ----------------------------------------------------------------------------------
class InvalidFeedError(QuiverError):
    """The feeds passed to `execute` do not fit the graph's inputs."""


class FeedNameError(InvalidFeedError):
    """A feed is missing or names no input."""


class FeedShapeError(InvalidFeedError):
    """A feed's shape does not fit the input's shape."""


class FeedDTypeError(InvalidFeedError):
    """A feed's dtype is not the input's dtype."""


class BackendError(QuiverError):
    """The backend failed to prepare or execute a graph."""


class UnknownBackendError(QuiverError):
    """No backend of that name is registered."""


class TensorUpdateError(QuiverError):
    """A staged tensor update names no updateable tensor, or has the wrong shape or dtype."""


class SectionMismatchError(QuiverError):
    """A binary section does not fit this context: made for another one, or for other graphs or tensors."""


class AdapterError(QuiverError):
    """A LoRA adapter folder cannot be used: missing files, an unsupported method, inconsistent tensors."""


class InputListError(QuiverError):
    """A qnn-net-run style input list is malformed."""


class EncodingsError(QuiverError):
    """An encodings file or value Quiver cannot use; the message says which entry and why."""


class QuantizationError(QuiverError):
    """A model, option or calibration input that quantization cannot use."""


class GenerationError(QuiverError):
    """Text generation (`quiver.t2t`): a model folder, a dialog config, a prompt or a sampling value."""


class ModelFolderError(GenerationError):
    """A folder that is not a causal language model Quiver can export (config, weights, tokenizer)."""


class ExportResourceError(GenerationError):
    """An export needs more memory or disk than the machine has free."""


class DialogConfigError(GenerationError):
    """A Genie dialog config that is malformed or names files that are missing."""


class TuningError(QuiverError):
    """Tuning cannot proceed: bad options or inputs, a cache it cannot use, no tunable backend."""


class TargetServerError(TuningError):
    """A target server refused a request or could not be reached; `kind` is its typed error name."""

    def __init__(self, message: str, kind: str = "unreachable") -> None:
        super().__init__(message)
        self.kind = kind
