"""Tiny Llama checkpoints for the vLLM tests and benchmark: random weights, several safetensors
shards with an index, and a byte-level BPE tokenizer trained here (no model hub).

Run inside the vLLM environment (transformers and tokenizers come with vLLM)::

    python tests/support/vllm_models.py DIR [--hidden 512 --layers 2 --intermediate 4096 --vocab
    4096]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

_TEXT = (
    "The quick brown fox jumps over the lazy dog. fastload reads safetensors checkpoints in "
    "parallel. vLLM serves language models. Tensor parallel ranks read their own slices. "
    "Once upon a time there was a tiny llama that learned to count: one two three four five. "
)


def _corpus(words: int = 20000) -> list[str]:
    """The text above and pseudo-random words (seeded): enough distinct pairs to learn a few
    thousand merges."""
    import random

    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    made = [
        "".join(rng.choice(letters[: rng.randint(6, 26)]) for _ in range(rng.randint(2, 9)))
        for _ in range(words)
    ]
    return [_TEXT * 4] + [" ".join(made[i : i + 100]) for i in range(0, words, 100)]


def train_tokenizer(out: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer of ``vocab`` entries, saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def make_llama(
    out: str | os.PathLike[str],
    *,
    hidden: int = 512,
    layers: int = 2,
    intermediate: int = 4096,
    vocab: int = 4096,
    heads: int = 8,
    kv_heads: int = 4,
    shards: int = 3,
    tie: bool = False,
    seed: int = 0,
) -> Path:
    """Writes a random-weight bf16 Llama of these sizes to ``out`` in ``shards`` safetensors
    files (with ``model.safetensors.index.json``) and its tokenizer; returns ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    # wide enough weights that greedy decoding is not a tie between tokens
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    model = model.to(torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=max(1, total // shards + 1))
    train_tokenizer(out, vocab)
    # vLLM needs no generation config; make greedy decoding run to max_tokens
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return out


#: quantization methods :func:`quantize` writes, and the dtype vLLM runs each with on the CPU
QUANTIZED = {"w8a8-int8": "bfloat16", "gptq": "float16", "awq": "float16"}


def quantize(src: str | os.PathLike[str], out: str | os.PathLike[str], method: str) -> Path:
    """Writes ``src`` (a :func:`make_llama` checkpoint) to ``out`` as a pre-quantized checkpoint
    of ``method`` (:data:`QUANTIZED`), one safetensors file, with its ``quantization_config``:

    * ``w8a8-int8``: compressed-tensors' ``int-quantized`` format (W8A8: int8 weights with a
      scale per output channel, int8 activations quantized per token at run time), the decoder
      layers' linear weights quantized from ``src``'s values (round to nearest);
    * ``gptq`` / ``awq``: 4-bit weights packed into int32 (``qweight``, ``qzeros``), fp16
      ``scales`` per group of 128 inputs (and GPTQ's ``g_idx``), each in its method's layout.
      The packed words are random (seeded): what a loader is tested on is that every byte
      arrives where the method's layout puts it, which the tokens show, whatever the values.
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, out / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    gen = torch.Generator().manual_seed(0)
    group = 128
    float_dtype = getattr(torch, QUANTIZED[method])

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(
            torch.int32
        )

    def scales(*shape: int) -> torch.Tensor:
        return (torch.rand(shape, generator=gen) * 0.01 + 0.001).to(torch.float16)

    quantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
            quantized[name] = t.to(float_dtype) if t.is_floating_point() else t
            continue
        rows, cols = t.shape  # (outputs, inputs)
        base = name.removesuffix("weight")
        if method == "w8a8-int8":
            w = t.float()
            scale = w.abs().amax(dim=1, keepdim=True) / 127
            quantized[name] = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
            quantized[base + "weight_scale"] = scale.to(torch.bfloat16)
        elif method == "gptq":
            quantized[base + "qweight"] = words(cols // 8, rows)
            quantized[base + "qzeros"] = words(cols // group, rows // 8)
            quantized[base + "scales"] = scales(cols // group, rows)
            quantized[base + "g_idx"] = (torch.arange(cols) // group).to(torch.int32)
        else:  # awq
            quantized[base + "qweight"] = words(cols, rows // 8)
            quantized[base + "qzeros"] = words(cols // group, rows // 8)
            quantized[base + "scales"] = scales(cols // group, rows)
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = QUANTIZED[method]
    config["quantization_config"] = {
        "w8a8-int8": {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                "strategy": "channel", "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                          "strategy": "token", "dynamic": True},
                }
            },
        },
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                 "sym": True, "checkpoint_format": "gptq"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"},
    }[method]  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--shards", type=int, default=3)
    args = parser.parse_args()
    make_llama(
        args.out,
        hidden=args.hidden,
        layers=args.layers,
        intermediate=args.intermediate,
        vocab=args.vocab,
        heads=args.heads,
        kv_heads=args.kv_heads,
        shards=args.shards,
    )
    print(args.out)


if __name__ == "__main__":
    main()


def rewrite_header(path: str | os.PathLike[str], edit: object) -> None:
    """Rewrites the JSON header of safetensors file ``path`` with ``edit(header) -> header``,
    keeping the data section as it is (for the tests' malformed files)."""
    import struct

    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    new = json.dumps(edit(header)).encode()  # type: ignore[operator]
    new += b" " * (-len(new) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _rank_spans(
    shards: list[Path], ranks: int, names: set[str] | None = None
) -> list[list[tuple[int, int]]]:
    """The byte spans of ``shards`` (offsets counted over the shards one after the other) that
    each of ``ranks`` tensor-parallel ranks of a vLLM Llama takes: column-parallel weights (q/k/v,
    gate/up, the vocabulary's rows) split along their rows, row-parallel ones (o_proj, down_proj)
    along their columns, norms whole (``names``: of those tensors alone)."""
    spans: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    at = 0
    for shard in shards:
        raw = shard.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        for rank in range(ranks):
            for name, entry in header.items():
                if names is not None and name not in names:
                    continue
                begin, end = (at + 8 + n + o for o in entry["data_offsets"])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    rows, cols = entry["shape"]
                    row, part = (end - begin) // rows, (end - begin) // rows // ranks
                    spans[rank] += [
                        (begin + r * row + rank * part, begin + r * row + (rank + 1) * part)
                        for r in range(rows)
                    ]
                elif name.endswith("norm.weight"):
                    spans[rank].append((begin, end))
                else:
                    part = (end - begin) // ranks
                    spans[rank].append((begin + rank * part, begin + (rank + 1) * part))
        at += len(raw)
    return spans


def pages_needed(shards: list[Path], ranks: int) -> list[int]:
    """Bytes of the whole pages of ``shards`` that each of ``ranks`` tensor-parallel ranks of a
    vLLM Llama needs (:func:`_rank_spans`, each shard's pages apart)."""
    page = os.sysconf("SC_PAGE_SIZE")
    starts, at = [], 0
    for shard in shards:
        starts.append(at)
        at += shard.stat().st_size
    needed = []
    for spans in _rank_spans(shards, ranks):
        pages: set[tuple[int, int]] = set()
        for a, b in spans:
            i = max(k for k, s in enumerate(starts) if s <= a)  # the shard the span is in
            first, stop = (a - starts[i]) // page, -(-(b - starts[i]) // page)
            pages.update((i, q) for q in range(first, stop))
        needed.append(len(pages) * page)
    return needed


def bytes_needed(shards: list[Path], ranks: int, names: set[str] | None = None) -> list[int]:
    """The tensor bytes of ``shards`` that each of ``ranks`` tensor-parallel ranks of a vLLM Llama
    takes (:func:`_rank_spans`; ``names``: of those tensors alone): what a rank that fetches its
    slices alone asks a store for."""
    return [sum(b - a for a, b in spans) for spans in _rank_spans(shards, ranks, names)]
