"""Adapter records for tests that register or route adapters without training one."""

from __future__ import annotations

from typing import Any

from appliance.adapters import AdapterMetrics


def metrics(**fields: Any) -> AdapterMetrics:
    """A trained version's metrics: a held-out loss 1.5 -> 1.2 unless `fields` say otherwise."""
    return AdapterMetrics.model_validate({"base_eval_loss": 1.5, "adapter_eval_loss": 1.2, "improvement": 0.2,
                                          "steps": 4, "train_tokens": 512, "seconds": 1.0, **fields})
