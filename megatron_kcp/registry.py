"""A registry of named entries (the local cores, the exchange strategies): one ``Registry`` per kind, filled by one
``registry.register(...)`` line in each entry's module, read in registration order.

    CORES = Registry("a local core", reserved=("auto",))
    CORES.register(CoreEntry(name="reference", ...))
    CORES["reference"]             # the entry; an unknown name is a KeyError listing the known ones
    with CORES.swapped(Other()):   # the entry of that name replaced (in its place) and restored after
        ...
    with CORES.registered(Toy()):  # added for the block (a test's core or strategy), removed after
        ...

Who caches what it derived from the entries says so with ``watch(forget)``: every change calls ``forget()``.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Generic, Iterator, Protocol, TypeVar


class Named(Protocol):
    name: str


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    """Entries by their ``name``, in registration order.

    Args:
        kind: what an entry is, with its article, as the errors name it (``"a local core"``).
        reserved: names no entry may take (the dispatch's own words, such as ``auto``).
    """

    def __init__(self, kind: str, reserved: tuple[str, ...] = ()):
        self.kind, self.reserved = kind, reserved
        self._entries: dict[str, T] = {}
        self._watchers: list[Callable[[], None]] = []

    def watch(self, forget: Callable[[], None]) -> None:
        """Call ``forget()`` after every change of the entries (a cache of decisions drawn from them)."""
        self._watchers.append(forget)

    def _changed(self) -> None:
        for forget in self._watchers:
            forget()

    def register(self, entry: T) -> T:
        """Add ``entry`` (its name must be new and not reserved); returns it."""
        if entry.name in self._entries or entry.name in self.reserved:
            raise ValueError(f"{self.kind} named {entry.name!r} is registered already")
        self._entries[entry.name] = entry
        self._changed()
        return entry

    def unregister(self, name: str) -> T:
        """Remove the entry called ``name``; returns it."""
        entry = self.get(name)
        del self._entries[name]
        self._changed()
        return entry

    def get(self, name: str) -> T:
        """The entry called ``name``; KeyError naming the registered ones where there is none."""
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"no {self.kind.split(' ', 1)[1]} named {name!r}: registered are "
                           f"{', '.join(self._entries)}") from None

    __getitem__ = get

    @contextlib.contextmanager
    def swapped(self, *entries: T) -> Iterator[None]:
        """Each of ``entries`` in place of the registered entry of its name (same position) until the block
        ends; the originals are restored after."""
        saved = {e.name: self.get(e.name) for e in entries}
        try:
            self._entries.update({e.name: e for e in entries})
            self._changed()
            yield
        finally:
            self._entries.update(saved)
            self._changed()

    @contextlib.contextmanager
    def registered(self, *entries: T) -> Iterator[None]:
        """``entries`` registered until the block ends, unregistered after."""
        added = []
        try:
            for entry in entries:
                added.append(self.register(entry))
            yield
        finally:
            for entry in reversed(added):
                self.unregister(entry.name)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[T]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
