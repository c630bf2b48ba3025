"""What this machine can run, checked in one place: fla-core, flash-qla, fla's Gluon conv, TransformerEngine.

Each check fails early with the fix, where the library would fail late or compute wrong numbers.
Megatron's defaults assume TransformerEngine's (and apex's) fused kernels: without TE,
``pretrain_gpt.py`` stops at startup (RoPE fusion, persistent layer norm), at the first linear
(gradient accumulation fusion) or in the first bf16 softmax of megatron-core's local attention (apex's
``scaled_masked_softmax_cuda``: the MTP layer's) unless :data:`NO_TE_ARGS` turn them off.
"""
from __future__ import annotations

import functools

import torch

FLA_VERSION = "0.6.0"
QLA_VERSION = "0.1.3"
QLA_HEAD_DIM = 128
QLA_ARCHS = ((9, 0), (10, 0), (10, 3))       # where flash-qla's chunk is 64 and every kernel exists
NO_TE_ARGS = (("--transformer-impl", "local"), ("--no-rope-fusion",), ("--no-gradient-accumulation-fusion",),
              ("--no-persist-layer-norm",), ("--no-masked-softmax-fusion",))


def _capability(device: torch.device | None) -> tuple[int, int]:
    index = None if device is None else device.index
    return torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _fla_checked(device_index: int) -> None:
    try:
        import fla
        import triton
    except ImportError as e:
        raise RuntimeError(f"the CUDA path of megatron_kcp needs fla-core=={FLA_VERSION} and triton: "
                           f"pip install fla-core=={FLA_VERSION} ({e})") from e
    if getattr(fla, "__version__", None) != FLA_VERSION:
        raise RuntimeError(f"megatron_kcp is built and tested against fla-core {FLA_VERSION}, found "
                           f"{getattr(fla, '__version__', 'unknown')}: pip install fla-core=={FLA_VERSION}")
    major, minor = _capability(torch.device("cuda", device_index))
    if major < 8:
        raise RuntimeError(f"fla's kernels need an Ampere or newer GPU (compute capability >= 8.0), this one "
                           f"is {major}.{minor}: use backend='reference' (slow) or another GPU")
    from packaging.version import Version
    tv = Version(triton.__version__.split("+")[0])
    if major == 9 and Version("3.4.0") <= tv < Version("3.7.1"):
        try:
            import tilelang  # noqa: F401
        except ImportError:
            raise RuntimeError(f"Triton {tv} on Hopper computes gated GDN backward wrongly and fla 0.6.0 then refuses "
                               "it: pip install tilelang (fla dispatches that kernel to it) or triton>=3.7.1") from None


def check_fla(device: torch.device | None = None) -> None:
    """fla-core's kernels run on ``device`` (default: the current GPU); RuntimeError naming the fix if not."""
    if not torch.cuda.is_available():
        raise RuntimeError("fla's kernels need a CUDA GPU; on CPU use backend='reference'")
    index = None if device is None else device.index
    _fla_checked(index if index is not None else torch.cuda.current_device())


def check_qla(device: torch.device, dtype: torch.dtype, kda: bool, head_dims: tuple[int, int]) -> None:
    """flash-qla's fused GDN kernels run this problem here; ValueError / RuntimeError naming the fix if not."""
    if kda:
        raise ValueError("backend 'qla' runs GDN only (flash-qla has no KDA kernels): use backend='fla' for KDA")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"backend 'qla' takes bf16 or fp16 inputs, got {dtype}: use backend='fla' for fp32")
    if head_dims != (QLA_HEAD_DIM, QLA_HEAD_DIM):
        raise ValueError(f"backend 'qla' needs K = V = {QLA_HEAD_DIM}, got {head_dims}: use backend='fla'")
    if not torch.cuda.is_available():
        raise RuntimeError("backend 'qla' needs a CUDA GPU; on CPU use backend='reference'")
    cap = _capability(device)
    if cap not in QLA_ARCHS:
        raise RuntimeError(f"backend 'qla' runs on Hopper (sm90) and Blackwell (sm100/103), this GPU is "
                           f"sm{cap[0]}{cap[1]}: use backend='fla'")
    try:
        import flash_qla
    except ImportError as e:
        raise RuntimeError(f"backend 'qla' needs flash-qla=={QLA_VERSION}: pip install flash-qla=={QLA_VERSION} "
                           f"({e})") from e
    found = getattr(flash_qla, "__version__", None)
    if found is not None and found != QLA_VERSION:
        raise RuntimeError(f"megatron_kcp is built against flash-qla {QLA_VERSION}, found {found}: "
                           f"pip install flash-qla=={QLA_VERSION}")
    check_fla(device)                         # the qla core takes fla's l2norm


@functools.lru_cache(maxsize=64)
def qla_runs(device: torch.device, dtype: torch.dtype, kda: bool, head_dims: tuple[int, int]) -> bool:
    """Whether :func:`check_qla` passes (it says why not)."""
    try:
        check_qla(device, dtype, kda, head_dims)
    except (ValueError, RuntimeError):
        return False
    return True


GLUON_CONV_ARCH = (9, 0)                     # fla's Gluon conv is measured and tested from Hopper on
GLUON_CONV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_gluon_conv(device: torch.device, dtype: torch.dtype, kernel_size: int) -> None:
    """fla's Gluon short-conv kernels run this conv here; ValueError / RuntimeError naming the fix if not."""
    if dtype not in GLUON_CONV_DTYPES:
        raise ValueError(f"conv backend 'gluon' takes bf16, fp16 or fp32 inputs, got {dtype}: use backend='fla'")
    if kernel_size not in (2, 3, 4):
        raise ValueError(f"conv backend 'gluon' takes kernel sizes 2 to 4, got {kernel_size}: use backend='fla'")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("conv backend 'gluon' needs a CUDA GPU; on CPU use backend='reference'")
    cap = _capability(device)
    if cap < GLUON_CONV_ARCH:
        raise RuntimeError(f"conv backend 'gluon' is measured and tested from Hopper (sm90) on, this GPU is "
                           f"sm{cap[0]}{cap[1]}: use backend='fla'")
    try:
        from triton.experimental import gluon  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"conv backend 'gluon' needs a Triton with Gluon (3.5 or newer): use backend='fla' ({e})"
                           ) from e
    check_fla(device)


@functools.lru_cache(maxsize=64)
def gluon_conv_runs(device: torch.device, dtype: torch.dtype, kernel_size: int) -> bool:
    """Whether :func:`check_gluon_conv` passes (it says why not)."""
    try:
        check_gluon_conv(device, dtype, kernel_size)
    except (ValueError, RuntimeError):
        return False
    return True


def te_available() -> bool:
    """Whether TransformerEngine serves megatron-core's TE modules here."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider  # noqa: F401
        return True
    except ImportError:
        return False


def no_te_args(argv) -> list[str]:
    """The flags of :data:`NO_TE_ARGS` that ``argv`` does not set itself; none when TE is available."""
    if te_available():
        return []
    return [x for flag in NO_TE_ARGS if flag[0] not in argv for x in flag]
