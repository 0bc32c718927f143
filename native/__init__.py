"""native: quantized math (C++ CPU and CUDA kernels) behind one Python API, `native.ops`."""
