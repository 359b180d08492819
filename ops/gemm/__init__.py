"""The GEMM: CPU products through BLAS, and the CUDA kernel template with its tilings, tensor
cores, pipelined main loop, convolution operands and launch plans (README.md beside this
file)."""
