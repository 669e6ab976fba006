"""Gradient checkpointing toggles: transformers models and plain nn.Module blocks."""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import make_config
from torch import nn
from torch.profiler import ProfilerActivity, profile

import fastload
from fastload.training.gradient_checkpointing import is_gradient_checkpointing

transformers = pytest.importorskip("transformers")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.down(self.act(self.up(x)))


class Stack(nn.Module):
    """Repeated blocks in an nn.ModuleList, the layout checkpointing detects on its own."""

    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, scale=0.5)  # a keyword argument must pass through the wrapper
        return self.head(h)


class SequentialStack(nn.Module):
    """The same blocks in an nn.Sequential: only checkpointed when the caller names the class."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(width), Block(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _stack(seed: int = 0, **kwargs: int) -> Stack:
    torch.manual_seed(seed)
    return Stack(**kwargs)


def _bert(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = make_config(
        "bert", vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    return transformers.BertForMaskedLM(config).train()


def _bert_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 12), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _stack_input() -> torch.Tensor:
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(1))


def _grads(
    model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor]
) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_of(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _stack_loss(model: nn.Module) -> torch.Tensor:
    return model(_stack_input()).pow(2).sum()


def _bert_loss(model: nn.Module) -> torch.Tensor:
    return model(**_bert_batch()).loss


def _count_calls(module: nn.Module) -> list[int]:
    """A counter of ``module``'s forward calls (a recomputed block calls its sublayers again)."""
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    module.register_forward_pre_hook(hook)
    return calls


def _assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)


def test_checkpointing_a_plain_module_recomputes_its_blocks_in_backward() -> None:
    model = _stack()
    calls = _count_calls(model.blocks[0].up)
    fastload.gradient_checkpointing_enable(model)
    _stack_loss(model).backward()
    assert calls[0] == 2
    assert is_gradient_checkpointing(model)


def test_plain_module_gradients_are_the_same_with_checkpointing_on_and_off() -> None:
    model = _stack()
    off = _grads(model, _stack_loss)
    fastload.gradient_checkpointing_enable(model)
    on = _grads(model, _stack_loss)
    _assert_same_grads(on, off)


def test_reentrant_checkpointing_gives_the_same_gradients() -> None:
    model = _stack()
    off = _grads(model, _stack_loss)
    fastload.gradient_checkpointing_enable(model, use_reentrant=True)
    calls = _count_calls(model.blocks[1].up)
    on = _grads(model, _stack_loss)
    assert calls[0] == 2
    _assert_same_grads(on, off)


def test_transformers_model_gradients_are_the_same_with_checkpointing_on_and_off() -> None:
    model = _bert()
    off = _grads(model, _bert_loss)
    fastload.gradient_checkpointing_enable(model)
    on = _grads(model, _bert_loss)
    _assert_same_grads(on, off)


def test_transformers_model_is_checkpointed_by_its_own_mechanism() -> None:
    model = _bert()
    calls = _count_calls(model.bert.encoder.layer[0].intermediate.dense)
    fastload.gradient_checkpointing_enable(model)
    _bert_loss(model).backward()
    assert calls[0] == 2
    assert model.is_activation_checkpointing
    assert all("forward" not in m.__dict__ for m in model.modules())  # no fastload wrapper


def test_disabling_restores_the_original_forward_and_behavior() -> None:
    model = _stack()
    before = _grads(model, _stack_loss)
    fastload.gradient_checkpointing_enable(model)
    fastload.gradient_checkpointing_disable(model)
    calls = _count_calls(model.blocks[0].up)
    after = _grads(model, _stack_loss)
    assert calls[0] == 1
    assert not is_gradient_checkpointing(model)
    assert all(set(m.__dict__) == set(Block(4).__dict__) for m in model.blocks)
    _assert_same_grads(after, before)


def test_disabling_a_transformers_model_removes_its_checkpointing_and_input_grad_hooks() -> None:
    model = _bert()
    fastload.gradient_checkpointing_enable(model)
    fastload.gradient_checkpointing_disable(model)
    calls = _count_calls(model.bert.encoder.layer[0].intermediate.dense)
    _bert_loss(model).backward()
    assert calls[0] == 1
    assert not model.is_activation_checkpointing
    assert not getattr(model, "_require_grads_hooks", None)


def test_enabling_twice_wraps_once_and_disabling_twice_is_harmless() -> None:
    model = _stack()
    fastload.gradient_checkpointing_enable(model)
    fastload.gradient_checkpointing_enable(model)
    calls = _count_calls(model.blocks[0].up)
    _stack_loss(model).backward()
    assert calls[0] == 2  # one recompute, not a checkpoint inside a checkpoint
    fastload.gradient_checkpointing_disable(model)
    fastload.gradient_checkpointing_disable(model)
    assert "forward" not in model.blocks[0].__dict__


def test_enabling_a_transformers_model_twice_registers_its_input_grad_hook_once() -> None:
    model = _bert()
    fastload.gradient_checkpointing_enable(model)
    fastload.gradient_checkpointing_enable(model)
    embeddings = model.get_input_embeddings()
    assert len(embeddings._forward_hooks) == 1


def test_wrapped_blocks_do_not_recompute_in_eval_mode() -> None:
    model = _stack().eval()
    fastload.gradient_checkpointing_enable(model)
    calls = _count_calls(model.blocks[0].up)
    _stack_loss(model).backward()
    assert calls[0] == 1


def test_a_deep_copy_of_a_checkpointed_model_checkpoints_its_own_blocks() -> None:
    model = _stack()
    fastload.gradient_checkpointing_enable(model)
    clone = copy.deepcopy(model)
    original_calls = _count_calls(model.blocks[0].up)
    clone_calls = _count_calls(clone.blocks[0].up)
    _stack_loss(clone).backward()
    assert (clone_calls[0], original_calls[0]) == (2, 0)


def test_a_pickled_checkpointed_model_checkpoints_its_own_blocks_after_loading() -> None:
    model = _stack()
    fastload.gradient_checkpointing_enable(model)
    restored = pickle.loads(pickle.dumps(model))
    calls = _count_calls(restored.blocks[0].up)
    _grads(restored, _stack_loss)
    assert calls[0] == 2
    _assert_same_grads(_grads(restored, _stack_loss), _grads(model, _stack_loss))


def test_modules_argument_checkpoints_the_named_block_classes() -> None:
    torch.manual_seed(0)
    model = SequentialStack()
    fastload.gradient_checkpointing_enable(model, modules=[Block])
    calls = _count_calls(model.blocks[1].up)
    model(_stack_input()).sum().backward()
    assert calls[0] == 2


def test_modules_argument_accepts_class_names() -> None:
    torch.manual_seed(0)
    model = SequentialStack()
    fastload.gradient_checkpointing_enable(model, modules="Block")
    assert all("forward" in block.__dict__ for block in model.blocks)


def test_a_model_without_repeated_blocks_raises_unsupported_error_naming_its_class() -> None:
    model = SequentialStack()
    with pytest.raises(fastload.UnsupportedError, match="SequentialStack"):
        fastload.gradient_checkpointing_enable(model)


def test_a_module_list_of_mixed_classes_is_not_a_repeated_block() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])
    with pytest.raises(fastload.FastloadError, match="Module has nothing to checkpoint"):
        fastload.gradient_checkpointing_enable(model)


def test_naming_a_class_the_model_does_not_contain_raises_unsupported_error() -> None:
    with pytest.raises(fastload.UnsupportedError, match="Stack.*GRU"):
        fastload.gradient_checkpointing_enable(_stack(), modules=[nn.GRU])


def test_a_transformers_model_without_checkpointing_support_raises_unsupported_error() -> None:
    class NoCheckpointingBert(transformers.BertModel):
        supports_gradient_checkpointing = False

    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    with pytest.raises(fastload.UnsupportedError, match="NoCheckpointingBert"):
        fastload.gradient_checkpointing_enable(NoCheckpointingBert(config))


def _peak_cpu_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Peak of the bytes the CPU allocator holds beyond the start, over one forward+backward,
    from torch.profiler's per-op memory records replayed in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x).pow(2).sum().backward()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def test_checkpointing_lowers_peak_activation_memory_of_a_12_block_model() -> None:
    model = _stack(width=64, depth=12)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    model(x).pow(2).sum().backward()  # warm-up: gradient buffers exist in both measured runs
    off = _peak_cpu_bytes(model, x)
    fastload.gradient_checkpointing_enable(model)
    on = _peak_cpu_bytes(model, x)
    print(f"activation peak: off {off} B, on {on} B, on/off {on / off:.3f}")
    # Without checkpointing every block keeps ~9 activations of 256x64 floats; with it, only the
    # 12 block inputs and one block's recompute are alive at once.
    assert on < 0.5 * off


@pytest.fixture
def legacy_config_checkpoint(tmp_path: Path) -> Path:
    """A BERT checkpoint whose config.json still carries ``"gradient_checkpointing": true``
    (that the key alone leaves checkpointing off is tested with from_pretrained's own tests)."""
    model = _bert()
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config["gradient_checkpointing"] = True
    config_file.write_text(json.dumps(config))
    return tmp_path


def test_from_pretrained_with_gradient_checkpointing_enables_it_and_leaves_train_mode(
    legacy_config_checkpoint: Path,
) -> None:
    model = fastload.from_pretrained(
        transformers.BertForMaskedLM, legacy_config_checkpoint, gradient_checkpointing=True
    )
    calls = _count_calls(model.bert.encoder.layer[0].intermediate.dense)
    _bert_loss(model).backward()
    assert model.training
    assert calls[0] == 2
