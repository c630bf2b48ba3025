"""The package's arrows run one way: kernels -> CP machinery -> ops -> layers -> specs and the trainer. No module
imports one of a higher level, at module level or inside a function (read from the source, nothing imported)."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megatron_kcp"
# the first matching prefix gives a module's level; a module may import its own level and those below
LEVELS = (
    ("megatron_kcp.testing", 7),      # test and benchmark support: may import anything
    ("megatron_kcp.kernels", 1),
    ("megatron_kcp.parallel", 2),
    ("megatron_kcp.ops", 3),
    ("megatron_kcp.layers", 4),
    ("megatron_kcp.spec", 5), ("megatron_kcp.train", 5), ("megatron_kcp.launch", 5), ("megatron_kcp.convert", 5),
    ("megatron_kcp.demo", 5),
    ("megatron_kcp.environment", 0), ("megatron_kcp.plan", 0), ("megatron_kcp.calibration", 0),
    ("megatron_kcp.spec_names", 0), ("megatron_kcp.megatron_cpu", 0), ("megatron_kcp.wheel", 0),
    ("megatron_kcp.sizes", 0), ("megatron_kcp.data", 0), ("megatron_kcp.options", 0), ("megatron_kcp.problem", 0),
    ("megatron_kcp.registry", 0),
    ("megatron_kcp", 6),              # the package root: the facade that resolves `--spec megatron_kcp NAME`
)


def level(module: str) -> int:
    for prefix, n in LEVELS:
        if module == prefix or module.startswith(prefix + "."):
            return n
    raise AssertionError(f"{module} has no level in tests/test_import_graph.py::LEVELS")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every megatron_kcp import in the file; ``from pkg import mod`` names the submodule."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("megatron_kcp")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_kcp"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").is_file()
                            or (PACKAGE.parent / sub.replace(".", "/")).is_dir() else node.module))
    return out


def edges():
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        for line, other in imports(path):
            yield me, f"{path.relative_to(PACKAGE.parent)}:{line}", other


def test_no_module_imports_one_above_it():
    upward = [f"{where} ({me}, level {level(me)}) imports {other} (level {level(other)})"
              for me, where, other in edges() if level(other) > level(me)]
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The check is not vacuous: a kernel importing the dispatch is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from megatron_kcp.ops import dispatch\nimport megatron_kcp.layers.gdn\n")
    assert [level(m) for _, m in imports(bad)] == [3, 4] and level("megatron_kcp.kernels.core_fla") == 1
    assert len(list(edges())) > 100
