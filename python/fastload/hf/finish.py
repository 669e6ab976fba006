"""Leaving a loaded transformers model in the state transformers' ``from_pretrained`` leaves it.

Tensors flagged as initialized (so a later ``initialize_weights`` keeps them), the generation
config of the checkpoint directory (or the one the caller passed), the decision config of a
decision model (``XxxForDecision``: ``decide`` reads it as ``generate`` reads the generation
config), and ``hf_device_map`` when a
device map spread the model over more than one place or offloaded part of it to disk, as
transformers 5 sets it (only then does it dispatch the model with accelerate; pipelines read the
attribute's absence as "this model may be moved", ``generate`` and PEFT read its places).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from torch import nn

from fastload.core.devices.device_map import DeviceMap
from fastload.hf.initialize import mark_initialized

logger = logging.getLogger("fastload")


def finish_transformers(
    model: nn.Module,
    *,
    directory: Path | None,
    load_generation_config: bool,
    generation_config: Any = None,
    device_map: DeviceMap | None = None,
) -> None:
    mark_initialized(model)
    if device_map is not None:
        places = device_map.accelerate_map()
        if len(set(places.values())) > 1 or "disk" in places.values():
            model.hf_device_map = places
    if load_generation_config and directory is not None:
        _load_decision_config(model, directory)
    if generation_config is not None:
        model.generation_config = generation_config
        return
    if not load_generation_config or directory is None:
        return
    generation = directory / "generation_config.json"
    can_generate = getattr(model, "can_generate", None)
    if generation.is_file() and callable(can_generate) and can_generate():
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_pretrained(str(directory))
        except Exception as e:  # the weights are fine: keep the config's generation defaults
            logger.warning("%s: not used (%s: %s)", generation, type(e).__name__, e)


def _load_decision_config(model: nn.Module, directory: Path) -> None:
    """A decision model's ``decision_config`` from the checkpoint directory, as its
    ``from_pretrained`` reads it (the defaults where the directory has none)."""
    # a decision model's class imported transformers' decision modules: nothing is imported here
    # (a load of any other model pays no import)
    modeling = sys.modules.get("transformers.decision.modeling_utils")
    configuration = sys.modules.get("transformers.decision.configuration_utils")
    if modeling is None or configuration is None or not isinstance(model, modeling.DecisionMixin):
        return
    try:
        model.decision_config = configuration.DecisionConfig.from_pretrained(str(directory))
    except Exception as e:  # the weights are fine: keep the model's default decision config
        logger.warning("%s: decision config not used (%s: %s)", directory, type(e).__name__, e)
