"""CPU kernels: quantize / dequantize, code formats, Hadamard, the wire format, ISA paths."""
