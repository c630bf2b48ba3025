"""The local kernels, at the bottom of the package: the cores a CP step runs on one rank's segments
(``core_reference``: fp64 PyTorch, the oracle; ``core_fla``: fla-core's chunk kernels; ``core_qla``:
flash-qla's fused GDN kernels) behind the ``LocalCore`` contract (``core``), the short causal convs
(``conv_reference``, ``conv_fla``, ``conv_gluon``) and the token recurrence (``reference``). They import
nothing of ``parallel``, ``ops`` or ``layers``."""
