"""Graph passes over ONNX models: loading with streamed weights, conversion to Quiver graphs (constant folding,
weight extraction, transposed weights, mask fills), calibrated QDQ quantization, GPTQ and MatMulNBits blocks,
the encodings of quantized weights, and the weight-sharing report between models."""
