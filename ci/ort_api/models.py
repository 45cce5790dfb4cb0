"""Rebuilds the test models ORT's Python API tests load, which Debian's source strips (binary blobs).

Each model is made from what the tests assert of it (names, types, shapes, expected outputs); where
ORT's source tree carries the script that made a model, `run.py` runs that script instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import convert_model_to_external_data

F, I64, BOOL, STR, DBL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL, TensorProto.STRING, TensorProto.DOUBLE
ML = helper.make_opsetid("ai.onnx.ml", 3)


def _model(nodes: list, inputs: list, outputs: list, inits: list = (), opset: int = 13, ml: bool = False, **kw):
    graph = helper.make_graph(nodes, kw.pop("name", "test"), inputs, outputs, list(inits))
    opsets = [helper.make_opsetid("", opset)] + ([ML] if ml else [])
    model = helper.make_model(graph, opset_imports=opsets, producer_name="quiver-ort-api-tests", **kw)
    model.ir_version = min(model.ir_version, 8)  # loadable by every ORT the project supports
    return model


def _tensor(name: str, elem: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def matmul(symbolic: bool) -> onnx.ModelProto:
    rows = "None" if symbolic else 3
    w = numpy_helper.from_array(np.array([[1.0], [2.0]], np.float32), "W")
    return _model(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], [_tensor("X", F, [rows, 2])], [_tensor("Y", F, [rows, 1])], [w]
    )


def logical_and() -> onnx.ModelProto:
    return _model(
        [helper.make_node("And", ["input1:0", "input:0"], ["output:0"])],
        [_tensor("input1:0", BOOL, [2, 2]), _tensor("input:0", BOOL, [2, 2])],
        [_tensor("output:0", BOOL, [2, 2])],
    )


def identity_string() -> onnx.ModelProto:
    return _model(
        [helper.make_node("Identity", ["input:0"], ["output:0"])],
        [_tensor("input:0", STR, [2, 2])],
        [_tensor("output:0", STR, [2, 2])],
    )


def _sequence(name: str, elem: int) -> onnx.ValueInfoProto:
    return helper.make_value_info(name, helper.make_sequence_type_proto(helper.make_tensor_type_proto(elem, None)))


def identity_optional_sequence() -> onnx.ModelProto:
    optional = helper.make_optional_type_proto(helper.make_sequence_type_proto(helper.make_tensor_type_proto(F, None)))
    return _model(
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_value_info("x", optional)],
        [helper.make_value_info("y", optional)],
        opset=16,
    )


def sequence_length() -> onnx.ModelProto:
    return _model(
        [helper.make_node("SequenceLength", ["X"], ["Y"])], [_sequence("X", F)], [_tensor("Y", I64, [])], opset=11
    )


def sequence_construct() -> onnx.ModelProto:
    return _model(
        [helper.make_node("SequenceConstruct", ["tensor1", "tensor2"], ["output_sequence"])],
        [_tensor("tensor1", I64, [2, 3]), _tensor("tensor2", I64, [2, 3])],
        [_sequence("output_sequence", I64)],
        opset=11,
    )


def sequence_insert() -> onnx.ModelProto:
    return _model(
        [helper.make_node("SequenceInsert", ["input_seq", "tensor"], ["output_sequence"])],
        [_sequence("input_seq", I64), _tensor("tensor", I64, [2, 3])],
        [_sequence("output_sequence", I64)],
        opset=11,
    )


def abs_free_dimensions() -> onnx.ModelProto:
    x = _tensor("x", F, ["Dim1", "Dim2", 5])
    for dim, denotation in zip(x.type.tensor_type.shape.dim, ["DATA_BATCH", "DATA_CHANNEL", "DATA_FEATURE"]):
        dim.denotation = denotation
    return _model([helper.make_node("Abs", ["x"], ["y"])], [x], [_tensor("y", F, ["Dim1", "Dim2", 5])])


def with_ort_config(mul_1: Path) -> onnx.ModelProto:
    """mul_1 with the `ort_config` metadata ORT reads when ORT_LOAD_CONFIG_FROM_MODEL=1."""
    model = onnx.load(mul_1)
    config = {
        "session_options": {
            "inter_op_num_threads": 5,
            "intra_op_num_threads": 2,
            "graph_optimization_level": 99,
            "enable_profiling": 1,
        }
    }
    helper.set_model_props(model, {"ort_config": json.dumps(config)})
    return model


def mnist() -> onnx.ModelProto:
    """The zoo's MNIST layout (CNTK export, IR 3, opset 8: initializers also listed as inputs), seeded weights."""
    rng = np.random.default_rng(0)

    def weight(name: str, shape: list[int]) -> TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)

    inits = [
        weight("Parameter5", [8, 1, 5, 5]),
        weight("Parameter6", [8, 1, 1]),
        weight("Parameter87", [16, 8, 5, 5]),
        weight("Parameter88", [16, 1, 1]),
        weight("Parameter193", [16, 4, 4, 10]),
        weight("Parameter194", [1, 10]),
        numpy_helper.from_array(np.array([1, 256], np.int64), "Pooling160_Output_0_reshape0_shape"),
        numpy_helper.from_array(np.array([256, 10], np.int64), "Parameter193_reshape1_shape"),
    ]
    nodes = [
        helper.make_node(
            "Conv", ["Input3", "Parameter5"], ["Convolution28_Output_0"], kernel_shape=[5, 5], auto_pad="SAME_UPPER"
        ),
        helper.make_node("Add", ["Convolution28_Output_0", "Parameter6"], ["Plus30_Output_0"]),
        helper.make_node("Relu", ["Plus30_Output_0"], ["ReLU32_Output_0"]),
        helper.make_node("MaxPool", ["ReLU32_Output_0"], ["Pooling66_Output_0"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node(
            "Conv",
            ["Pooling66_Output_0", "Parameter87"],
            ["Convolution110_Output_0"],
            kernel_shape=[5, 5],
            auto_pad="SAME_UPPER",
        ),
        helper.make_node("Add", ["Convolution110_Output_0", "Parameter88"], ["Plus112_Output_0"]),
        helper.make_node("Relu", ["Plus112_Output_0"], ["ReLU114_Output_0"]),
        helper.make_node("MaxPool", ["ReLU114_Output_0"], ["Pooling160_Output_0"], kernel_shape=[3, 3], strides=[3, 3]),
        helper.make_node(
            "Reshape", ["Pooling160_Output_0", "Pooling160_Output_0_reshape0_shape"], ["Pooling160_Output_0_reshape0"]
        ),
        helper.make_node("Reshape", ["Parameter193", "Parameter193_reshape1_shape"], ["Parameter193_reshape1"]),
        helper.make_node("MatMul", ["Pooling160_Output_0_reshape0", "Parameter193_reshape1"], ["Times212_Output_0"]),
        helper.make_node("Add", ["Times212_Output_0", "Parameter194"], ["Plus214_Output_0"]),
    ]
    inputs = [_tensor("Input3", F, [1, 1, 28, 28])] + [
        _tensor(t.name, t.data_type, list(t.dims)) for t in inits
    ]  # IR 3: every initializer is a graph input too
    graph = helper.make_graph(nodes, "CNTKGraph", inputs, [_tensor("Plus214_Output_0", F, [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], producer_name="CNTK")
    model.ir_version = 3
    return model


def with_external_data(folder: Path) -> None:
    """model_with_orig_ext_data.onnx: its weights already in a file beside it, as exporters write them."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "B")
    model = _model(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Add", ["XW", "B"], ["Y"])],
        [_tensor("X", F, ["batch", 4])],
        [_tensor("Y", F, ["batch", 8])],
        [w, b],
    )
    convert_model_to_external_data(model, location="model_with_orig_ext_data.bin", size_threshold=0)
    onnx.save(model, folder / "model_with_orig_ext_data.onnx")


def alloc_tensor_reuse() -> onnx.ModelProto:
    return _model(
        [
            helper.make_node("Add", ["inp0", "inp1"], ["tsor0"]),
            helper.make_node("Sub", ["inp0", "inp1"], ["tsor1"]),
            helper.make_node("Neg", ["tsor0"], ["outp0"]),
            helper.make_node("Neg", ["tsor1"], ["outp1"]),
        ],
        [_tensor("inp0", F, [10]), _tensor("inp1", F, [10])],
        [_tensor("outp0", F, [10]), _tensor("outp1", F, [10])],
    )


def zipmap(labels: list) -> onnx.ModelProto:
    key = STR if isinstance(labels[0], str) else I64
    attribute = {"classlabels_strings" if key == STR else "classlabels_int64s": labels}
    out = helper.make_sequence_type_proto(helper.make_map_type_proto(key, helper.make_tensor_type_proto(F, [])))
    return _model(
        [helper.make_node("ZipMap", ["X"], ["Z"], domain="ai.onnx.ml", **attribute)],
        [_tensor("X", F, [None, len(labels)])],
        [helper.make_value_info("Z", out)],
        ml=True,
    )


def pipeline_vectorize() -> onnx.ModelProto:
    """DictVectorizer into a linear regressor: 25, 5.13, 0, 0.453, 5.966 gives 49.752754 as the test expects."""
    features = [25.0, 5.13, 0.0, 0.453, 5.966]
    coefficients = [1.0, 2.0, 0.5, -1.0, 3.0]
    intercept = 49.752754 - float(np.dot(features, coefficients))
    map_type = helper.make_map_type_proto(I64, helper.make_tensor_type_proto(F, []))
    return _model(
        [
            helper.make_node(
                "DictVectorizer", ["float_input"], ["features"], domain="ai.onnx.ml", int64_vocabulary=list(range(5))
            ),
            helper.make_node(
                "LinearRegressor",
                ["features"],
                ["variable1"],
                domain="ai.onnx.ml",
                coefficients=coefficients,
                intercepts=[intercept],
            ),
        ],
        [helper.make_value_info("float_input", map_type)],
        [_tensor("variable1", F, [1, 1])],
        ml=True,
    )


def label_encoder() -> onnx.ModelProto:
    return _model(
        [
            helper.make_node(
                "LabelEncoder",
                ["input"],
                ["variable"],
                domain="ai.onnx.ml",
                keys_strings=["1", "2", "3", "4"],
                values_int64s=[0, 1, 2, 3],
            )
        ],
        [_tensor("input", STR, [1, 1])],
        [_tensor("variable", I64, [1, 1])],
        ml=True,
    )


def mlnet_encoder() -> onnx.ModelProto:
    """A float column passed through and a one-hot string column whose categories hold NUL bytes."""
    return _model(
        [
            helper.make_node("Identity", ["C0"], ["C00"]),
            helper.make_node(
                "OneHotEncoder",
                ["C1"],
                ["C12"],
                domain="ai.onnx.ml",
                cats_strings=["B\0B\0", "D\0D\0", "C\0C\0", "E\0E\0"],
                zeros=1,
            ),
        ],
        [_tensor("C0", F, [1, 1]), _tensor("C1", STR, [1, 3])],
        [_tensor("C00", F, [1, 1]), _tensor("C12", F, [1, 3, 4])],
        ml=True,
    )


def tree_ensemble_as_tensor() -> onnx.ModelProto:
    """One double-precision split (feature 2 at float32(1.8), as a double) and double leaves: the doubles
    must survive, so float32(1.8) and 1.7999999523 fall on one side and 1.79999995232 on the other."""
    node = helper.make_node(
        "TreeEnsemble",
        ["X"],
        ["Y"],
        domain="ai.onnx.ml",
        n_targets=1,
        tree_roots=[0],
        nodes_featureids=[2],
        nodes_modes=numpy_helper.from_array(np.array([0], np.uint8)),  # BRANCH_LEQ
        nodes_splits=numpy_helper.from_array(np.array([1.7999999523162842], np.float64)),
        nodes_truenodeids=[0],
        nodes_trueleafs=[1],
        nodes_falsenodeids=[1],
        nodes_falseleafs=[1],
        leaf_targetids=[0, 0],
        leaf_weights=numpy_helper.from_array(np.array([0.7284910678863525, 0.9134243130683899], np.float64)),
        post_transform=0,
        aggregate_function=1,  # SUM
    )
    model = _model([node], [_tensor("X", DBL, [None, 4])], [_tensor("Y", DBL, [None, 1])], ml=True)
    model.opset_import[1].version = 5
    return model


def nhwc_resize() -> onnx.ModelProto:
    """An NHWC image upscaled 2x by an NCHW Resize between two Transposes (opset 18, scales input)."""
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    return _model(
        [
            helper.make_node("Transpose", ["input"], ["nchw"], perm=[0, 3, 1, 2]),
            helper.make_node("Resize", ["nchw", "", "scales"], ["resized"], mode="nearest"),
            helper.make_node("Transpose", ["resized"], ["output"], perm=[0, 2, 3, 1]),
        ],
        [_tensor("input", F, [1, 5, 5, 3])],
        [_tensor("output", F, [1, 10, 10, 3])],
        [scales],
        opset=18,
    )


def conv_qdq_external(folder: Path) -> None:
    """conv_qdq_external_ini.onnx: a QDQ Conv whose quantized weights live in an external file."""
    rng = np.random.default_rng(2)
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(128, np.uint8), "x_zero"),
        numpy_helper.from_array(rng.integers(-64, 64, (4, 2, 3, 3)).astype(np.int8), "w_q"),
        numpy_helper.from_array(np.array(0.01, np.float32), "w_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "w_zero"),
        numpy_helper.from_array(rng.integers(-100, 100, 4).astype(np.int32), "b_q"),
        numpy_helper.from_array(np.array(0.0005, np.float32), "b_scale"),
        numpy_helper.from_array(np.array(0.1, np.float32), "y_scale"),
        numpy_helper.from_array(np.array(128, np.uint8), "y_zero"),
    ]
    model = _model(
        [
            helper.make_node("QuantizeLinear", ["input", "x_scale", "x_zero"], ["x_q"]),
            helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
            helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w_dq"]),
            helper.make_node("DequantizeLinear", ["b_q", "b_scale"], ["b_dq"]),
            helper.make_node("Conv", ["x_dq", "w_dq", "b_dq"], ["conv"], pads=[1, 1, 1, 1]),
            helper.make_node("QuantizeLinear", ["conv", "y_scale", "y_zero"], ["y_q"]),
            helper.make_node("DequantizeLinear", ["y_q", "y_scale", "y_zero"], ["output"]),
        ],
        [_tensor("input", F, [1, 2, 8, 8])],
        [_tensor("output", F, [1, 4, 8, 8])],
        inits,
    )
    convert_model_to_external_data(model, location="conv_qdq_external_ini.bin", size_threshold=32)
    onnx.save(model, folder / "conv_qdq_external_ini.onnx")


def build_all(testdata: Path, mul_1: Path) -> list[str]:
    """Writes every model into `testdata`; returns their file names."""
    made: dict[str, Callable[[], onnx.ModelProto]] = {
        "matmul_1.onnx": lambda: matmul(symbolic=False),
        "matmul_2.onnx": lambda: matmul(symbolic=True),
        "logicaland.onnx": logical_and,
        "identity_string.onnx": identity_string,
        "identity_opt.onnx": identity_optional_sequence,
        "sequence_length.onnx": sequence_length,
        "sequence_construct.onnx": sequence_construct,
        "sequence_insert.onnx": sequence_insert,
        "abs_free_dimensions.onnx": abs_free_dimensions,
        "model_with_valid_ort_config_json.onnx": lambda: with_ort_config(mul_1),
        "mnist.onnx": mnist,
        "alloc_tensor_reuse.onnx": alloc_tensor_reuse,
        "zipmap_stringfloat.onnx": lambda: zipmap(["class1", "class2", "class3"]),
        "zipmap_int64float.onnx": lambda: zipmap([10, 20, 30]),
        "pipeline_vectorize.onnx": pipeline_vectorize,
        "LabelEncoder.onnx": label_encoder,
        "mlnet_encoder.onnx": mlnet_encoder,
        "tree_ensemble_as_tensor.onnx": tree_ensemble_as_tensor,
        "nhwc_resize_scales_opset18.onnx": nhwc_resize,
    }
    for name, make in made.items():
        onnx.save(make(), testdata / name)
    with_external_data(testdata)
    conv_qdq_external(testdata)
    return [*made, "model_with_orig_ext_data.onnx", "conv_qdq_external_ini.onnx"]
