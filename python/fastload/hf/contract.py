"""transformers' observable contract, for loads fastload serves under the patch.

What ``from_pretrained`` returns and says is transformers': ``output_loading_info`` gives its
``LoadStateDictInfo.to_dict()`` (sets where transformers has sets), the load report is logged on
``transformers.modeling_utils`` by transformers' own ``log_state_dict_report`` (its table, its
"Reinit due to size mismatch" lines, its ``RuntimeError`` when shapes differ without
``ignore_mismatched_sizes=True``), and a tied pair absent from the checkpoint gets its "This
checkpoint seem corrupted" warning. fastload's own logger may say more; it never says less.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from fastload.core.plan.report import LoadReport


def transformers_logger() -> logging.Logger:
    """The logger transformers' loading messages go to (``transformers.modeling_utils``)."""
    from transformers.modeling_utils import logger

    return logger  # type: ignore[no-any-return]


def loading_info(model: nn.Module, report: LoadReport) -> Any:
    """fastload's report as transformers' ``LoadStateDictInfo`` (sets of names and shapes)."""
    from transformers.utils.loading_report import LoadStateDictInfo

    # the report's own transformers-shaped dict, plus the fields newer transformers versions have
    values = {**report.to_dict(), "conversion_errors": {}, "skipped_pp_keys": set()}
    fields = getattr(LoadStateDictInfo, "__dataclass_fields__", values)
    return LoadStateDictInfo(**{k: v for k, v in values.items() if k in fields})


def warn_absent_ties(model: nn.Module, missing: set[str]) -> None:
    """transformers' warning for a tied pair neither of whose names the checkpoint holds."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    present_by_source: dict[str, bool] = {}
    for target, source in tied.items():
        present_by_source[source] = present_by_source.get(source, False) or target not in missing
    for target, source in tied.items():
        if source in missing and target in missing and not present_by_source.get(source):
            transformers_logger().warning(
                f"This checkpoint seem corrupted. The tied weights mapping for this model "
                f"specifies to tie {source} to {target}, but both are absent from the checkpoint, "
                "and we could not find another related tied weight for those keys"
            )


def finish_contract(
    model: nn.Module, name: Any, report: LoadReport, *, ignore_mismatched_sizes: bool
) -> dict[str, Any]:
    """Logs the load as transformers does and returns its ``output_loading_info`` dict; raises
    transformers' ``RuntimeError`` for shapes that differ without ``ignore_mismatched_sizes``
    (the load ran with them re-initialized, as transformers' does, to report everything)."""
    from transformers.utils.loading_report import log_state_dict_report

    info = loading_info(model, report)
    warn_absent_ties(model, info.missing_keys)
    log_state_dict_report(
        model=model,
        pretrained_model_name_or_path=str(name),
        ignore_mismatched_sizes=ignore_mismatched_sizes,
        loading_info=info,
        logger=transformers_logger(),
    )
    return info.to_dict()  # type: ignore[no-any-return]
