"""The Megatron GPTModel of a family's :class:`~megatron_kcp.convert.base.ModelSpec`, built on the CPU.

:func:`single_rank_world` gives megatron-core its parallel state (a 1-rank gloo world at TP = PP = CP = 1)
unless the caller already set one up (tests build the model at TP = 2 or CP = 2 inside their ranks).
"""
from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass

import torch


@contextlib.contextmanager
def single_rank_world():
    """A 1-rank gloo process group and megatron-core's model-parallel state at sizes 1, for the block (both
    are left as they are when already initialised)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    own_group = not dist.is_initialized()
    if own_group:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    own_state = not ps.model_parallel_is_initialized()
    if own_state:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        if torch.cuda.is_available():       # megatron-core's modules fork its CUDA RNG tracker where there is a GPU
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
            model_parallel_cuda_manual_seed(0)
    try:
        yield
    finally:
        if own_state:
            ps.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


_COMBINED: dict = {}


def config_class(kind: str):
    """TransformerConfig (""), megatron_kcp's KDAConfig ("kda"), megatron-core's MLATransformerConfig ("mla"),
    or a dataclass with the fields of both ("kda_mla")."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from megatron_kcp.layers.kda import KDAConfig
    if kind == "kda_mla" and kind not in _COMBINED:
        @dataclass
        class KDAMLATransformerConfig(KDAConfig, MLATransformerConfig):
            """KDA's fields (kda_gate_rank, kda_norm_eps) and MLA's."""
        _COMBINED[kind] = KDAMLATransformerConfig
    return _COMBINED.get(kind) or {"": TransformerConfig, "kda": KDAConfig, "mla": MLATransformerConfig}[kind]


def build_model(spec, dtype: torch.dtype = torch.float32, **gpt_overrides):
    """The GPTModel of ``spec`` (a ModelSpec) in the current parallel state, parameters in ``dtype`` on the CPU
    (without a GPU, megatron-core's CUDA placements are redirected there, megatron_kcp.megatron_cpu),
    left uninitialised: the caller loads every one (``import_hf`` and ``io.load_megatron`` check that).

    Args:
        spec: the family's ModelSpec.
        dtype: parameter dtype.
        gpt_overrides: GPTModel arguments on top of the spec's (e.g. ``parallel_output=False``).

    Returns:
        The model, in eval mode.
    """
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel

    from megatron_kcp import megatron_cpu
    megatron_cpu.enable()
    from megatron_kcp.spec import spec_from_name
    layer_spec = spec_from_name(spec.spec, where=f"the converter's spec {spec.spec}")
    fields = dict(spec.config)
    fields.update(params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
                  fp16=dtype == torch.float16, use_cpu_initialization=True, perform_initialization=False,
                  activation_func=F.silu,
                  bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                  masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    from megatron.core import parallel_state as ps
    fields.update(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                  context_parallel_size=ps.get_context_parallel_world_size(),
                  sequence_parallel=False)
    config = config_class(spec.config_class)(**fields)
    model = GPTModel(config, transformer_layer_spec=layer_spec, pre_process=True, post_process=True,
                     **{**spec.gpt, **gpt_overrides})
    return model.eval()
