"""Which files of a checkpoint prefix in object storage ``fastload fetch`` copies: the side files
a model needs besides its weights, and never a weight file. A module of its own, without torch,
so the command line can name them in ``--help`` without importing the loader."""

from __future__ import annotations

#: fetched by default: configs, tokenizers, chat templates, remote code
DEFAULT_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py")

#: never fetched, whatever the patterns asked for (matched in any letter case): every weight
#: format, of any framework
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.gguf",
    "*.ggml",
    "*.h5",
    "*.hdf5",
    "*.keras",
    "*.msgpack",
    "*.onnx",
    "*.onnx_data",
    "*.npz",
    "*.npy",
    "*.pkl",
    "*.pickle",
    "*.joblib",
    "*.tflite",
    "*.pb",
    "*.ot",
    "*.nemo",
)

__all__ = ["DEFAULT_PATTERNS", "WEIGHT_PATTERNS"]
