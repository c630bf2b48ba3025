"""Megatron-LM's pretrain_gpt.py on the pip-installed megatron-core.

Megatron's startup (``initialize_megatron``) runs ``make`` in ``megatron/core/datasets`` to build the
dataset index helpers, and exits if make fails. The megatron-core wheel ships the helpers built but not
their Makefile, so next to the wheel pretrain_gpt.py stops there. ``megatron_kcp.spec`` is imported
before that step (``--spec`` is resolved first) and calls :func:`skip_make_of_prebuilt_dataset_helpers`;
so does ``megatron_kcp.train``. A Megatron-LM checkout, which has the Makefile, is left alone.
"""
from __future__ import annotations

import os


def skip_make_of_prebuilt_dataset_helpers() -> bool:
    """Make Megatron's ``compile_helpers`` a no-op if the built helpers import and no Makefile is there."""
    from megatron.core.datasets import utils
    if os.path.exists(os.path.join(os.path.dirname(os.path.abspath(utils.__file__)), "Makefile")):
        return False
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError:
        return False
    utils.compile_helpers = lambda: None
    return True
