"""CP benchmarks (run ``python -m benchmarks run ops``; its docstring says what is measured).

bench_ops.py   the command line: arguments, one process per rank, the op / layer / memory runs
common.py      the problems (documents, inputs, errors), spawning and joining the ranks
timing.py      Bench: medians of CUDA-event times over the slowest rank, peak memory, collectives
table.py       the rows: columns, eff and x_cp2hp, printing, the CSV
ops.py         op level: noCP, cp2hp (megatron_kcp.parallel.cp2hp), kcp, fla-cp on one (model, tokens,
               documents, heads)
layers.py      layer level: the mixers at CP=1 and CP=W with the same weights
memory.py      --memory-only: peak memory per rank of KCP fwd+bwd, beside one GPU
kernel_profile.py  --what profile: torch.profiler's kernel table of noCP and kcp, where the time goes
exchange_model.py, plot.py   standalone scripts on the CSVs
"""
