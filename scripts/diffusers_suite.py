"""diffusers' own loading tests, unpatched and under ``fastload.patch_diffusers()``.

Runs the loading tests (``-k`` :data:`LOADING`) of each chosen family of
``../shared/diffusers-tests`` (diffusers' ``tests/`` at v0.40.0) twice, as diffusers alone and
with the patch (``FASTLOAD_PATCH=1``, through the ``shim`` plugin beside the tests), and fails
when a test that passes unpatched does not pass patched. Prints collected / passed / failed /
skipped for both runs of each family, and how many loads the patch served (the comparison:
scripts/patched_suite.py).

Usage (scripts/diffusers-tests.sh prepares the tests and their venv, then calls this):
    python scripts/diffusers_suite.py --tests DIR --shim DIR [--families a,b,...] [--out DIR]
"""

from __future__ import annotations

import sys

import patched_suite  # scripts/, beside this file

#: the families the shared README names: a test file or folder under the unpacked tree
FAMILIES = {
    "unet_2d": "tests/models/unets/test_models_unet_2d.py",
    "unet_2d_condition": "tests/models/unets/test_models_unet_2d_condition.py",
    "autoencoder_kl": "tests/models/autoencoders/test_models_autoencoder_kl.py",
    "flux": "tests/models/transformers/test_models_transformer_flux.py",
    "sd3": "tests/models/transformers/test_models_transformer_sd3.py",
    "qwenimage": "tests/models/transformers/test_models_transformer_qwenimage.py",
    "controlnets": "tests/models/controlnets",
    "ddim": "tests/pipelines/ddim",
    "ddpm": "tests/pipelines/ddpm",
}
#: the ``-k`` expression that selects a family's loading tests
LOADING = "save or load or pretrained or variant or shard or dtype"


def main(argv: list[str] | None = None) -> int:
    return patched_suite.main(
        argv,
        description=__doc__.splitlines()[0],
        families=FAMILIES,
        k=LOADING,
        name="diffusers-tests",
    )


if __name__ == "__main__":
    sys.exit(main())
