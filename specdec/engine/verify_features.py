"""A verify's features: the rows of each request's committed tokens (the root and its accepted drafts, or a plain
step's) in the layers its draft reads, gathered on the device after the verdict, or read on the host from rows
staged beside the logits (`specdec.engine.host_features`). A mixin of `TargetEngine`: it reads the engine's
`requests`, `cfg`, `device` and `_stager`."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from specdec.engine.host_features import FeatureStager, StagedRows
from specdec.host_copy import host_tensor, to_device

if TYPE_CHECKING:
    from specdec.engine.requests import VerifyInput
    from specdec.engine.target_engine import TargetRequest


def one_layer_set(reqs: list) -> bool:
    """Whether every request wants features and all read the same layers: the batch's features are one copy."""
    return all(r.features for r in reqs) and len({r.feature_layers for r in reqs}) == 1


def _starts(rows: list[int]) -> list[int]:
    """The first row of each request's part of a batch whose requests have `rows` rows each."""
    return [0, *itertools.accumulate(rows)][:-1]


class VerifyFeatures:
    def _stage_features(self, inputs: list[VerifyInput], hidden, aux: dict) -> StagedRows | None:
        """Every row's features on their way to the host, for a batch whose requests all read the same layers
        (else None, as when the stager declines: gathered on the device after the verdict)."""
        reqs = [self.requests[inp.request_id] for inp in inputs]
        if not one_layer_set(reqs):
            return None
        if self._stager is None:
            self._stager = FeatureStager(self.device)
        layers = reqs[0].feature_layers
        return self._stager.stage([aux[i] for i in layers] if layers else [hidden])

    def _batch_features(self, inputs, rows: list[int], committed: list[list[int]], hidden, aux,
                        staged: StagedRows | None = None) -> list:
        """Each request's features at its committed rows: one gather when the batch shares its feature layers
        (None for requests admitted without features: no gather at all when none wants them); read on the host
        from `staged` rows when given."""
        reqs = [self.requests[inp.request_id] for inp in inputs]
        if staged is not None:
            return self._rows_of(rows, committed, staged.host().__getitem__)
        if not all(r.features for r in reqs):
            if not any(r.features for r in reqs):
                return [None] * len(inputs)
            feats = self._batch_features_of(reqs, rows, committed, hidden, aux)
            return [f if r.features else None for r, f in zip(reqs, feats, strict=True)]
        return self._batch_features_of(reqs, rows, committed, hidden, aux)

    def _batch_features_of(self, reqs: list[TargetRequest], rows: list[int], committed: list[list[int]], hidden,
                           aux) -> list:
        if len({r.feature_layers for r in reqs}) > 1:
            return [self._features(r, hidden, aux, s + torch.tensor(c))
                    for r, s, c in zip(reqs, _starts(rows), committed, strict=True)]
        return self._rows_of(rows, committed, lambda at: self._features(reqs[0], hidden, aux, at))

    @staticmethod
    def _rows_of(rows: list[int], committed: list[list[int]], read) -> list:
        """Each request's committed rows of the batch's features, one `read(rows)` for all. The first row to the
        last with no gap (a chain at batch 1, a plain step) is one slice, read without an index tensor."""
        flat = [s + r for s, c in zip(_starts(rows), committed, strict=True) for r in c]
        whole = flat[-1] - flat[0] == len(flat) - 1 and flat == list(range(flat[0], flat[-1] + 1))
        at = slice(flat[0], flat[-1] + 1) if whole else host_tensor(flat)
        return list(read(at).split([len(c) for c in committed]))

    def _aux_layers(self, inputs) -> tuple[int, ...]:
        """The layers whose outputs the batch's features read, sorted (the forward returns them concatenated)."""
        return tuple(sorted({i for inp in inputs for i in self.requests[inp.request_id].feature_layers}))

    def _split_aux(self, aux_cat, layers: tuple[int, ...]) -> dict:
        h = self.cfg.hidden_size
        return {layer: aux_cat[:, j * h : (j + 1) * h] for j, layer in enumerate(layers)} if layers else {}

    @staticmethod
    def _features(req: TargetRequest, hidden, aux: dict, rows: torch.Tensor | slice) -> torch.Tensor:
        """The feature the request's draft consumes, at `rows` of the batch (indices, or a slice: copied, never a
        view, since `hidden` may be a captured graph's output, which the next replay overwrites).
        # [len(rows), feature_size]"""
        copied = not isinstance(rows, slice)  # an index reads into new memory; a slice is a view
        if copied:
            rows = to_device(rows, hidden.device)
        parts = [hidden[rows]] if not req.feature_layers else [aux[i][rows] for i in req.feature_layers]
        return parts[0] if copied and len(parts) == 1 else torch.cat(parts, dim=-1)
