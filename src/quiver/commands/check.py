"""`quiver check`: can Quiver convert and run this ONNX model, and if not, everything that stops it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from quiver.errors import QuiverError, UnsupportedOperatorError
from quiver.ir.ops import is_supported, iter_nodes, op_id
from quiver.passes.convert import convert
from quiver.passes.load import load_model


@dataclass
class CheckReport:
    operators: Counter[str] = field(default_factory=Counter)
    unsupported: list[str] = field(default_factory=list)
    problem: str | None = None  # a conversion error other than unsupported operators

    @property
    def ok(self) -> bool:
        return not self.unsupported and self.problem is None

    @property
    def path(self) -> str:
        """Which engine `quiver.ort` runs the model on: Quiver's own, or plain ONNX Runtime (and why)."""
        if self.ok:
            return "quiver"
        reason = f"unsupported operators {', '.join(self.unsupported)}" if self.unsupported else self.problem
        return f"onnxruntime ({reason})"

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "path": "quiver" if self.ok else "onnxruntime",
            "operators": dict(sorted(self.operators.items())),
            "unsupported": self.unsupported,
            "problem": self.problem,
        }


def check_model(source: str | Path | onnx.ModelProto) -> CheckReport:
    """Lists the model's operators, every unsupported one, and any other conversion problem."""
    model, _ = load_model(source)
    report = CheckReport()
    nodes = list(iter_nodes(model.graph))
    report.operators = Counter(op_id(n) for n in nodes)
    report.unsupported = sorted({op_id(n) for n in nodes if not is_supported(n)})
    if not report.unsupported:
        try:
            convert(source)
        except UnsupportedOperatorError as exc:
            report.unsupported = exc.operators  # operators of inlined local functions
        except QuiverError as exc:
            report.problem = str(exc)
    return report
