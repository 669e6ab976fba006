"""transformers' own loading tests, unpatched and under ``fastload.patch_transformers()``.

Runs ``tests/utils/test_modeling_utils.py`` and the loading tests of each chosen model family
(``-k`` :data:`LOADING`) twice, as transformers alone and with the patch (``FASTLOAD_PATCH=1``,
through the ``shim`` plugin beside the tests), and fails when a test that passes unpatched does
not pass patched. Prints collected / passed / failed / skipped for both runs of each part (the
comparison: scripts/patched_suite.py).

Usage (scripts/transformers-tests.sh prepares the tests and their venv, then calls this):
    python scripts/transformers_suite.py --tests DIR --shim DIR [--families a,b,...] [--out DIR]
"""

from __future__ import annotations

import sys

import patched_suite  # scripts/, beside this file

#: the families shared/transformers-tests ships, each its test file
FAMILIES = {
    f: f"tests/models/{f}/test_modeling_{f}.py"
    for f in (
        "mistral qwen2 qwen3 gemma gemma2 bart roberta distilbert mt5 umt5 olmoe qwen3_moe "
        "falcon phi gpt_neox"
    ).split()
}
#: the ``-k`` expression that selects a family's loading tests
LOADING = (
    "save or load or pretrained or tied or fp32 or mismatched or safetensors or from_pretrained "
    "or init"
)


def main(argv: list[str] | None = None) -> int:
    return patched_suite.main(
        argv,
        description=__doc__.splitlines()[0],
        families=FAMILIES,
        k=LOADING,
        name="transformers-tests",
        first=("tests/utils/test_modeling_utils.py",),
    )


if __name__ == "__main__":
    sys.exit(main())
