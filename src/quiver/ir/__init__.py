"""Graph model over ONNX: dtypes, the operator support table, tensor descriptions."""
