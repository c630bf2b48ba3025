"""patches/ apply cleanly to the installed megatron-core 0.19.2 sources and do what they say."""
from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess

import megatron.core
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCH = ROOT / "patches" / "megatron-core-0.19.2-spec-default.patch"


@pytest.fixture
def patched_spec_utils(tmp_path):
    if shutil.which("patch") is None:
        pytest.skip("needs the `patch` program")
    src = pathlib.Path(megatron.core.__file__).parent / "transformer" / "spec_utils.py"
    dst = tmp_path / "megatron" / "core" / "transformer" / "spec_utils.py"
    dst.parent.mkdir(parents=True)
    shutil.copy(src, dst)
    subprocess.run(["patch", "-p1", "--forward", "-i", str(PATCH)], cwd=tmp_path, check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("patched_spec_utils", dst)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_installed_megatron_core_is_0_19_2():
    assert megatron.core.__version__ == "0.19.2", "the patch is written against megatron-core 0.19.2"


def test_one_token_spec_resolves_to_default(patched_spec_utils):
    from megatron_kcp.spec import default_spec, gdn_hybrid_layer_spec
    assert patched_spec_utils.import_module(["megatron_kcp"]) is default_spec
    assert patched_spec_utils.import_module(["megatron_kcp", "gdn_hybrid_layer_spec"]) is gdn_hybrid_layer_spec


def test_two_token_spec_works_unpatched():
    from megatron.core.transformer.spec_utils import import_module

    from megatron_kcp.spec import gdn_hybrid_layer_spec
    assert import_module(["megatron_kcp.spec", "gdn_hybrid_layer_spec"]) is gdn_hybrid_layer_spec
