"""Which parameters Muon updates and which go to AdamW. Explained in chapter 7.

Source: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024: Muon only
for hidden 2-D weights; embeddings, output head, norm gains, biases and every non-2-D tensor to
AdamW); Liu et al. (2025), "Muon is Scalable for LLM Training" (arXiv:2502.16982).

Decided by module type and tensor role (:func:`classify_parameters`), never by name. The output
head is :func:`optbook.optim.param_groups.output_head`: ``model.get_output_embeddings()`` when the
model defines it (the Hugging Face convention; :class:`optbook.models.TinyTransformer` does), otherwise
the last ``nn.Linear`` registered in the model. A head tied to the input embedding is an embedding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .param_groups import NO_DECAY_ROLES, classify_parameters, output_head

__all__ = ["MuonRouting", "muon_param_groups"]


@dataclass
class MuonRouting:
    """The result of :func:`muon_param_groups`: param groups for Muon and for AdamW, and why."""

    muon: list[dict]
    adamw: list[dict]
    reasons: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        """One line per parameter: name, shape, optimizer, reason."""
        lines = []
        for target, groups in (("Muon", self.muon), ("AdamW", self.adamw)):
            for g in groups:
                for name, p in zip(g["param_names"], g["params"]):
                    lines.append(f"{name:<34} {str(tuple(p.shape)):<12} {target:<6} "
                                 f"wd={g.get('weight_decay', 0.0):g}  {self.reasons[name]}")
        return "\n".join(lines)


def muon_param_groups(model: nn.Module, *, weight_decay: float = 0.0, adamw_weight_decay: float | None = None,
                      muon_options: dict | None = None, adamw_options: dict | None = None) -> MuonRouting:
    """Route ``model``'s parameters: 2-D hidden weights to Muon, everything else to AdamW.

    Args:
        model: any ``nn.Module``.
        weight_decay: Muon's decoupled decay.
        adamw_weight_decay: decay of AdamW's matrices (output head); default ``weight_decay``.
            Embeddings, norms, biases and other vectors get no decay.
        muon_options, adamw_options: extra keys for the Muon group / every AdamW group (e.g. ``lr``).

    Returns:
        :class:`MuonRouting` with ``muon`` (one group) and ``adamw`` (up to two groups: decayed and
        not), each group carrying ``param_names``; ``reasons`` says why each tensor went where.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    head = output_head(model)
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    adamw_wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    muon, adamw_decay, adamw_plain, reasons = [], [], [], {}
    for info in classify_parameters(model):
        p = info.param
        if info.role == "embedding":
            adamw_plain.append(info)
            reasons[info.name] = "embedding table"
        elif id(p) in head_ids and p.ndim >= 2:
            adamw_decay.append(info)
            reasons[info.name] = "output head"
        elif info.role in NO_DECAY_ROLES:
            adamw_plain.append(info)
            reasons[info.name] = {"bias": "bias", "norm": "normalisation gain/shift", "vector": "not 2-D"}[info.role]
        elif p.ndim == 2:
            muon.append(info)
            reasons[info.name] = "2-D hidden weight"
        else:
            adamw_decay.append(info)
            reasons[info.name] = f"{p.ndim}-D tensor (Muon needs 2-D)"

    def group(infos, **extra):
        return {"params": [i.param for i in infos], "param_names": [i.name for i in infos], **extra}

    muon_groups = [group(muon, weight_decay=weight_decay, **(muon_options or {}))] if muon else []
    adamw_groups = [group(infos, weight_decay=wd, **(adamw_options or {}))
                    for infos, wd in ((adamw_decay, adamw_wd), (adamw_plain, 0.0)) if infos]
    return MuonRouting(muon_groups, adamw_groups, reasons)
