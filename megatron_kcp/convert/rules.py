"""Mapping rules between a Hugging Face state dict and a Megatron ``model.state_dict()``.

A :class:`Rule` ties one or more Megatron tensors to one or more HF tensors. Every rule is a permutation of
rows (dim 0, after viewing each tensor as ``[rows, *trailing]`` of the Megatron tensor's trailing shape), plus
an optional arithmetic offset done in float64 (the zero-centred norm's ``w - 1``), so that the way back is
exact: rows are gathered by the inverse permutation and the offset is undone in float64 and cast back.
Megatron tensors that have no HF counterpart (a bias HF does not have) are filled with a constant, and
the way back checks that they still hold it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class ConvertError(ValueError):
    """A one-line conversion error naming the tensor, config field or architecture at fault."""


@dataclass
class Rule:
    """Megatron tensors ``megatron`` = rows of the HF tensors ``hf`` (concatenated on dim 0) taken in the
    order ``perm`` (None: as they are), plus ``offset``.

    Args:
        megatron: Megatron state-dict names, in the order their rows are concatenated.
        hf: HF tensor names and their shapes, ``(name, shape)``, in the order their rows are concatenated.
        perm: Megatron row ``i`` is HF row ``perm[i]`` (a permutation of all rows), or None.
        offset: added to the HF values (in float64) on the way in, subtracted on the way out.
        fill: for a rule without HF tensors, the value the Megatron tensors take (and must still hold on
            the way out).
    """

    megatron: tuple[str, ...]
    hf: tuple[tuple[str, tuple[int, ...]], ...]
    perm: torch.Tensor | None = None
    offset: float = 0.0
    fill: float | None = None
    note: str = field(default="", compare=False)

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.hf)

    def to_megatron(self, tensors: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> dict:
        """The Megatron tensors of this rule.

        Args:
            tensors: HF name -> tensor (at least this rule's).
            targets: Megatron name -> a tensor of the wanted shape and dtype (the model's own).

        Returns:
            Megatron name -> tensor (shapes and dtypes of ``targets``).
        """
        if self.fill is not None:
            return {m: torch.full_like(targets[m], self.fill) for m in self.megatron}
        trailing = tuple(targets[self.megatron[0]].shape[1:])
        for name, shape in self.hf:
            if tuple(tensors[name].shape) != tuple(shape):
                raise ConvertError(f"shape mismatch: {name} has shape {tuple(tensors[name].shape)}, expected "
                                   f"{tuple(shape)}")
        rows = torch.cat([tensors[name].reshape(-1, *trailing) for name, _ in self.hf])
        if self.perm is not None:
            rows = rows[self.perm]
        out, start = {}, 0
        for m in self.megatron:
            n = targets[m].shape[0] if targets[m].dim() else 1
            part = rows[start:start + n].reshape(targets[m].shape)
            start += n
            dtype = targets[m].dtype
            if self.offset:
                value = (part.double() + self.offset).to(dtype)
                back = (value.double() - self.offset).to(part.dtype)
                if not torch.equal(back.view(-1), part.reshape(-1)):
                    raise ConvertError(f"{self.hf_names[0]}: its offset w {self.offset:+g} is not exact in {dtype} "
                                       "(weights outside [0.5, 2]); the way back to HF would change it")
                out[m] = value
            else:
                out[m] = part.to(dtype)
        if start != rows.shape[0]:
            raise ConvertError(f"shape mismatch: {', '.join(self.hf_names)} hold {rows.shape[0]} rows, "
                               f"{', '.join(self.megatron)} take {start}")
        return out

    def to_hf(self, tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> dict:
        """The HF tensors of this rule from the Megatron ones (the inverse of :meth:`to_megatron`).

        Args:
            tensors: Megatron name -> tensor (at least this rule's).
            dtypes: HF name -> dtype to write.

        Returns:
            HF name -> tensor.
        """
        if self.fill is not None:
            for m in self.megatron:
                if not torch.all(tensors[m] == self.fill):
                    raise ConvertError(f"{m} is not {self.fill:g} everywhere, and HF has no tensor for it "
                                       f"({self.note or 'the HF model has no such parameter'})")
            return {}
        trailing = tuple(tensors[self.megatron[0]].shape[1:])
        rows = torch.cat([tensors[m].reshape(-1, *trailing) for m in self.megatron])
        if self.perm is not None:
            rows = rows[torch.argsort(self.perm)]
        out, start = {}, 0
        for name, shape in self.hf:
            n = int(torch.Size(shape).numel() // max(1, torch.Size(trailing).numel()))
            part = rows[start:start + n].reshape(shape)
            start += n
            if self.offset:
                part = part.double() - self.offset
            out[name] = part.to(dtypes.get(name, part.dtype)).contiguous()
        return out


def copy(megatron: str, hf: str, shape, offset: float = 0.0) -> Rule:
    """One tensor as it is (plus ``offset``)."""
    return Rule((megatron,), ((hf, tuple(shape)),), offset=offset)


def concat(megatron: str, hf: list[tuple[str, tuple]]) -> Rule:
    """One Megatron tensor = the HF tensors stacked on dim 0 (e.g. ``linear_fc1`` = [gate; up])."""
    return Rule((megatron,), tuple((n, tuple(s)) for n, s in hf))


def split(megatron: list[str], hf: str, shape) -> Rule:
    """Megatron tensors = the rows of one HF tensor, in order (e.g. packed experts, one per expert)."""
    return Rule(tuple(megatron), ((hf, tuple(shape)),))


def fill(megatron: str, value: float, note: str) -> Rule:
    """A Megatron tensor HF lacks, set to ``value`` (and checked to be ``value`` on export)."""
    return Rule((megatron,), (), fill=value, note=note)


def grouped_qkv_perm(num_heads: int, num_groups: int, head_dim: int, gated: bool) -> torch.Tensor:
    """Rows of megatron-core's ``linear_qkv`` (per query group: its query heads, [their gates], one key, one
    value head) in the rows of HF's ``[q_proj; k_proj; v_proj]``, where ``q_proj`` holds per head
    ``[query; gate]`` when ``gated`` (Qwen3-Next's output gate), else the query only.

    Args:
        num_heads: query heads.
        num_groups: key/value heads.
        head_dim: the head dim.
        gated: whether q_proj carries an output gate per head.

    Returns:
        A LongTensor permutation (Megatron row -> HF row).
    """
    per_q = head_dim * (2 if gated else 1)
    q = torch.arange(num_heads * per_q).view(num_heads, per_q)
    base_k = num_heads * per_q
    k = base_k + torch.arange(num_groups * head_dim).view(num_groups, head_dim)
    v = base_k + num_groups * head_dim + torch.arange(num_groups * head_dim).view(num_groups, head_dim)
    per_group = num_heads // num_groups
    rows = []
    for g in range(num_groups):
        heads = q[g * per_group:(g + 1) * per_group]
        rows.append(heads[:, :head_dim].reshape(-1))
        if gated:
            rows.append(heads[:, head_dim:].reshape(-1))
        rows += [k[g], v[g]]
    return torch.cat(rows)


def gdn_in_proj_perm(key_heads: int, value_heads: int, key_dim: int, value_dim: int, fused: bool) -> torch.Tensor:
    """Rows of megatron-core GatedDeltaNet's ``in_proj`` (sections query, key, value, z, beta, alpha, each over
    all heads, at TP = 1) in the rows of the HF projections concatenated.

    HF layouts: ``fused`` (Qwen3-Next): ``[in_proj_qkvz; in_proj_ba]``, where in_proj_qkvz holds per key head
    ``[q (key_dim), k (key_dim), v (r * value_dim), z (r * value_dim)]`` and in_proj_ba per key head
    ``[b (r), a (r)]``, r = value_heads / key_heads. Otherwise (Qwen3.5) ``[in_proj_qkv; in_proj_z; in_proj_b;
    in_proj_a]``, each already section-major.

    Returns:
        A LongTensor permutation (Megatron row -> HF row).
    """
    r = value_heads // key_heads
    qk, v = key_heads * key_dim, value_heads * value_dim
    if not fused:
        return torch.arange(2 * qk + 2 * v + 2 * value_heads)
    per_head = 2 * key_dim + 2 * r * value_dim
    qkvz = torch.arange(key_heads * per_head).view(key_heads, per_head)
    q, k, vv, z = torch.split(qkvz, [key_dim, key_dim, r * value_dim, r * value_dim], dim=1)
    ba = key_heads * per_head + torch.arange(key_heads * 2 * r).view(key_heads, 2 * r)
    b, a = torch.split(ba, [r, r], dim=1)
    return torch.cat([t.reshape(-1) for t in (q, k, vv, z, b, a)])
