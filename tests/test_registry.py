"""megatron_kcp.registry.Registry: names refused twice or reserved, unknown names listed, registration order,
an entry swapped in its place and restored, a block's entries removed after, watchers told of every change."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from megatron_kcp.registry import Registry


@dataclass(frozen=True)
class Entry:
    name: str
    value: int = 0


def test_register_get_order_and_refusals():
    reg = Registry("a thing", reserved=("auto",))
    for name in ("b", "a", "c"):
        reg.register(Entry(name))
    assert reg.names() == ("b", "a", "c") and [e.name for e in reg] == ["b", "a", "c"] and len(reg) == 3
    assert "a" in reg and "auto" not in reg and reg["a"] == reg.get("a") == Entry("a")
    with pytest.raises(ValueError, match="a thing named 'a' is registered already"):
        reg.register(Entry("a", 1))
    with pytest.raises(ValueError, match="a thing named 'auto' is registered already"):
        reg.register(Entry("auto"))
    with pytest.raises(KeyError, match="no thing named 'd': registered are b, a, c"):
        reg.get("d")
    assert reg.unregister("a") == Entry("a") and reg.names() == ("b", "c")
    with pytest.raises(KeyError, match="no thing named 'a'"):
        reg.unregister("a")


def test_swapped_and_registered_restore_even_on_error():
    reg, seen = Registry("a thing"), []
    reg.watch(lambda: seen.append(reg.names()))
    reg.register(Entry("a"))
    reg.register(Entry("b"))
    with pytest.raises(RuntimeError):
        with reg.swapped(Entry("a", 1)), reg.registered(Entry("c")):
            assert reg["a"].value == 1 and reg.names() == ("a", "b", "c")
            raise RuntimeError
    assert list(reg) == [Entry("a"), Entry("b")]
    with pytest.raises(KeyError, match="no thing named 'z'"), reg.swapped(Entry("z")):
        pass
    assert seen == [("a",), ("a", "b"), ("a", "b"), ("a", "b", "c"), ("a", "b"), ("a", "b")]
