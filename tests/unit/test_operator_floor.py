"""The QNN EP's operator list (DESIGN.md: the floor for every backend) is taken on: each of its operators
is one Quiver's operator table supports (ONNX's node tests run them on each backend:
tests/integration/test_node_conformance.py)."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper

from quiver.ir.ops import MS_DOMAIN, QNN_EP_OPS, is_supported


@pytest.mark.parametrize("op", sorted(QNN_EP_OPS))
def test_every_operator_of_the_qnn_floor_is_supported(op: str) -> None:
    domain = MS_DOMAIN if op == "Gelu" and not onnx.defs.has("Gelu") else ""
    assert is_supported(helper.make_node(op, ["x"], ["y"], domain=domain)), op
