"""Helpers shared by the tests and the benchmarks: ranks spawned with Megatron's parallel_state
(``distributed``), random and long-memory CP problems (``cases``), mixer comparisons across TP x CP
(``layers``), megatron-core modules built on the CPU (``megatron_cpu``), trimmed Triton autotuning
for GPU correctness runs (``fast_autotune``) and reference versions of flash-qla's kernel contracts
(``qla_contracts``)."""
