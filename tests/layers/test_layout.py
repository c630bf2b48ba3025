"""Both mixers and the hybrid block (3 linear layers + softmax attention) on Megatron's THD packs at
CP = W, hidden states moved to the contiguous layout (each mixer on its own, or once per run of
linear layers), equal the same modules at CP = 1: output, input gradient and every weight gradient.
The same comparison with the conversion off by one document fails."""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from megatron_kcp import environment
from megatron_kcp.problem import Problem
from megatron_kcp.testing.distributed import on_rank0_for_all, rel_err, spawn
from megatron_kcp.testing.layers import CPU, GPU, GPU_BF16, LONG_MEMORY_A_LOG, build, config, exchange_controls, solo_pg
from megatron_kcp.testing.cases import docs_cu, raw_docs_cu
from megatron_kcp.testing.checks import rolled_by_one_document
from tests.fixtures import frozen

TOL = 1e-5


def thd(cu, padded: bool = True):
    """Megatron's PackedSeqParams of documents ``cu``: with cu_seqlens_q_padded (the per-document zigzag's
    convention), or, ``padded=False``, raw lengths only (--dataloader-inter-document-masking's)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    t = torch.tensor(cu, dtype=torch.int32)
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t, cu_seqlens_q_padded=t if padded else None,
                           cu_seqlens_kv_padded=t if padded else None, max_seqlen_q=longest, max_seqlen_kv=longest)


def block(model: str, cp: int, pg, shape=CPU):
    """Megatron's TransformerBlock of the hybrid spec: layers 1-3 linear, layer 4 softmax attention."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    import megatron_kcp.megatron_cpu
    from megatron_kcp import spec
    megatron_kcp.megatron_cpu.enable()
    cfg = config(model, shape, cp, num_layers=4, linear_attention_freq=4, kv_channels=16, hidden_dropout=0.0,
                 attention_dropout=0.0)
    torch.manual_seed(0)
    if shape.device == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(0)       # Megatron initialises under the CUDA RNG tracker
    layers = spec.kda_hybrid_layer_spec if model == "kda" else spec.gdn_hybrid_layer_spec
    return TransformerBlock(cfg, layers, pg_collection=pg).to(shape.device)


def _pooled(results: dict) -> dict:
    """The block's gradients of one parameter kind (``dlayers.<i>.self_attention.A_log`` for every
    linear layer i) as one flat tensor each: a gate's gradient has one value a head, too few for the
    ratio of two rounding errors to mean anything; pooled over the block's layers it has several
    times more. Output, input gradient and a mixer's own parameters stay as they are (flattened)."""
    import re
    groups: dict = {}
    for k, v in results.items():
        groups.setdefault(re.sub(r"^dlayers\.\d+\.", "dlayers.*.", k), []).append(v.flatten())
    return {k: torch.cat(v) for k, v in groups.items()}


def _compare(model, what, n_docs, expect_fail=False, shape=CPU, layout="zigzag_per_doc", state_control=False):
    """``what``: 'mixer' or 'block'. CP = W against CP = 1 with the same weights: output, input gradient and
    every weight gradient (``expect_fail``: the output and input gradient miss by 10x the bound), on
    ``n_docs`` documents in Megatron's ``layout``: ``zigzag_per_doc`` (padded to 2W, --sft) or ``zigzag``
    (odd lengths, the whole stream cut, --dataloader-inter-document-masking). ``state_control``: long-memory
    gates, and the output with the state exchange and the conv halo off must miss by 10x the bound.

    On the CPU (the reference core in fp32) the two must agree within ``TOL``. On a GPU, fla's kernels
    chunk a rank's pieces differently from the whole stream and round differently, and a weight
    gradient summed over tokens (the gate's ``A_log``) can cancel down to that rounding; so both runs
    are measured against the same modules in fp64 on the CPU (the block's weight gradients pooled by
    kind, ``_pooled``), and CP's error may not exceed 1.5x the one-device error (plus ``shape.tol`` /
    100); a weight gradient, a sum over tokens, may also reach ``shape.tol`` / 10, the kernels' fp32
    rounding of such sums: the one-device run's own errors reach it, and where the crossing
    document's chunk grid moves, CP draws that rounding afresh. The output
    and input gradient keep the tight bound, so the off-by-one control, which moves the block's output
    only a little (the residual stream carries most of it), still misses by 10x. On a GPU it also
    prints the gates' gradients (``dt_bias``, ``A_log``) against one GPU's: GDN's carry the TF32
    rounding of fla's backward on Hopper, as large as their cancelling sum, so 1.5x one GPU's error
    bounds them loosely there; the op-level CP suite bounds their per-token source, ``dg``
    (BENCHMARKS.md, Correctness on the GPU)."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_kcp.plan import build_plan, local_token_index
    cp, r = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    per_doc = layout == "zigzag_per_doc"
    cu = docs_cu(n_docs, cp, seed=n_docs) if per_doc else raw_docs_cu(n_docs, cp, seed=n_docs)
    dev = shape.device

    def make(c, pg, on=shape):
        mod = block(model, c, pg, on) if what == "block" else build(model, config(model, on, c), pg, on.device)
        return mod.to(on.dtype)

    def run(mod, inp):
        pack = thd(cu, per_doc)
        out = mod(inp, None, packed_seq_params=pack) if what == "block" else mod(inp, packed_seq_params=pack)
        return out if what == "block" else out[0]

    def results(mod, inp, dout, index=None):
        """{y, dx, d<param>} of one fwd+bwd; ``index`` (a CP rank's tokens): the weight gradients summed
        over the CP group."""
        inp = inp.clone().requires_grad_()
        y = run(mod, inp)
        y.backward(dout)
        out = {"y": y.detach(), "dx": inp.grad}
        for n, p in mod.named_parameters():
            g = p.grad.clone()
            if index is not None:
                dist.all_reduce(g, group=ps.get_context_parallel_group())
            out["d" + n] = g
        return out

    ref = make(1, solo_pg())
    if state_control:
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if n.endswith("A_log"):
                    p.fill_(LONG_MEMORY_A_LOG)
    gen = torch.Generator().manual_seed(3)
    x, dy = (torch.randn(cu[-1], 1, shape.hidden, generator=gen).to(shape.dtype) for _ in range(2))
    mod = make(cp, ProcessGroupCollection.use_mpu_process_groups())
    mod.load_state_dict(ref.state_dict())
    idx = local_token_index(build_plan(cu, layout, cp, r))
    one = results(ref, x.to(dev), dy.to(dev))
    got = results(mod, x[idx].to(dev), dy[idx].to(dev), idx)
    for k in ("y", "dx"):
        one[k] = one[k][idx.to(dev)]
    if shape is CPU:
        y_truth = one["y"]
        errs = {k: rel_err(got[k], one[k]) for k in got}
        bound = {k: TOL for k in got}
    else:
        solo = solo_pg()                        # a collective: every rank builds it

        def fp64():
            exact = make(1, solo, dataclasses.replace(shape, device="cpu"))
            exact.load_state_dict(ref.state_dict())
            return results(exact.double(), x.double(), dy.double())
        truth = on_rank0_for_all(fp64)
        for k in ("y", "dx"):
            truth[k] = truth[k][idx]
        y_truth = truth["y"].to(dev)
        got, one, truth = (_pooled(r) for r in (got, one, truth))
        errs = {k: rel_err(got[k].cpu(), truth[k]) for k in got}
        bound = {k: 1.5 * rel_err(one[k].cpu(), truth[k]) + shape.tol / 100 for k in got}
        for k in set(got) - {"y", "dx"}:       # sums over tokens: at least the kernels' fp32 rounding
            bound[k] = max(bound[k], shape.tol / 10)
        if shape.dtype == torch.bfloat16:      # a gate's gradient, a value a head summed over every token in
            for k in (k for k in got if k.endswith(("A_log", "dt_bias"))):      # bf16: two bf16 roundings
                bound[k] = max(bound[k], 2 * torch.finfo(torch.bfloat16).eps)
    if dist.get_rank() == 0 and shape is not CPU:
        worst = max(errs, key=lambda k: errs[k] / bound[k])
        print(f"{model} {what} W={cp} {n_docs} docs{' (control)' if expect_fail else ''}: y {errs['y']:.1e} "
              f"(bound {bound['y']:.1e}) dx {errs['dx']:.1e} (bound {bound['dx']:.1e}); closest to its bound: "
              f"{worst} {errs[worst]:.1e} (bound {bound[worst]:.1e})", flush=True)
        gates = [k for k in errs if k.endswith(("A_log", "dt_bias"))]
        print("  gates (CP error / one-GPU error / RMS of the fp64 gradient):",
              {k: f"{errs[k]:.1e}/{rel_err(one[k].cpu(), truth[k]):.1e}/{truth[k].pow(2).mean().sqrt():.1e}"
               for k in gates}, flush=True)
        if errs[worst] > bound[worst]:
            print("  every error against its bound:", {k: f"{errs[k]:.1e}/{bound[k]:.1e}" for k in errs}, flush=True)
    if expect_fail:
        assert errs["y"] > 10 * bound["y"] and errs["dx"] > 10 * bound["dx"], errs
    else:
        over = {k: (errs[k], bound[k]) for k in errs if errs[k] > bound[k]}
        assert not over, over
    if state_control:
        misses = exchange_controls(lambda: run(mod, x[idx].to(dev)), y_truth, bound["y"])
        if dist.get_rank() == 0 and shape is not CPU:
            print(f"  controls (bound {bound['y']:.1e}):", {k: f"{v:.1e}" for k, v in misses.items()}, flush=True)


def _cases(model, what, docs, control, shape=CPU):
    """``docs``: the document counts compared; ``control``: the off-by-one control at ``control``
    documents (0: none)."""
    from megatron_kcp.parallel import relayout
    with mock.patch.dict("os.environ", {"KCP_CONVERT": "1"}):
        for n in docs:
            _compare(model, what, n, shape=shape)
        if control:              # a permutation off by one document: needs more than one document
            relayout.route.cache_clear()
            with rolled_by_one_document():
                _compare(model, what, control, expect_fail=True, shape=shape)
            relayout.route.cache_clear()


def _gpu_cases(default: str) -> tuple[tuple[int, ...], int]:
    """(document counts, control's document count) of a GPU test: ``KCP_GPU_DOCS`` (a comma list of
    counts and ``control``; default ``default``) cuts a long test into parts that run as separate
    processes. The control runs at the largest count of ``default``."""
    picked = os.environ.get("KCP_GPU_DOCS", default).split(",")
    if any(x != "control" and not x.isdigit() for x in picked):
        raise ValueError(f"KCP_GPU_DOCS={','.join(picked)}: give document counts and 'control', comma-separated, "
                         f"e.g. {default}")
    docs = tuple(int(x) for x in picked if x != "control")
    return docs, max(int(x) for x in default.split(",") if x != "control") if "control" in picked else 0


@pytest.mark.parametrize("model", ["gdn", "kda"])
@pytest.mark.parametrize("what", ["mixer", "block"])
def test_converted_layout_equals_cp1(model, what):
    spawn(_cases, 2, model, what, (10,), 10)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("model", ["gdn", "kda"])
@pytest.mark.parametrize("what", ["mixer", "block"])
def test_converted_layout_equals_cp1_1_to_300_documents(model, what, world_size):
    spawn(_cases, world_size, model, what, (1, 10, 100, 300), 0)


def _whole_stream(model, what, docs, shape=CPU):
    """``docs`` document counts in the whole-stream zigzag; the exchange-off controls at 10 documents (at 100,
    a few of them cross a rank edge, too small a part of the output to show), for the block on the CPU only:
    in bf16 the block's residual stream carries its output, and a mixer's share is within the bf16 bound
    (the mixer's own controls see the exchange)."""
    for n in docs:
        control = n == 10 and (what == "mixer" or shape is CPU)
        _compare(model, what, n, shape=shape, layout="zigzag", state_control=control)


@pytest.mark.parametrize("model", ["gdn", "kda"])
@pytest.mark.parametrize("what", ["mixer", "block"])
def test_whole_stream_layout_equals_cp1(model, what, monkeypatch):
    """Raw documents cut as one stream (--dataloader-inter-document-masking) through the block (its softmax
    layer on the plugin's CP attention), with the state-exchange and halo controls."""
    monkeypatch.setenv("KCP_THD_LAYOUT", "zigzag")
    spawn(_whole_stream, 2, model, what, (10,))


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gdn", "kda"])
@pytest.mark.parametrize("what", ["mixer", "block"])
def test_whole_stream_layout_on_gpu_bf16(model, what, monkeypatch):
    """The same on one GPU in bf16 (fla's kernels, flash-qla's for GDN where installed), CP ranks over gloo,
    1, 10 and 100 documents (``KCP_GPU_DOCS``: a part): CP's error against fp64 within 1.5x one GPU's; the
    mixer's controls miss by 10x."""
    monkeypatch.setenv("KCP_THD_LAYOUT", "zigzag")
    spawn(_whole_stream, 2, model, what, _gpu_cases("1,10,100")[0], GPU_BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gdn", "kda"])
@pytest.mark.parametrize("what", ["mixer", "block"])
def test_converted_layout_equals_cp1_on_gpu(model, what, monkeypatch):
    """The same on one GPU (fla's kernels, fp32 with 3xTF32 products), CP ranks over gloo
    (``KCP_GPU_DOCS``: a part of it, :func:`_gpu_cases`)."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
    spawn(_cases, 2, model, what, *_gpu_cases("1,10,100,control"), GPU)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("model", ["gdn", "kda"])
@pytest.mark.parametrize("what", ["mixer", "block"])
def test_converted_layout_at_4_ranks_on_gpu(model, what, monkeypatch):
    """Four CP ranks sharing one GPU, one and 300 documents, and the off-by-one control. 300 documents
    and the control take minutes each: the GPU suites run them as two parts (``KCP_GPU_DOCS=1,300`` and
    ``KCP_GPU_DOCS=control``, benchmarks/gpu_checks.py)."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
    spawn(_cases, 4, model, what, *_gpu_cases("1,300,control"), GPU)


def test_conversion_model_against_the_measured_steps(monkeypatch):
    """Whether to convert, against what was measured on 2 and 4 GPUs (tests/fixtures/perdoc_h200x2.csv,
    perdoc_h200x4.csv, and the op's head-shard default: perdoc_heads_h200x{2,4}.csv, and since its packing
    perdoc_heads_pack_h200x2.csv, whose head-shard rows replace the older ones; on 4 x H100,
    perdoc_heads_pack_h100x4.csv, its rows compared only with each other; the GDN mixer at 10 documents,
    32k and 128k, three processes each: perdoc_stay_or_convert_h200x2.csv, its last process's rows):
    wherever both our converted step (the default's row where it converted, or ``kcp-convert``) and our
    step left on Megatron's layout were timed, the model's pick is the faster one or within 10% of it,
    at op, mixer and block level (a run of 3 linear layers), GDN and KDA, 1 to 300 documents. The op's
    pick is the dispatch's, with the cores of the Hopper GPUs the rows ran on (flash-qla's for GDN where
    it runs, so the cores' difference counts); where it moves to head shards, its time is the default's
    own row where one was timed, else the measured cp2hp row of that call (``cp2hp-qla`` for GDN,
    ``cp2hp`` for KDA), and the faster of all three steps is the yardstick. 10%: the spread of one case
    between runs on two hosts of one kind (benchmarks/reports/, packed documents, run to run), where the steps
    are close; a wrong pick where they are not loses 1.2x to 3x."""
    from megatron_kcp.layers.layout import run_traffic
    from megatron_kcp.ops import dispatch
    from megatron_kcp.parallel.cost_model import relayout_pays
    from megatron_kcp.plan import all_plans
    monkeypatch.delenv("KCP_CONVERT", raising=False)
    monkeypatch.delenv("KCP_STRATEGY", raising=False)
    monkeypatch.setattr(environment, "qla_runs", lambda device, dtype, kda, head_dims: not kda)
    steps = {}
    files = [(gpu, W, f"perdoc{run}_{gpu}x{W}.csv") for gpu in ("h200", "h100") for W in (2, 4)
             for run in ("", "_heads", "_heads_pack", "_stay_or_convert")]
    for gpu, W, name in files:
        for r in frozen.rows(name):
            if not r["ms"] or r["level"] == "-":
                continue
            converted = "in the contiguous layout" in r["note"] or r["note"].startswith("contiguous")
            key = (r["level"], r["model"], r["docs"], int(r["tokens"]), W, gpu)
            if r["method"] in ("kcp-noconvert", "kcp-convert") or r["method"] == "kcp" and converted:
                steps.setdefault(key, {})[converted] = float(r["ms"])
            if r["level"] == "ops" and (r["method"] == ("cp2hp" if r["model"] == "KDA" else "cp2hp-qla") or
                                        r["method"] == "kcp" and r["note"].startswith("strategy cp2hp")):
                steps.setdefault(key, {})["heads"] = float(r["ms"])
    shape = {s.model: s for s in frozen.SHAPES.values()}
    picks = []
    dispatch.decide_problem.cache_clear()
    for (level, model, docs, T, W, gpu), ms in steps.items():
        if len([m for m in ms if m != "heads"]) < 2:
            continue
        s, run, cu = shape[model], {"ops": None, "mixer": 1, "block": 3}[level], frozen.cu_seqlens(docs, T, pad=2 * W)
        if run is None:
            d = dispatch.decide_problem(Problem(all_plans(cu, "zigzag_per_doc", W)[0], torch.device("cuda"),
                                                torch.bfloat16, model == "KDA", (s.K, s.K), s.HV, s.H, peer_calls=True))
            pick = "heads" if d.strategy == "cp2hp" else bool(d.layout)
        else:
            pick = relayout_pays(cu, "zigzag_per_doc", W, s.HV, s.K, *run_traffic(s.hidden * 2, run))
            ms.pop("heads", None)
        if pick not in ms:               # the picked step was not timed in this case
            continue
        picks.append((level, model, docs, T, W, gpu, pick, ms[pick] / min(ms.values())))
    dispatch.decide_problem.cache_clear()
    assert len(picks) >= 25 and any(p[6] == "heads" for p in picks) and any(p[5] == "h100" for p in picks), picks
    assert all(loss <= 1.10 for *_, loss in picks), [p for p in picks if p[-1] > 1.10]


def test_mixer_pick_where_every_process_agrees(monkeypatch):
    """The GDN mixer at 10 documents, 32k and 128k, three processes each
    (tests/fixtures/perdoc_stay_or_convert_h200x2.csv): where every process has the same layout faster
    by more than 2%, converting or staying on Megatron's layout, the cost model picks it (128k: convert);
    where the processes disagree (32k) either pick stands. Tighter than the 10% of
    :func:`test_conversion_model_against_the_measured_steps`, whose 10% lets this row through where a
    state pass priced down to the heads and flash-qla's core keeps the 128k pack on Megatron's layout,
    slower there in every process."""
    import re

    from megatron_kcp.layers.layout import run_traffic
    from megatron_kcp.parallel.cost_model import relayout_pays
    monkeypatch.delenv("KCP_CONVERT", raising=False)
    ms = {}
    for r in frozen.rows("perdoc_stay_or_convert_h200x2.csv"):
        if r["method"] in ("kcp", "kcp-noconvert"):
            process = re.search(r"process (\w)", r["note"]).group(1)
            ms.setdefault(int(r["tokens"]), {}).setdefault(process, {})[r["method"] == "kcp"] = float(r["ms"])
    s, checked = frozen.SHAPES["qwen3-next"], 0
    for T, runs in ms.items():
        gains = [m[False] / m[True] - 1 for m in runs.values()]      # staying over converting, per process
        assert len(gains) == 3, (T, runs)
        if min(gains) > 0.02 or max(gains) < -0.02:
            faster = min(gains) > 0
            assert relayout_pays(frozen.cu_seqlens("varlen", T, pad=4), "zigzag_per_doc", 2, s.HV, s.K,
                                 *run_traffic(s.hidden * 2, 1)) == faster, (T, gains)
            checked += 1
    assert checked == 1, ms


def test_head_shard_price_fits_the_measured_rows():
    """``cost_model.HEADS_RELAYOUT_BW`` is the least-squares bandwidth of the op's move to head shards on the
    measured KDA rows since its packing (tests/fixtures/perdoc_heads_pack_h200x2.csv, W = 2, 10, 100
    and 300 documents): the head-shard step (``cp2hp``) less fla's one-GPU call on the pack over W (the
    same call at HV / W heads) less the all-to-alls' latency, against the bytes a rank sends. On that
    price the op moves to head shards at 100 documents and stays at 10, as the rows say it should."""
    from megatron_kcp.ops.dispatch import op_bytes_per_token
    from megatron_kcp.parallel import cost_model
    ms = {}
    for r in frozen.rows("perdoc_heads_pack_h200x2.csv"):
        if r["level"] == "ops" and r["model"] == "KDA":
            ms.setdefault((r["docs"], int(r["tokens"])), {})[r["method"]] = float(r["ms"]) * 1e-3
    assert len(ms) >= 3, sorted(ms)
    op = op_bytes_per_token(32, 32, (128, 128), True, torch.bfloat16)
    num = den = 0.0
    for (docs, T), m in ms.items():
        sent = T / 2 * op / 2
        num += sent * sent
        den += sent * (m["cp2hp"] - m["noCP"] / 2 - 4 * cost_model.ALPHA)
    assert abs(cost_model.HEADS_RELAYOUT_BW / (num / den) - 1) < 0.05, (num / den, cost_model.HEADS_RELAYOUT_BW)
    for docs, moves in (("varlen100", True), ("varlen", False)):
        cu = frozen.cu_seqlens(docs, 32768, pad=4)
        assert cost_model.relayout_pays(cu, "zigzag_per_doc", 2, 32, 128, op, 4, target="heads") == moves, docs
        assert (ms[(docs, 32768)]["cp2hp"] < ms[(docs, 32768)]["kcp"]) == moves, (docs, ms[(docs, 32768)])


def test_one_long_sequence_keeps_off_head_shards(monkeypatch):
    """Priced by the exchange it saves alone, the move to head shards would pay on one long sequence, where
    the single-device call at HV / W heads runs latency-bound scans (one 128k sequence at W = 2: 23.64 ms
    on head shards against 8.97, benchmarks/reports/); the op weighs it at its own price only where no document
    is longer than a rank's share, so there it keeps its split step. 100 documents (Kimi-Linear, W = 2)
    move."""
    from megatron_kcp.ops import dispatch
    from megatron_kcp.parallel.cost_model import relayout_pays
    from megatron_kcp.plan import all_plans
    monkeypatch.delenv("KCP_CONVERT", raising=False)
    monkeypatch.delenv("KCP_STRATEGY", raising=False)
    monkeypatch.setattr(environment, "qla_runs", lambda device, dtype, kda, head_dims: not kda)

    def pick(docs, T, W, kda):
        heads = (32, 32) if kda else (16, 32)
        plan = all_plans(frozen.cu_seqlens(docs, T, pad=2 * W), "zigzag_per_doc", W)[0]
        return dispatch.decide_problem(Problem(plan, torch.device("cuda"), torch.bfloat16, kda, (128, 128), heads[1],
                                               heads[0], peer_calls=True))
    dispatch.decide_problem.cache_clear()
    try:
        op = dispatch.op_bytes_per_token(16, 32, (128, 128), False, torch.bfloat16)
        for T, W in ((32768, 4), (131072, 4), (131072, 8), (1048576, 8)):
            assert relayout_pays(frozen.cu_seqlens("single", T, pad=2 * W), "zigzag_per_doc", W, 32, 128, op, 4,
                                 target="heads"), (T, W)
            assert pick("single", T, W, kda=False).strategy == "gather", (T, W)
        assert pick("varlen100", 32768, 2, kda=True).strategy == "cp2hp"
    finally:
        dispatch.decide_problem.cache_clear()


def test_cut_price_fits_the_measured_rows():
    """``cost_model.HOP`` + ``HOP_HEAD`` at 32 heads is the least-squares price of a cut on the measured KDA
    op rows (tests/fixtures/perdoc_h200x2.csv, W = 2, 32k and 128k tokens, 100 and 300 documents):
    our step left on Megatron's layout less ours on the same documents laid out contiguously (the
    converted step less the conversion, i.e. Megatron-LM dev's scheme less fla's CP call; fla's CP call
    where ours did not convert), less the modelled exchange, over the cuts. Both sides run fla's
    kernels, so the difference is the layout's."""
    from megatron_kcp.parallel import cost_model
    ms = {}
    for r in frozen.rows("perdoc_h200x2.csv"):
        if r["level"] == "ops" and r["model"] == "KDA" and r["docs"] in ("varlen100", "varlen300") and r["ms"]:
            method = r["method"] + ("+converted" if "in the contiguous layout" in r["note"] else "")
            ms.setdefault((r["docs"], int(r["tokens"])), {})[method] = float(r["ms"])
    assert {T for _, T in ms} == {32768, 131072} and len(ms) == 4, sorted(ms)
    num = den = 0.0
    for (docs, T), m in ms.items():
        cu = frozen.cu_seqlens(docs, T, pad=4)
        contiguous = (m["kcp+converted"] - (m["mlm-chunkwise"] - m["fla-cp"]) if "kcp+converted" in m
                      else m["fla-cp"])
        cuts = cost_model.cuts(cu, "zigzag_per_doc", 2)
        exchange = [2 * min(cost_model.costs(cu, layout, 2, 32)) for layout in ("zigzag_per_doc", "contiguous")]
        num += cuts * ((m["kcp-noconvert"] - contiguous) * 1e-3 - (exchange[0] - exchange[1]))
        den += cuts * cuts
    fitted, modelled = num / den, cost_model.HOP + 32 * cost_model.HOP_HEAD
    assert abs(modelled / fitted - 1) < 0.05, (fitted, modelled)


def test_core_price_fits_the_measured_rows():
    """``cost_model.QLA_SAVES`` is the least-squares saving of flash-qla's GDN core against fla's, per token
    and value head, on the measured one-GPU rows (tests/fixtures/perdoc_h200x2.csv: fla's call and
    flash-qla's on the same packed documents, 10 to 300 documents, 32k and 128k tokens, 32 value heads),
    and the conversion that pays only through it (the GDN op at 128k and 100 documents, measured faster
    converted to flash-qla's kernels than left on fla's: ``kcp-convert`` in the CSV) is taken on that
    price."""
    from megatron_kcp.ops.dispatch import op_bytes_per_token
    from megatron_kcp.parallel import cost_model
    num = den = 0.0
    ms = {}
    for r in frozen.rows("perdoc_h200x2.csv"):
        if r["level"] == "ops" and r["model"] == "GDN" and r["W"] == "1" and r["docs"].startswith("varlen"):
            ms.setdefault((r["docs"], int(r["tokens"]), int(r["heads"])), {})[r["method"]] = float(r["ms"]) * 1e-3
        elif r["level"] == "ops" and r["model"] == "GDN" and r["W"] == "2" and r["method"] == "kcp-convert":
            assert (r["docs"], r["tokens"]) == ("varlen100", "131072"), r
    assert len(ms) >= 6, sorted(ms)
    for (docs, T, heads), m in ms.items():
        num += T * heads * (m["noCP"] - m["noCP-qla"])
        den += (T * heads) ** 2
    assert abs(cost_model.QLA_SAVES / (num / den) - 1) < 0.05, (num / den, cost_model.QLA_SAVES)
    cu = frozen.cu_seqlens("varlen100", 131072, pad=4)
    op = op_bytes_per_token(16, 32, (128, 128), False, torch.bfloat16)
    saves = cost_model.core_saving("fla", "qla", 65536, 32, 128)
    assert cost_model.relayout_pays(cu, "zigzag_per_doc", 2, 32, 128, op, 4, core_saves=saves)
    assert not cost_model.relayout_pays(cu, "zigzag_per_doc", 2, 32, 128, op, 4)
    assert cost_model.core_saving("qla", "fla", 65536, 32, 128) == -saves
    assert cost_model.core_saving("fla", "fla", 65536, 32, 128) == 0


def _conversions_follow_the_pattern():
    """The block converts once into and once out of each run of linear layers, and never around attention."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_kcp.layers import layout
    mod = block("gdn", 2, ProcessGroupCollection.use_mpu_process_groups())
    assert [(layer.linear, layer.run) for layer in mod.layers] == [(True, (1, 3))] * 3 + [(False, None)]
    moves = []
    real = layout.move

    def move(h, cu, source, target, group, tp):
        moves.append((source, target))
        return real(h, cu, source, target, group, tp)
    cu = docs_cu(4, 2)
    x = torch.randn(cu[-1] // 2, 1, CPU.hidden)
    with mock.patch.object(layout, "move", move), mock.patch.dict("os.environ", {"KCP_CONVERT": "1"}):
        mod(x, None, packed_seq_params=thd(cu))
    assert moves == [("zigzag_per_doc", "contiguous"), ("contiguous", "zigzag_per_doc")], moves


def test_block_converts_at_the_edges_of_the_linear_run():
    spawn(_conversions_follow_the_pattern, 2)
