"""quest's tools besides training and evaluation: export (and ONNX), and the data tools."""
