"""PAFT-Sync's world-size-2 reference: the state both replicas last agreed on.

Two replicas that differ never form a majority, so robust mode at world size 2 breaks
the tie with a third opinion, the *reference*: per coordinate the median of the two
replicas and the reference (``"median-with-reference"``, see :mod:`paft.sync` and
:func:`paft.robust.median_of_three`). A :class:`SyncReference` holds it, name by name:
the state at the last completed sync (after a no-op, the state agreed at its start:
an overlapped step may move the replicas apart before it finishes) or at the last
state check that found the replicas equal (:meth:`paft.sync.ReplicaSync.set_reference`,
which the guard calls at every state check it passes).

The reference costs one copy of the state and is kept only for world size 2 in robust
mode. State that did not exist at the last agreement (optimizer state created later)
has reference 0, which keeps the smaller-magnitude value where the two replicas share
a sign, and 0 where they do not. Every sync's control exchange carries the
reference's :attr:`~SyncReference.tag`, equal on both ranks exactly when their
references are: if the tags disagree (a reference constructed while the replicas
differed, or loaded from different checkpoints) a zero reference is used and the
report says so.
"""

from __future__ import annotations

import torch
from torch import Tensor

from paft.fingerprint import fingerprint
from paft.flat import Group, Layout, copy_all_, transport_view

__all__ = ["SyncReference"]


class SyncReference:
    """Name -> tensor (in its transport dtype, on ``device``) of the last agreed state,
    and a tag equal on both ranks exactly when their references are.

    ``layout`` and ``flats``: the state to start from, packed (one flat per dtype group
    of ``layout``, ``None`` for an empty group); the tag is taken from its bytes."""

    def __init__(self, layout: Layout, flats: list[Tensor | None], device: torch.device) -> None:
        self._device = device
        self.tensors: dict[str, Tensor] = {}
        self.tag = 0
        self._replace(self._views(layout, flats))

    def _replace(self, tensors: dict[str, Tensor]) -> None:
        self.tensors = tensors
        # A fresh tag from the bytes: equal on both ranks iff they hold equal state.
        self.tag = fingerprint(list(tensors.values()))

    def _views(self, layout: Layout, flats: list[Tensor | None]) -> dict[str, Tensor]:
        """Name -> view into ``flats`` (zero copy)."""
        ref: dict[str, Tensor] = {}
        for g, flat in zip(layout.groups, flats):
            if flat is None:  # an empty dtype group
                flat = torch.empty(0, dtype=g.dtype, device=self._device)
            for s in g.slots:
                ref[s.name] = flat[s.offset : s.offset + s.numel].view(s.shape)
        return ref

    def keep(self, layout: Layout, flats: list[Tensor | None]) -> None:
        """Take ``flats`` (packed by ``layout``) as the reference of their tensors, merged
        by name: a part of the state (the buffers, or the rest) replaces only its own
        tensors' reference. The tag is left to the caller: both ranks move it alike
        (:meth:`after_sync`, :meth:`agreed_on`)."""
        self.tensors = {**self.tensors, **self._views(layout, flats)}

    def holds_all(self, named: list[tuple[str, Tensor]]) -> bool:
        """Whether the reference has a tensor of the same dtype and shape for each name."""
        ref = self.tensors
        return all(n in ref and ref[n].dtype == t.dtype and ref[n].shape == t.shape for n, t in named)

    def copy_in(self, named: list[tuple[str, Tensor]]) -> None:
        """Copy ``named`` into the reference's tensors in place (:meth:`holds_all` first)."""
        with torch.no_grad():
            copy_all_([self.tensors[n] for n, _ in named], [t for _, t in named])

    def flat(self, g: Group, use: bool) -> Tensor:
        """The reference of ``g``'s tensors as one flat; zeros where it holds none of the
        slot's dtype and shape, and everywhere unless ``use`` (the ranks' tags agree)."""
        flat = torch.zeros(g.numel, dtype=g.dtype, device=self._device)
        if use:
            for s in g.slots:
                r = self.tensors.get(s.name)
                if r is not None and r.dtype == g.dtype and tuple(r.shape) == s.shape:
                    flat[s.offset : s.offset + s.numel].copy_(r.reshape(-1))
        return flat

    def after_sync(self, syncs: int, fingerprints: list[list[int]]) -> None:
        """The tag after the ``syncs``-th sync, whose control exchange gathered every
        rank's ``fingerprints`` (state, buffers): the same on both ranks, from the same
        inputs."""
        tag = torch.tensor([syncs, *(x for r in fingerprints for x in r[:2])], dtype=torch.int64)
        self.tag = fingerprint([tag])

    def agreed_on(self, agreed: int) -> None:
        """The tag after the state every rank checked to be ``agreed`` was kept: equal on
        both ranks iff the references are (equal before, and the same state now)."""
        self.tag = fingerprint([torch.tensor([self.tag, agreed], dtype=torch.int64)])

    def state_dict(self) -> dict[str, Tensor]:
        """CPU copies of the reference's tensors, for a checkpoint."""
        return {k: v.detach().cpu().clone() for k, v in self.tensors.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict`'s tensors; the tag is taken from their bytes."""
        self._replace({k: transport_view(v).to(self._device).clone() for k, v in state.items()})
