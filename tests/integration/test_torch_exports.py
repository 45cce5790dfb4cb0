"""Models exported by the real `torch.onnx` dynamo exporter (tests/support/fixtures, made by make_torch_family.py).

They carry what real exports carry: external data files, `val_N` names for transposed weights,
opset 20 Gelu, shape arithmetic, and identical initializers merged by the exporter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import quiver
from tests.support import FIXTURES  # noqa: E402

BASE, TUNED = FIXTURES / "torch_base.onnx", FIXTURES / "torch_tuned.onnx"


@pytest.fixture(scope="module")
def exported_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("torch") / "torch.qctx"
    with quiver.Context.create("cpu") as context:
        context.add_graph("base", BASE)
        context.add_graph("tuned", TUNED)
        context.save(path)
    return path


def test_the_fixtures_are_real_dynamo_exports_with_external_data() -> None:
    model = onnx.load(str(BASE), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    assert any(t.name.startswith("val_") for t in model.graph.initializer)
    assert any(p.key.startswith("pkg.torch.onnx") for n in model.graph.node for p in n.metadata_props)
    assert quiver.check_model(BASE).ok and quiver.check_model(TUNED).ok


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("sequence", [1, 8, 33])
def test_exports_match_onnxruntime_on_their_source(exported_context: Path, backend: str, sequence: int) -> None:
    ids = np.random.default_rng(sequence).integers(0, 100, size=(1, sequence), dtype=np.int64)
    with quiver.Context.from_binary(exported_context, backend=backend) as context:
        for name, source in (("base", BASE), ("tuned", TUNED)):
            theirs = ort.InferenceSession(str(source)).run(None, {"input_ids": ids})[0]
            ours = context.graph(name).execute({"input_ids": ids})["last_hidden_state"]
            np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_the_fine_tune_shares_the_unchanged_weights_by_content(exported_context: Path) -> None:
    comparison = quiver.compare_models(BASE, TUNED)
    with quiver.Context.from_binary(exported_context) as context:
        report = quiver.describe_context(context)
    assert report["graphs"][1]["shared_with"]["base"] > 0
    shared_large = sum(a.nbytes for a, _ in comparison.identical if a.nbytes >= 1024)
    assert report["graphs"][1]["weights"]["shared_bytes"] == shared_large
    assert comparison.different  # the perturbed last layer
    first_layer = [a.name for a, _ in comparison.identical if a.name.startswith("layers.0.")]
    assert first_layer  # the first layer, untouched by the fine-tune, is shared
