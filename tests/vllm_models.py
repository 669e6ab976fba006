"""Tiny Llama checkpoints for the vLLM tests and benchmark: random weights, several safetensors
shards with an index, and a byte-level BPE tokenizer trained here (no model hub).

Run inside the vLLM environment (transformers and tokenizers come with vLLM)::

    python tests/vllm_models.py DIR [--hidden 512 --layers 2 --intermediate 4096 --vocab 4096]
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
