"""What a user writes; CI type-checks it with ``mypy --strict`` (see .ci/run).

Never run by pytest: it would need a model hub. It only has to type-check: the return type
follows ``output_loading_info`` and the model class, and string options are checked literals.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, BertModel

import fastload


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 2)


def plain_module(path: str) -> nn.Linear:
    model = fastload.from_pretrained(TwoLayers, path, missing="error", read_mode="mmap")
    return model.second  # the class's attributes are known


def with_report(path: str) -> int:
    model, report = fastload.from_pretrained(TwoLayers, path, output_loading_info=True)
    model.first.weight.sum()
    return report.tensors_loaded + len(report.missing)


def transformers_class(path: str) -> int:
    bert = fastload.from_pretrained(BertModel, path, dtype=torch.bfloat16, device_map="balanced")
    hidden: int = bert.config.hidden_size
    return hidden


def model_id() -> nn.Module:
    model = fastload.from_pretrained(
        "sentence-transformers/all-MiniLM-L6-v2", revision="main", torch_dtype=torch.float16
    )
    return model.eval()


def auto_class(name: str) -> tuple[nn.Module, list[str]]:
    model, report = fastload.from_pretrained(AutoModelForCausalLM, name, output_loading_info=True)
    return model, report.missing


def patched(path: str) -> None:
    with fastload.patch_transformers():
        BertModel.from_pretrained(path)


def reloaded(model: TwoLayers, path: str) -> int:
    report: fastload.ReloadReport = fastload.reload(model, path, atomic=True)
    return report.tensors_read + report.tensors_unchanged
