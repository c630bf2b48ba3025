"""patches/ apply cleanly to the installed megatron-core 0.19.2 sources and do what they say: the
one-token --spec, and a --spec that does not import stops the run (unpatched, Megatron returns None and
pretrain_gpt.py trains its default GPT)."""
from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess

import megatron.core
import pytest
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCH = ROOT / "patches" / "megatron-core-0.19.2-spec-default.patch"


def patched_spec_utils_module(tmp_path):
    """The installed spec_utils.py with the patch applied (a copy under ``tmp_path``), imported."""
    src = pathlib.Path(megatron.core.__file__).parent / "transformer" / "spec_utils.py"
    dst = pathlib.Path(tmp_path) / "megatron" / "core" / "transformer" / "spec_utils.py"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, dst)
    subprocess.run(["patch", "-p1", "--forward", "-i", str(PATCH)], cwd=tmp_path, check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("patched_spec_utils", dst)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def patched_spec_utils(tmp_path):
    if shutil.which("patch") is None:
        pytest.skip("needs the `patch` program")
    return patched_spec_utils_module(tmp_path)


def test_installed_megatron_core_is_0_19_2():
    # megatron-core appends `+<git sha>` when its files sit inside a git checkout (a .venv in this repo)
    assert Version(megatron.core.__version__).base_version == "0.19.2", \
        f"the patch is written against megatron-core 0.19.2, found {megatron.core.__version__}"


def test_one_token_spec_resolves_to_default(patched_spec_utils):
    from megatron_kcp.spec import default_spec, gdn_hybrid_layer_spec
    assert patched_spec_utils.import_module(["megatron_kcp"]) is default_spec
    assert patched_spec_utils.import_module(["megatron_kcp", "gdn_hybrid_layer_spec"]) is gdn_hybrid_layer_spec


def test_two_token_spec_works_unpatched():
    from megatron.core.transformer.spec_utils import import_module

    from megatron_kcp.spec import gdn_hybrid_layer_spec
    assert import_module(["megatron_kcp.spec", "gdn_hybrid_layer_spec"]) is gdn_hybrid_layer_spec


@pytest.fixture
def broken_spec_package(tmp_path, monkeypatch):
    """A spec package whose dependency is missing, as megatron_kcp is when fla or einops is."""
    pkg = tmp_path / "kcp_broken"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import kcp_missing_dependency  # noqa\ndefault_spec = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "kcp_broken"


def test_spec_that_does_not_import_stops_the_run(patched_spec_utils, broken_spec_package):
    with pytest.raises(ImportError, match="cannot import kcp_broken .*kcp_missing_dependency.*correct --spec"):
        patched_spec_utils.import_module([broken_spec_package, "default_spec"])
    with pytest.raises(ImportError, match="cannot import megatron_kcp_typo"):
        patched_spec_utils.import_module(["megatron_kcp_typo"])


def test_unpatched_megatron_falls_back_silently(broken_spec_package):
    """What the patch fixes (and why unpatched runs print the KCP-active line): None, i.e. the default GPT."""
    from megatron.core.transformer.spec_utils import import_module
    assert import_module([broken_spec_package, "default_spec"]) is None


def test_spec_local_keeps_its_meaning(patched_spec_utils):
    assert patched_spec_utils.import_module(["local"]) is None     # Megatron's default spec, local backend
