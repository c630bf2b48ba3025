"""Rules of the pieces the families share: embeddings and head, norms, MLPs, MoE blocks, softmax attention.

Megatron names are megatron-core's local ones (``model.state_dict()`` of the KCP specs without
TransformerEngine, /work/notes/spec_contract.md); ``m`` is a Megatron prefix such as ``decoder.layers.3``,
``h`` an HF one such as ``model.layers.3``.
"""
from __future__ import annotations

from megatron_kcp.convert.rules import Rule, concat, copy, grouped_qkv_perm, split


def embeddings(vocab: int, hidden: int, tied: bool, prefix: str = "model.") -> list[Rule]:
    """Word embeddings, final norm and (untied) output layer.

    Args:
        vocab: vocabulary size.
        hidden: hidden size.
        tied: whether HF ties lm_head to the embeddings (then Megatron has no output_layer.weight).
        prefix: the HF decoder's prefix.

    Returns:
        The rules.
    """
    rules = [copy("embedding.word_embeddings.weight", f"{prefix}embed_tokens.weight", (vocab, hidden)),
             copy("decoder.final_layernorm.weight", f"{prefix}norm.weight", (hidden,))]
    if not tied:
        rules.append(copy("output_layer.weight", "lm_head.weight", (vocab, hidden)))
    return rules


def layer_norms(m: str, h: str, hidden: int) -> list[Rule]:
    """The pre-mixer and pre-MLP norms of one layer."""
    return [copy(f"{m}.input_layernorm.weight", f"{h}.input_layernorm.weight", (hidden,)),
            copy(f"{m}.pre_mlp_layernorm.weight", f"{h}.post_attention_layernorm.weight", (hidden,))]


def gated_mlp(m: str, h: str, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> list[Rule]:
    """A SwiGLU MLP: Megatron ``linear_fc1`` = [gate; up], ``linear_fc2`` = down.

    Args:
        m: Megatron MLP prefix (``...mlp``, ``...mlp.shared_experts``, ``...local_experts.3``).
        h: HF MLP prefix.
        hidden: hidden size.
        inter: intermediate size.
        names: the HF names of the gate, up and down projections.

    Returns:
        The two rules.
    """
    gate, up, down = names
    return [concat(f"{m}.linear_fc1.weight", [(f"{h}.{gate}.weight", (inter, hidden)),
                                              (f"{h}.{up}.weight", (inter, hidden))]),
            copy(f"{m}.linear_fc2.weight", f"{h}.{down}.weight", (hidden, inter))]


def experts(m: str, h: str, num: int, hidden: int, inter: int, packed: bool,
            names=("gate_proj", "up_proj", "down_proj")) -> list[Rule]:
    """Routed experts as megatron-core's SequentialMLP (``experts.local_experts.{e}``), from HF's per-expert
    tensors (``experts.{e}.gate_proj`` ...) or, ``packed``, from ``experts.gate_up_proj`` [E, 2I, H] and
    ``experts.down_proj`` [E, H, I].

    Returns:
        The rules.
    """
    local = [f"{m}.experts.local_experts.{e}" for e in range(num)]
    if packed:
        return [split([f"{x}.linear_fc1.weight" for x in local], f"{h}.experts.gate_up_proj", (num, 2 * inter, hidden)),
                split([f"{x}.linear_fc2.weight" for x in local], f"{h}.experts.down_proj", (num, hidden, inter))]
    return [r for e in range(num) for r in gated_mlp(local[e], f"{h}.experts.{e}", hidden, inter, names)]


def softmax_attention(m: str, h: str, hidden: int, heads: int, groups: int, head_dim: int, gated: bool,
                      qk_norm: bool) -> list[Rule]:
    """megatron-core SelfAttention from HF q/k/v/o projections (and q_norm/k_norm).

    Args:
        m: Megatron prefix (``...self_attention``).
        h: HF prefix (``...self_attn``).
        hidden: hidden size.
        heads: query heads.
        groups: key/value heads.
        head_dim: head dim.
        gated: HF q_proj holds [query; gate] per head (attention output gate).
        qk_norm: per-head RMSNorm of queries and keys.

    Returns:
        The rules.
    """
    q_rows = heads * head_dim * (2 if gated else 1)
    qkv = Rule((f"{m}.linear_qkv.weight",),
               ((f"{h}.q_proj.weight", (q_rows, hidden)), (f"{h}.k_proj.weight", (groups * head_dim, hidden)),
                (f"{h}.v_proj.weight", (groups * head_dim, hidden))),
               perm=grouped_qkv_perm(heads, groups, head_dim, gated))
    rules = [qkv, copy(f"{m}.linear_proj.weight", f"{h}.o_proj.weight", (hidden, heads * head_dim))]
    if qk_norm:
        rules += [copy(f"{m}.q_layernorm.weight", f"{h}.q_norm.weight", (head_dim,)),
                  copy(f"{m}.k_layernorm.weight", f"{h}.k_norm.weight", (head_dim,))]
    return rules


def layer_pattern(values: list[bool]) -> str:
    """A 0/1 list as Megatron-LM's pattern argument (``--moe-layer-freq``, ``--linear-attention-freq``)."""
    return "[" + ",".join(str(int(v)) for v in values) + "]"
