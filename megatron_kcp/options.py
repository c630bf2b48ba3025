"""The environment options of the op and the layers, read in one place: ``Options.from_env()``.

Each field holds its variable's raw value (None where it is unset); whoever reads an option checks its
value where the option takes effect, with the error naming the accepted values (so a value that no call
reads is never an error).

======================  ==================================================================  =================
variable                what it overrides                                                   values
======================  ==================================================================  =================
``KCP_STRATEGY``        the cost model's state exchange (where the op's default runs one)   relay, gather
``KCP_CONVERT``         the cost model's layout move (op and mixers)                        1 (move), 0 (stay)
``KCP_RELAY_GROUPS``    the relay's head groups (its pipeline depth)                        a divisor of H
``KCP_CONV``            the conv backend that ``backend="auto"`` means                      a conv backend
``KCP_THD_LAYOUT``      the CP layout of Megatron's THD batches                             a layout
======================  ==================================================================  =================
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

STRATEGY_ENV, CONVERT_ENV, RELAY_GROUPS_ENV = "KCP_STRATEGY", "KCP_CONVERT", "KCP_RELAY_GROUPS"
CONV_ENV, THD_LAYOUT_ENV = "KCP_CONV", "KCP_THD_LAYOUT"
STATE_EXCHANGES = ("relay", "gather")          # what KCP_STRATEGY may name


@dataclass(frozen=True)
class Options:
    """The options' raw values (None: unset), hashable (part of the dispatch's cache key)."""
    strategy: str | None = None                # KCP_STRATEGY
    convert: str | None = None                 # KCP_CONVERT
    relay_groups: str | None = None            # KCP_RELAY_GROUPS
    conv: str | None = None                    # KCP_CONV
    thd_layout: str | None = None              # KCP_THD_LAYOUT

    @classmethod
    def from_env(cls, environ=None) -> Options:
        """The options of ``environ`` (default ``os.environ``), each read once."""
        environ = os.environ if environ is None else environ
        return cls(**{f.name: environ.get(ENV[f.name]) for f in fields(cls)})

    def forced_strategy(self) -> str | None:
        """``KCP_STRATEGY``, validated; None where unset (or empty)."""
        if not self.strategy:
            return None
        if self.strategy not in STATE_EXCHANGES:
            raise ValueError(f"{STRATEGY_ENV}={self.strategy!r}: use relay or gather (or unset it for the cost model)")
        return self.strategy

    def forced_relayout(self) -> bool | None:
        """``KCP_CONVERT``, validated: True (move), False (keep the layout), None where unset (or empty)."""
        if not self.convert:
            return None
        if self.convert not in ("0", "1"):
            raise ValueError(f"{CONVERT_ENV}={self.convert!r}: use 1 (convert), 0 (keep the layout), or unset it")
        return self.convert == "1"


ENV = {"strategy": STRATEGY_ENV, "convert": CONVERT_ENV, "relay_groups": RELAY_GROUPS_ENV, "conv": CONV_ENV,
       "thd_layout": THD_LAYOUT_ENV}
