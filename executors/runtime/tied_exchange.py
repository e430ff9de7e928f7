"""Gradients of parameters held by several parts (tied weights): sent to their co-owners and summed in plan part order,
under ``plan.tied_codec`` when one is set (:mod:`.dp.tied`), else dense or, when mostly exact zeros (an embedding's),
as their nonzero elements (:mod:`.exact_zeros`: the same bits)."""
from __future__ import annotations


import numpy as np

from fusion.executors.runtime.compression import sum_in_order
from fusion.executors.runtime.exact_zeros import pack
from fusion.ir.opdata import OpData
from fusion.ir.wire import encode_opdata


class TiedExchange:
    """A part of :class:`~.compnode.CompNode` (mixed in): gradients of parameters held by several parts (tied weights):
    sent to their co-owners and summed in plan part order, under ``plan.tied_codec`` when one is set
    (:mod:`.dp.tied`)."""

    def _decode_tied(self, od: OpData) -> np.ndarray:
        """A co-owner's tied gradient under ``plan.tied_codec``, decoded on arrival (WireError: rejected)."""
        spec = self.graph.params[od.name]
        return self.tied.decode(od.payload, tuple(spec.shape), spec.dtype, f"gradient of parameter {od.name!r} from {od.src}")

    def _sync_send(self, it: int) -> dict[str, np.ndarray | None]:
        """Send this part's gradients of parameters held by several parts to their co-owners; returns its own
        (as the co-owners will decode it, under ``plan.tied_codec``) for :meth:`_sync_wait`.

        With ``plan.tied_codec`` each owner sends its gradient encoded once and sums the decoded gradients of
        every owner, its own included (:class:`~.compression.TiedCodec`), so all owners still apply one sum."""
        if not self.spec.shared:
            return {}
        mine = self.runtime.engine.grads()
        users = self.graph.param_users()
        own: dict[str, np.ndarray | None] = {}
        for name, owners in sorted(self.spec.shared.items()):
            local = tuple(n for n in users.get(name, ()) if n in self.spec.sub.nodes)
            payload = mine.get(name)
            own[name] = payload
            if self.tied is not None and payload is not None:
                spec = self.graph.params[name]
                payload = self.tied.encode(np.asarray(payload), spec.dtype, name, self.me, it)
                own[name] = self.tied.decode(payload, tuple(spec.shape), spec.dtype, f"own gradient of {name!r}")
            elif payload is not None:  # dense: an embedding's gradient (mostly exact zeros) goes as its nonzero elements
                payload = pack(np.asarray(payload), self.graph.params[name].dtype)
            for o in owners:
                if o != self.me:
                    od = OpData(name=name, index=None, op_users=tuple(users.get(name, ())), actual_user=local, is_grad=True,
                                local_iter=it, micro_batch=-1, src=self.me, dst=o, payload=payload)
                    self.transport.send(o, encode_opdata(od, kind="pgrad"), label=f"grad {name}")
        return own

    def _sync_wait(self, it: int, own: dict[str, np.ndarray | None]) -> None:
        """Sum the tied gradients of every owner in plan part order (the same bits on every owner)."""
        if not self.spec.shared:
            return
        got_all, _ = self._wait(lambda: self.inbox.param_grads(it), "tied-parameter gradients", self.cfg.data_timeout_s)
        for name, owners in self.spec.shared.items():
            got = got_all[name]
            gs = [own[name] if o == self.me else got[o] for o in owners]
            gs = [np.asarray(g) for g in gs if g is not None]
            if gs:
                self.runtime.engine.set_grad(name, sum_in_order(gs), owned=True)  # a fresh sum: kept, not copied
