"""Graph model over ONNX: protobuf messages without the onnx package, dtypes, the operator support table,
tensor descriptions, small edits, packed sub-byte values and weights made when stored."""
