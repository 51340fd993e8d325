"""The synchronous round's rules, owned in one place (no Spark here): a round of local SGD with a
periodic all-reduce (the RNN-on-Spark paper's iteration).

1. driver, :meth:`SyncRound.message` and :meth:`SyncRound.carries`: a :class:`RoundMessage` all
   partitions read, and a :class:`Carry` each (its hidden state, its own optimizer state);
2. executor, :func:`view` and :meth:`SyncRound.start`: the driver's parameters rebuilt bit for bit
   (the base executors keep plus rows, :mod:`rnnlm.exchange.rebase`), the optimizer state;
3. executor, :meth:`SyncRound.contribution` (or :meth:`SyncRound.failed`): its change, encoded by
   :func:`rnnlm.exchange.plan.encode`, as an aggregate leaf under :data:`PARAMS` and :data:`OPT`;
4. driver, :meth:`SyncRound.apply`: the mean change through the outer optimizer, the averaged
   optimizer state, the carries for the next round. A checkpoint's ``optim.npz`` keys are
   :class:`StateKeys`', written and read here only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from . import plan, rebase
from .aggregate import Aggregate

OPT = "opt."                # block name prefix of an averaged optimizer slot (``opt.m``, ``opt.v``)
PARAMS = plan.PARAMS        # of a parameter slot's change (``params.Wo``)


@dataclass(frozen=True)
class RoundMessage:
    """What every partition reads in a round (one broadcast)."""

    base: str                   # names the base executors keep (their view cache's key)
    rows: dict                  # slot -> (ids or None, values): the rows that differ from the base
    opt: dict | None            # the averaged optimizer state (``train.optim_state = "average"``)


@dataclass(frozen=True)
class Carry:
    """A partition's carry: what it alone takes from a round to the next through the driver (each
    its own broadcast; a task's closure names them all, so every executor fetches every partition's;
    under ``train.overlap`` it stays in Spark), or the error that stopped it. What it holds on its
    executor (:attr:`StateKeys.HELD`) is the rest of its carryover."""

    state: np.ndarray | None = None     # hidden state (L, S, H, B), for strategies that carry it
    opt: dict | None = None             # optimizer state (``train.optim_state = "local"``)
    error: str | None = None


class StateKeys:
    """``optim.npz`` key names of the round's state in a checkpoint (``"<slot>"`` alone is the
    averaged optimizer state's)."""

    LOCAL = "p{pid}/{slot}"     # a partition's own optimizer state
    VELOCITY = "outer.velocity"
    VIEW = "outer.view"         # the executors' parameters (``exchange.broadcast = "delta+..."``)
    # what a partition holds between rounds on its executor (:mod:`rnnlm.spark.lineage`), "<name>.p<pid>":
    HELD = ("feedback",         # error feedback's residual
            "eager")            # its last round's change (``train.eager``)

    @classmethod
    def is_slot(cls, key: str) -> bool:
        return "/" not in key and not key.startswith(("outer.",) + tuple(f"{n}." for n in cls.HELD))

    @classmethod
    def held(cls, key: str) -> tuple | None:
        """``(name, pid)`` of a key naming what a partition holds, else None."""
        name, _, rest = key.partition(".p")
        return (name, int(rest)) if name in cls.HELD and rest.isdigit() else None


class SyncRound:
    """The round's rules for one run: ``layout`` of the model, ``train`` section, ``partitions``."""

    def __init__(self, layout, train, partitions: int):
        self.layout, self.t, self.partitions = layout, train, partitions

    # ------------------------------------------------------------ driver
    def message(self, st, base: str, rows: dict) -> RoundMessage:
        """The next round's :class:`RoundMessage` (``st``: the driver's
        :class:`~rnnlm.spark.allreduce.SyncState`; ``base``, ``rows``: its broadcast's)."""
        return RoundMessage(base, rows, st.opt if self.t.optim_state == "average" else None)

    def carries(self, st) -> dict:
        """``{pid: Carry}``: what each partition takes into the next round."""
        carries = {pid: Carry(state=s) for pid, s in st.states.items()}
        if self.t.optim_state == "local":
            for pid, o in st.opt_local.items():
                carries[pid] = dataclasses.replace(carries.get(pid, Carry()), opt=o)
        return carries

    def apply(self, st, agg: Aggregate) -> None:
        """Move ``st`` (params, outer velocity, optimizer state, carries) on by the merged ``agg``."""
        t, dtype = self.t, st.params.dtype      # the configured model.dtype, end to end
        scored = agg.weight > 0                 # else no partition scored a token (a sample of empty lines)
        # partitions send changes, not weights; a round that scored nothing has no mean: a change of 0 (an outer
        # momentum still moves the weights by its decaying velocity, as after any round)
        delta = plan.mean_change(self.layout, agg, dtype) if scored else np.zeros_like(st.params)
        if t.outer == "average":
            st.params = st.params + delta
        else:
            if st.velocity is None:
                st.velocity = np.zeros_like(delta)
            st.velocity *= t.outer_momentum
            st.velocity += delta
            step = delta + t.outer_momentum * st.velocity if t.outer == "nesterov" else st.velocity
            st.params = (st.params + t.outer_lr * step).astype(dtype)
        if t.optim_state == "average" and scored:
            slots = {k[len(OPT):]: agg.mean(k, dtype) for k in agg.dense if k.startswith(OPT)}
            prev = st.opt["t"] if st.opt else 0
            # every partition ran the same steps, except sampled strategies (one pass of each sample)
            st.opt = dict(slots, t=prev + round(agg.stats["steps"] / self.partitions)) if slots else None
        elif t.optim_state == "local":
            st.opt_local = {pid: c.opt for pid, c in agg.local.items() if c.opt is not None}
        st.states = {pid: c.state for pid, c in agg.local.items() if c.state is not None}

    # ---------------------------------------------------------- executor
    def start(self, msg: RoundMessage, carry: Carry, optimizer, params, to_device) -> dict:
        """A partition's optimizer state at the round's start: its own, the average, or fresh."""
        if self.t.optim_state == "local" and carry.opt is not None:
            return _on(to_device, carry.opt)
        if self.t.optim_state == "average" and msg.opt is not None:
            return _on(to_device, msg.opt)
        return optimizer.init_state(params)

    def contribution(self, pid: int, res, blocks: dict, block_stats: dict, carries_state: bool, words,
                     compute_s: float, to_host) -> Aggregate:
        """Partition ``pid``'s result: ``res`` (:class:`rnnlm.core.local.LocalResult`), its change as
        :func:`rnnlm.exchange.plan.encode`'s ``blocks`` and statistics; ``to_host`` copies a device
        array to NumPy."""
        opt = {k: (to_host(v) if k != "t" else v) for k, v in res.opt_state.items()}
        carry = Carry(state=to_host(res.state) if carries_state else None,
                      opt=opt if self.t.optim_state == "local" else None)
        if self.t.optim_state == "average":         # beside the change, uncoded: counted in optim_bytes
            slots = {OPT + k: v for k, v in opt.items() if k != "t"}
            blocks = dict(blocks, **slots)
            block_stats = dict(block_stats, optim_bytes=sum(int(v.nbytes) for v in slots.values()))
        return Aggregate.contribution(res.tokens, blocks, {pid: carry}, words=words, tokens=res.tokens,
                                      loss_sum=res.loss_sum, steps=res.steps, compute_s=compute_s, **block_stats)

    @staticmethod
    def failed(pid: int, error: str) -> Aggregate:
        """A partition that cannot train: no blocks, its error (merges anywhere in the tree)."""
        return Aggregate.contribution(0.0, {}, {pid: Carry(error=error)})

    # -------------------------------------------------------- checkpoint
    @staticmethod
    def to_optim(st, view, held: dict | None) -> tuple:
        """``(optim.npz entries, optimizer step count, {pid: its own optimizer's step count})`` for a
        checkpoint of ``st``; ``held``: pid -> what the partition holds between rounds, by
        :attr:`StateKeys.HELD` name."""
        optim = {}
        if st.opt:
            optim.update({k: v for k, v in st.opt.items() if k != "t"})
        for pid, d in st.opt_local.items():
            optim.update({StateKeys.LOCAL.format(pid=pid, slot=k): v for k, v in d.items() if k != "t"})
        if st.velocity is not None:
            optim[StateKeys.VELOCITY] = st.velocity
        if view is not None:
            optim[StateKeys.VIEW] = view
        for pid, arrays in (held or {}).items():
            optim.update({f"{name}.p{pid}": np.asarray(a) for name, a in arrays.items()})
        t = (st.opt or next(iter(st.opt_local.values()), {})).get("t", 0)
        # each partition's own count: partitions train different numbers of steps (one pass each, a sample)
        return optim, t, {pid: d["t"] for pid, d in st.opt_local.items() if "t" in d}

    @staticmethod
    def foreign(keys, slots: tuple, partitions: int) -> str | None:
        """The first of a checkpoint's ``optim.npz`` ``keys`` that no run of ``partitions`` partitions
        whose optimizer has ``slots`` writes (:meth:`to_optim`), or None."""
        for k in sorted(keys):
            pid, _, slot = k.partition("/")
            held = StateKeys.held(k)
            if not (k in (StateKeys.VELOCITY, StateKeys.VIEW) or k in slots
                    or (slot in slots and pid[:1] == "p" and pid[1:].isdigit() and int(pid[1:]) < partitions)
                    or (held is not None and held[1] < partitions)):
                return k
        return None

    @staticmethod
    def from_optim(optim: dict, t: int, t_local: dict) -> dict:
        """What a checkpoint's ``optim.npz`` and step counts (:meth:`to_optim`) restore: the
        :class:`~rnnlm.spark.allreduce.SyncState` fields ``opt``, ``opt_local``, ``velocity`` and
        ``held``, and ``view``, the stored ``outer.view`` (:meth:`~rnnlm.spark.allreduce.SyncState.resumed`
        says whose it is)."""
        slots = {k: v for k, v in optim.items() if StateKeys.is_slot(k)}
        opt_local: dict = {}
        for k, v in optim.items():
            if "/" in k:
                pid, slot = k[1:].split("/", 1)
                opt_local.setdefault(int(pid), {"t": t_local.get(int(pid), t)})[slot] = v
        held: dict = {}
        for k, v in optim.items():
            if (named := StateKeys.held(k)) is not None:
                held.setdefault(named[1], {})[named[0]] = v
        return {"opt": dict(slots, t=t) if slots else None, "opt_local": opt_local,
                "velocity": optim.get(StateKeys.VELOCITY), "view": optim.get(StateKeys.VIEW), "held": held}


def view(layout, base, msg: RoundMessage, deltas, cache) -> np.ndarray:
    """The driver's parameters on an executor: ``base`` + ``msg.rows``, + the ``deltas``
    (:class:`rnnlm.spark.broadcasts.DeltaBroadcast`) in order.

    ``base`` and ``deltas`` are handles whose ``.value`` is read only when needed (Spark
    broadcasts: a read may fetch). ``cache`` (the executor's memo: ``pop``, ``put``) keeps the
    sum so far per base, so a round adds only its new delta (a from-scratch sum in the same
    order is the same bits).
    """
    key = ("view", msg.base)
    done, out = cache.pop(key, (None, None))
    if done is None or done > len(deltas):
        done, out = 0, rebase.rebuild(layout, base.value, msg.rows)
    for d in deltas[done:]:
        rebase.apply_delta(layout, out, d.value)
    if deltas:
        cache.put(key, (len(deltas), out))
    return out


def _on(to_device, state: dict) -> dict:
    return {k: (to_device(v) if k != "t" else v) for k, v in state.items()}
