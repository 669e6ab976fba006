"""Reloading a loaded model in place (``fastload.reload``): the record a load leaves beside the
model, the reload itself (checks, then writes into the existing storage), its reads, the guard that
never leaves a model torn silently, ties, verification against digests, and reloads across ranks.

Sits above the core it uses, beside ``distributed`` and ``training``: the core runs the record as a
step the entry of a load passes in (:attr:`fastload.core.plan.steps.LoadSteps.record`) and never
imports this package. Model ids are resolved by the resolver the load's entry recorded, so this
package names no hub.
"""
