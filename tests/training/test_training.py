"""fastload.unused_parameters: the parameters that would break DDP (transformers #7272)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_config
from torch import nn

import fastload

transformers = pytest.importorskip("transformers")

POOLER = ["bert.pooler.dense.weight", "bert.pooler.dense.bias"]


def _bert_config() -> object:
    return make_config("bert", vocab_size=100)


class TokenTagger(nn.Module):
    """A token-level head on BertModel: the pooler's output is never used, as in #7272."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bert = transformers.BertModel(_bert_config())
        self.tags = nn.Linear(32, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tags(self.bert(input_ids).last_hidden_state)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.used = nn.Linear(8, 1)
        self.unused = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(self.body(x))


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))


def test_a_bert_model_whose_pooler_output_is_ignored_reports_the_pooler() -> None:
    assert fastload.unused_parameters(TokenTagger(), _ids()) == POOLER


def test_loss_fn_decides_which_outputs_count() -> None:
    torch.manual_seed(0)
    bert = transformers.BertModel(_bert_config())
    assert fastload.unused_parameters(bert, _ids()) == []  # pooler_output is in the sum
    unused = fastload.unused_parameters(
        bert, _ids(), loss_fn=lambda out: out.last_hidden_state.sum()
    )
    assert unused == ["pooler.dense.weight", "pooler.dense.bias"]


def test_keyword_example_inputs_are_passed_to_the_model() -> None:
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(_bert_config())
    ids = _ids()
    assert fastload.unused_parameters(model, input_ids=ids, labels=ids) == []


def test_existing_gradients_are_left_untouched() -> None:
    model = TwoHeads()
    marker = {n: torch.full_like(p, 7.0) for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = marker[name].clone()
    assert fastload.unused_parameters(model, torch.randn(2, 8)) == ["unused.weight", "unused.bias"]
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, marker[name]), name


def test_frozen_parameters_are_not_reported() -> None:
    model = TwoHeads()
    model.unused.requires_grad_(False)
    assert fastload.unused_parameters(model, torch.randn(2, 8)) == []


class BlocksWithSpare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_unused_parameters_are_found_with_gradient_checkpointing_on() -> None:
    model = BlocksWithSpare()
    fastload.gradient_checkpointing_enable(model)
    assert fastload.unused_parameters(model, torch.randn(2, 8)) == ["unused.weight", "unused.bias"]


class Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).detach()


def test_an_output_without_gradient_raises_request_error() -> None:
    with pytest.raises(fastload.RequestError, match="requires grad"):
        fastload.unused_parameters(Detached(), torch.randn(2, 4))


def test_a_loss_fn_returning_a_non_scalar_raises_request_error() -> None:
    with pytest.raises(fastload.RequestError, match="one-element tensor"):
        fastload.unused_parameters(nn.Linear(4, 4), torch.randn(2, 4), loss_fn=lambda out: out)
