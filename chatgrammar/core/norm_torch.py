"""Exact final norms as torch modules (imported only by :func:`chatgrammar.build_final_norm`).

:class:`FinalNormModule` runs the ops of a norm kind in the order and dtypes transformers'
modules use (``LlamaRMSNorm``, ``Gemma3RMSNorm``, ``GptOssRMSNorm``, ``nn.LayerNorm``, …), so
its output is bit-identical to the backbone's own final norm in float32 and bfloat16, not only
close. Which ops that takes is data in ``norms.yaml``: the kind's ``multiply``, ``offset``,
``offset_dtype``, ``weight_dtype`` and ``statistics``, the backbone's ``inv_sqrt``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norms import NormKind


class FinalNormModule(nn.Module):
    """A final norm of one kind.

    Args:
        kind: the :class:`chatgrammar.core.norms.NormKind`.
        hidden_size: the size of the normalised (last) dimension.
        eps: the epsilon.
        dtype: the model dtype (the weight's, unless the kind keeps it in fp32).
        inv_sqrt: ``"rsqrt"`` or ``"pow"`` (see ``norms.yaml``).

    Attributes:
        weight: ``(hidden_size,)``, initialised as transformers does (ones, or zeros for a
            ``1 + w`` kind); load a checkpoint's norm tensor into it
            (``module.weight.data.copy_(t)`` or ``load_state_dict({"weight": t})``).
        bias: ``(hidden_size,)`` for kinds with a bias, else None.
    """

    def __init__(self, kind: NormKind, hidden_size: int, eps: float,
                 dtype: torch.dtype = torch.float32, inv_sqrt: str = "rsqrt"):
        super().__init__()
        self.kind = kind
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.inv_sqrt = inv_sqrt
        wdtype = torch.float32 if kind.weight_dtype == "float32" else dtype
        init = torch.zeros if kind.offset else torch.ones
        self.weight = nn.Parameter(init(self.hidden_size, dtype=wdtype))
        if kind.bias:
            self.bias = nn.Parameter(torch.zeros(self.hidden_size, dtype=wdtype))
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return f"{self.kind.name}, ({self.hidden_size},), eps={self.eps}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kind
        if k.statistics == "fused":
            # nn.LayerNorm / Nemotron's LayerNorm1P: one F.layer_norm in the weight's dtype
            w = self.weight + k.offset if k.offset else self.weight
            return F.layer_norm(x, (self.hidden_size,), w, self.bias, self.eps)
        dtype = x.dtype
        h = x.to(torch.float32)
        if k.center:
            mean = h.mean(-1, keepdim=True)
            h = h - mean
        var = h.pow(2).mean(-1, keepdim=True) + self.eps
        h = h * (torch.pow(var, -0.5) if self.inv_sqrt == "pow" else torch.rsqrt(var))
        if k.multiply == "after_cast":  # Llama: weight * hidden.to(input_dtype)
            w = self.weight + k.offset if k.offset else self.weight
            out = w * h.to(dtype)
            return out + self.bias if self.bias is not None else out
        if k.offset:
            w = (self.weight + k.offset).float() if k.offset_dtype == "weight" else \
                k.offset + self.weight.float()
        else:
            w = self.weight.float()
        out = h * w
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(dtype)
