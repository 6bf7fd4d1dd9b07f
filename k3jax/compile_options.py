"""XLA options every serving step (prefill, decode, verify, their DEP/DWDP forms) is compiled with.

`jax.jit(..., compiler_options=STEP_COMPILER_OPTIONS)` applies them per executable, so nothing depends on
the process's XLA_FLAGS and other jits keep XLA's defaults.

Command buffers (CUDA graphs) off. XLA's default captures runs of fusions between other thunks into CUDA
graphs. In our steps every Pallas kernel is a custom call that ends such a run, so a k3-small decode step
becomes dozens of short graphs, and executing them costs more than the kernel launches they replace.
Measured on one H200 (benchmarks/model_forward.py --backends pallas --phases decode, B64 x 8k history,
2026-11-30, docs/results/model_cmdbuf_h200_2026-11-30e.json), median ms per step by
--xla_gpu_enable_command_buffer value:
    default 16.8 / 17.7    FUSION 16.9    FUSION,CUBLAS,CUBLASLT 17.6    CUSTOM_CALL 13.8    off 13.9 / 14.0
The FUSION kind is the cost; prefill (one 8k chunk) is unchanged (118.9 ms off vs 119-123 ms default).
The option only exists for the GPU compiler; CPU compiles accept and ignore it.
"""

STEP_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}
