"""The drafters moetrace knows, in one table: the speculative method a trace names (the manifest's ``spec.method``),
whether it runs a model forward per draft (its time then grows with k), whether ``moetrace record --method`` runs it,
and whether it drafts from a checkpoint of its own (``--drafter``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Drafter:
    method: str
    runs_a_model: bool  # a forward per draft (MTP, EAGLE, a draft model), against n-gram's lookup
    recordable: bool  # ``moetrace record --method`` runs it
    own_checkpoint: bool  # it drafts from a checkpoint of its own (``--drafter``), not the target's layers


DRAFTERS = {drafter.method: drafter for drafter in (
    Drafter("ngram", runs_a_model=False, recordable=True, own_checkpoint=False),
    Drafter("eagle3", runs_a_model=True, recordable=True, own_checkpoint=True),
    Drafter("mtp", runs_a_model=True, recordable=True, own_checkpoint=False),
    Drafter("draft_model", runs_a_model=True, recordable=True, own_checkpoint=True),
    Drafter("eagle", runs_a_model=True, recordable=False, own_checkpoint=True),  # named by traces other tools wrote
)}
MODEL_DRAFTERS = tuple(method for method, drafter in DRAFTERS.items() if drafter.runs_a_model)
RECORDABLE_METHODS = tuple(method for method, drafter in DRAFTERS.items() if drafter.recordable)
CHECKPOINT_METHODS = tuple(method for method, drafter in DRAFTERS.items()
                           if drafter.recordable and drafter.own_checkpoint)
