"""Drop-in modules for users of other FP8 GEMM libraries (`fp8gemm.compat.deep_gemm`)."""
