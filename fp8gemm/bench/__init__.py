"""`python -m fp8gemm.bench`: fp8gemm's backends against cuBLAS and bf16, measured in one run.

- suites.py: the shapes (DeepSeek-V3 dense and grouped, irregular) and their FLOP / byte counts.
- timing.py: cold-L2 device time with the host hidden, eager time per call, median, geomean.
- impls.py: the inputs of a case and one callable per implementation (or why it is skipped).
- runner.py: measures every case and implementation.
- report.py: the result-file JSON form, markdown tables, the PNG plot.
"""
