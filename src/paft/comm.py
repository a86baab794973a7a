"""The DDP communication-hook chain: inject, capture, all-reduce, inject, capture.

paft never replaces DDP's reducer; it registers one hook through the public
``DistributedDataParallel.register_comm_hook``. Per gradient bucket the chain is:

1. ``local-grad`` fault injection (compute SDC on this rank's own gradient; tests only);
2. capture of the *local* gradient (on the steps that ask, see
   :meth:`CommHookState.begin`): squared norm, non-finite flag, a k-dim CountSketch
   for the inter-worker cosine (or a full copy in ``exact`` mode);
3. the all-reduce (the user's own hook if one is given, else exactly the mean
   all-reduce of DDP's built-in reducer: scale by 1/world_size, then sum);
4. ``aggregation`` fault injection into the *result*, on the selected rank only
   (network / reduction SDC: ranks now hold different "aggregated" gradients);
5. capture of the *aggregated* gradient: its exact 64-bit digest
   (:func:`paft.fingerprint.digest_tensor`, position-sensitive), so the step's
   control collective can tell whether ranks hold the same result (where DDP may
   leave parameters unused, a copy with the slots that reached no gradient zeroed is
   digested instead, after the backward pass: :meth:`BucketCapture.leave_out_unreached`). (Its norm
   and non-finite flag come from the protector's one ``get_total_norm`` over the
   gradients, which gradient clipping needs anyway: no second pass here.)

Injection comes before the capture (unlike the first design sketch) so the
diagnostics and the guard see what the hardware actually produced.

Everything captured accumulates in :class:`BucketCapture` on the gradients' own
device, read once per step by the protector's control collective. Nothing in the
hook reads a value back to the host: on a GPU, a host read per bucket would drain
the launch queue each time and leave the GPU idle while the rest of the backward
pass is launched again (measured on an H200: +11% per step for an 85 M-parameter
GPT, from about 40 such reads). With no faults configured and no capture requested,
the fault-free path is bit-for-bit DDP's default all-reduce (one exception, which
no hook can tell apart, in :meth:`CommHookState.allreduce`).
"""

# No `from __future__ import annotations` here: DDP inspects the hook's real
# annotations (bucket: dist.GradBucket) when it is registered.
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from paft.faults import FaultInjector, FaultRecord
from paft.fingerprint import digest_tensor
from paft.norms import squared_norm
from paft.sketch import CountSketch

__all__ = ["BucketCapture", "CommHookState", "paft_comm_hook", "registered_comm_hooks", "CommHook"]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
GradWatch = tuple[torch.Tensor, torch.Tensor | None, int]
"""A bucket's parameter, its gradient when the hook saw the bucket, and that gradient's
version (0 without one)."""


@dataclass
class BucketCapture:
    """What the hook saw during one attempt of one step, summed over buckets.

    The sums live on the gradients' device (allocated by the first bucket) until
    :meth:`totals` reads them all in one transfer.
    """

    sketch_dim: int = 0
    """0: no sketch."""
    sketch: torch.Tensor | None = None
    """float64 [sketch_dim]: the local gradient's CountSketch."""
    local_sq: torch.Tensor | None = None
    """float64 0-dim: the local gradient's squared norm."""
    agg_terms: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per bucket index, int64 0-dim: (2 * index + 1) * the digest of the
    aggregated bucket. Kept apart, not summed in place: each bucket's all-reduce
    callback may run on its own thread (gloo) or CUDA stream, so in-place updates of
    one accumulator could race. :meth:`totals` sums them, wrapping mod 2**64; the sum
    is order-independent and the odd factor keeps a one-lane change visible."""
    local_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    watched: dict[int, tuple[torch.Tensor, list[GradWatch]]] = field(default_factory=dict)
    """Per bucket index, where DDP may leave parameters unused (see
    :attr:`CommHookState.unused_params`): the aggregated bucket and its parameters as
    the hook found them, for :meth:`totals` to leave out the slots that reached no
    gradient."""
    faults: list[FaultRecord] = field(default_factory=list)
    """The attempt's faults as injected: local-grad ones on the autograd thread,
    aggregation ones on the all-reduce callbacks' threads, so their interleaving
    depends on timing; :meth:`ordered_faults` does not."""

    def ordered_faults(self) -> list[FaultRecord]:
        """The attempt's faults in an order no timing changes (local-grad before
        aggregation, then by bucket, then by spec, the order of each bucket's own
        injection): what this rank writes to ``faults.jsonl``, whose sort keeps a rank's
        lines of a (step, attempt) in this order, so that identical runs write identical files."""
        return sorted(self.faults, key=lambda r: (r.site != "local-grad", r.target, r.spec_index))

    def local_flat(self) -> torch.Tensor:
        """The full local gradient (``exact`` mode), buckets in index order."""
        return torch.cat([self.local_grads[i] for i in sorted(self.local_grads)])

    def add_local(self, sq: torch.Tensor) -> None:
        if self.local_sq is None:
            self.local_sq = torch.zeros((), dtype=torch.float64, device=sq.device)
        self.local_sq += sq

    def add_aggregated(self, index: int, checksum: torch.Tensor) -> None:
        self.agg_terms[index] = checksum * (2 * index + 1)

    def leave_out_unreached(self) -> None:
        """Digest again, with their slots zeroed, the watched buckets whose slots reached
        no parameter's gradient: DDP leaves a parameter that no rank used at this step
        (``find_unused_parameters``, ``static_graph``) as it was, so a fault in its slot
        of the aggregated bucket changes nothing the optimizer applies, and a checksum
        over it said the replicas split where they had not (a false ``replicas_split``,
        a guard's recompute, PAFT-Dyn's trigger). Only after the backward pass: DDP
        decides which parameters no rank used at its end."""
        for index, (result, params) in self.watched.items():
            spans, offset = [], 0
            for param, grad, version in params:
                n = param.numel()
                now = param.grad
                # Untouched: still no gradient, or the one the hook saw, unwritten since.
                # (A gradient that is a view of the bucket, gradient_as_bucket_view, took
                # the all-reduce's in-place writes, the fault's too: it reached.)
                if now is None or (now is grad and now._version == version):
                    spans.append((offset, offset + n))
                offset += n
            if spans:
                kept = result.detach().clone()
                for lo, hi in spans:
                    kept[lo:hi] = 0
                self.add_aggregated(index, digest_tensor(kept))
        self.watched.clear()

    def sketch_on(self, device: torch.device) -> torch.Tensor | None:
        """The sketch accumulator, allocated on ``device`` by the first bucket."""
        if self.sketch is None and self.sketch_dim:
            self.sketch = torch.zeros(self.sketch_dim, dtype=torch.float64, device=device)
        return self.sketch

    def totals(self) -> tuple[float, int, torch.Tensor | None]:
        """(local squared norm, aggregated checksum as a signed int64, sketch on the
        host), read in ONE device-to-host transfer; zero (or ``None``) for what was
        not captured."""
        parts: list[torch.Tensor] = []
        if self.local_sq is not None:
            # Moved as int64 words: an integer copy keeps every bit of the float64 values.
            parts.append(self.local_sq.reshape(1).view(torch.int64))
            if self.sketch is not None:
                parts.append(self.sketch.view(torch.int64))
        self.leave_out_unreached()
        if self.agg_terms:
            # Every term is ready here: DDP waited for each bucket's callback before the
            # backward pass returned (on CUDA, the current stream waits for their streams).
            parts.append(torch.stack(list(self.agg_terms.values())).sum().reshape(1))
        if not parts:  # nothing captured
            return 0.0, 0, None
        host = torch.cat(parts).cpu()
        local_sq, sketch = 0.0, None
        if self.local_sq is not None:
            local_sq = float(host[:1].view(torch.float64))
            if self.sketch is not None:
                sketch = host[1 : 1 + self.sketch.numel()].view(torch.float64)
        return local_sq, int(host[-1]) if self.agg_terms else 0, sketch


class CommHookState:
    """State of :func:`paft_comm_hook` for one DDP model.

    Args:
        injector: fault injector of this rank (``None`` or disabled: no injection).
        cosine: ``sketch`` (CountSketch of the local gradient), ``exact`` (keep a copy
            of the local gradient) or ``off``.
        sketch_dim: k for the sketch.
        process_group: the group DDP all-reduces over (``None``: the default group).
        inner_hook / inner_state: a user's own comm hook to wrap; it performs the
            all-reduce, paft injects and captures around it.
        unused_params: DDP may leave a parameter without its gradient at a step
            (``find_unused_parameters=True`` or ``static_graph=True``): the checksum then
            leaves out the slots that reached no parameter (:meth:`BucketCapture.leave_out_unreached`).
    """

    def __init__(
        self,
        injector: FaultInjector | None = None,
        cosine: str = "sketch",
        sketch_dim: int = 256,
        process_group: dist.ProcessGroup | None = None,
        inner_hook: CommHook | None = None,
        inner_state: Any = None,
        unused_params: bool = False,
    ) -> None:
        self.injector = injector if injector is not None and injector.enabled else None
        self.cosine = cosine
        self.sketcher = CountSketch(sketch_dim) if cosine == "sketch" else None
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.unused_params = unused_params
        self.step = 0
        self.attempt = 0
        self.local_enabled = True
        self.direction_enabled = True
        self.checksum_enabled = True
        self.inject_enabled = True
        # Buckets of the last completed backward pass (learned from its last bucket),
        # and the count this step's injection uses: fixed at begin(), never changed
        # mid-step, so an event hits exactly one bucket, the same one on every run.
        self.num_buckets = 1
        self.step_buckets = 1
        self.buckets_seen = 0  # this attempt's buckets: none means DDP synced no gradient
        self.pass_buckets = 0  # the buckets of the backward pass under way (see bucket_index)
        self.later_pass = False  # the pass under way is not the attempt's first (see bucket_index)
        self.priming = False
        self.current = BucketCapture()

    def begin(self, step: int, attempt: int = 0, *, local: bool = True, direction: bool = True,
              checksum: bool = True, inject: bool = True, priming: bool = False) -> None:
        """Reset the capture before a forward/backward of ``step`` (retry ``attempt``).

        ``local``: capture the local gradient's squared norm and finiteness (the worker
        metrics, the guard); with ``direction`` also what the cosine needs (the sketch,
        or the copy in ``exact`` mode; metric steps only). ``checksum``: checksum the
        aggregated gradient, which tells whether the ranks' replicas split at this step.
        ``priming``: a pass whose gradients are thrown away (:meth:`Protector.prime`):
        the plain mean all-reduce, not the user's hook, whose state it would advance.
        """
        self.step, self.attempt = step, attempt
        self.priming = priming
        self.local_enabled, self.checksum_enabled, self.inject_enabled = local, checksum, inject
        self.direction_enabled = local and direction
        self.step_buckets = self.num_buckets
        self.buckets_seen = self.pass_buckets = 0
        self.later_pass = False
        dim = self.sketcher.dim if self.direction_enabled and self.sketcher is not None else 0
        self.current = BucketCapture(sketch_dim=dim)

    def retire(self) -> None:
        """Its protector is gone; DDP keeps the hook for good (it has no way to take one
        back): from now on the hook is the plain mean all-reduce, or the user's own hook,
        with nothing injected or captured. Without this, every later backward pass
        injected the faults of the protector's last step again, and captured for no one."""
        self.injector = None
        self.local_enabled = self.direction_enabled = self.checksum_enabled = self.inject_enabled = False
        self.priming = False
        self.current = BucketCapture()

    # -- the chain: paft_comm_hook's steps, one bucket at a time ----------------------

    def bucket_index(self, bucket: dist.GradBucket) -> int:
        """``bucket``'s place in its backward pass, and the pass's bucket count where it is
        the last. DDP hands the hook its buckets in index order, but under
        ``static_graph=True`` its first pass all-reduces them all at the pass's end, each
        with ``bucket.index() == 0`` (and none ``is_last()``, where there are several: one
        per dtype, or per ``bucket_cap_mb_list`` cap). Keyed by that index, each bucket
        overwrote the one before in the capture, so the checksum was that of whichever
        bucket's all-reduce finished last (replicas split with no fault), and a fault
        event struck every bucket. So the buckets are counted here instead.

        A closure that accumulates micro-batches without ``ddp.no_sync()`` runs several
        passes that reach the hook in one attempt; ``later_pass`` says the one under way
        is not the first (see :meth:`inject`)."""
        index = self.pass_buckets
        if index == 0 and self.buckets_seen:
            self.later_pass = True
        self.pass_buckets = 0 if bucket.is_last() else index + 1
        if bucket.is_last():
            self.num_buckets = index + 1  # for the next begin()
        return index

    def inject(self, site: str, index: int, tensor: torch.Tensor) -> None:
        """Inject this step's faults at ``site`` into bucket ``index`` (``tensor``), in place.

        Only in the attempt's first backward pass that reaches the hook, so that an event
        strikes once per attempt: micro-batches accumulated without ``ddp.no_sync()`` each
        reach it, and each pass struck the bucket again (the same element and bit: a
        second flip of the bit undid the first), one fault counted and recorded per pass."""
        # A bucket beyond the step's count (DDP re-bucketed since) cannot be the target.
        if (self.injector is not None and self.inject_enabled and not self.later_pass
                and index < self.step_buckets
                and self.injector.has_site(site)):
            self.current.faults.extend(
                self.injector.inject_bucket(
                    site, self.step, index, self.step_buckets, tensor, attempt=self.attempt
                )
            )

    def capture_local(self, index: int, flat: torch.Tensor, bucket: dist.GradBucket) -> None:
        """Add bucket ``index``'s local gradient ``flat`` to the capture (norm, sketch or copy)."""
        cap = self.current
        sketch = cap.sketch_on(flat.device)
        if sketch is not None and self.sketcher is not None:
            shapes = lambda: [p.shape for p in bucket.parameters()]  # noqa: E731 - once per bucket layout
            cap.add_local(self.sketcher.add_(sketch, index, flat.detach(), shapes))
        else:
            cap.add_local(squared_norm(flat.detach()))
            if self.cosine == "exact" and self.direction_enabled:  # stays on the device: gathered there
                cap.local_grads[index] = flat.detach().to(torch.float64, copy=True)

    def watch(self, bucket: dist.GradBucket) -> list[GradWatch] | None:
        """The bucket's parameters and their gradients as they are before its all-reduce,
        where DDP may leave some unused (``None`` elsewhere: nothing to watch)."""
        if not (self.unused_params and self.checksum_enabled):
            return None
        return [(p, p.grad, 0 if p.grad is None else p.grad._version) for p in bucket.parameters()]

    def capture_aggregated(self, index: int, flat: torch.Tensor, watched: list[GradWatch] | None) -> None:
        """Add the digest of bucket ``index``'s aggregated gradient ``flat`` to the capture
        (and, ``watched``, what :meth:`BucketCapture.leave_out_unreached` needs)."""
        self.current.add_aggregated(index, digest_tensor(flat))
        if watched is not None:
            self.current.watched[index] = (flat, watched)

    def allreduce(self, bucket: dist.GradBucket) -> torch.futures.Future[Any]:
        """Launch the bucket's all-reduce; the future's value is the result tensor or,
        from a process group's own work, a one-element list holding it."""
        if self.inner_hook is not None and not self.priming:
            return self.inner_hook(self.inner_state, bucket)
        # Bit-for-bit DDP's built-in reducer: multiply by 1/world_size, then sum.
        # (torch's allreduce_hook divides instead, which differs in the last bit
        # when world_size is not a power of two. So does the reducer itself for a
        # gradient that already is its bucket view: gradient_as_bucket_view=True with
        # zero_grad(set_to_none=False). The hook cannot tell that case apart, as every
        # gradient is a bucket view by the time it runs; with zero_grad's default,
        # set_to_none=True, the gradients are fresh and the reducer multiplies.)
        tensor = bucket.buffer()
        tensor.mul_(1.0 / self.world_size)
        return dist.all_reduce(tensor, group=self.process_group, async_op=True).get_future()


def paft_comm_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The hook registered on DDP: see the module docstring for the chain."""
    index = state.bucket_index(bucket)
    state.buckets_seen += 1
    buffer = bucket.buffer()
    state.inject("local-grad", index, buffer)
    if state.local_enabled:
        state.capture_local(index, buffer, bucket)
    watched = state.watch(bucket)  # before the all-reduce writes the bucket
    fut = state.allreduce(bucket)
    checksum = state.checksum_enabled

    def after(fut: torch.futures.Future[Any]) -> torch.Tensor:
        # One callback per bucket unwraps the result and runs the aggregated-side chain.
        value = fut.value()
        result = value[0] if isinstance(value, (list, tuple)) else value
        if result.dtype != buffer.dtype:
            # A hook that changes the bucket's dtype (torch's fp16/bf16_compress_wrapper
            # returns its half-precision buffer): DDP casts the result into the gradients
            # anyway, so cast it here, exactly, into the bucket. The aggregation faults and
            # the checksum then see the gradient the optimizer gets, in the dtype the fault
            # specs were checked against (bits=30 on a float16 result raised in the
            # backward pass of the faulty rank alone, and the others hung).
            result = buffer.copy_(result)
        state.inject("aggregation", index, result)
        if checksum:
            state.capture_aggregated(index, result, watched)
        return result

    return fut.then(after)


def registered_comm_hooks(model: torch.nn.parallel.DistributedDataParallel) -> list[tuple[Callable, Any]]:
    """The ``(hook, state)`` pairs registered on ``model`` through ``register_comm_hook``.

    paft's one use of torch's private API, kept here alone: DDP takes one comm hook
    and keeps it for good, so :func:`paft.protect` must know of one before it
    registers its own, on every rank alike (the reducer's refusal comes only at
    registration, on the rank that has one). torch offers no public way to ask, so
    this reads DDP's private ``_comm_hooks`` list (torch 2.x; it misses hooks
    registered through ``_register_builtin_comm_hook``): empty where a torch lacks it.
    A hook missed here stops :func:`paft.protect` only at the registration, on the
    rank that holds it; ``comm_test.py`` checks that this still sees a hook."""
    return list(getattr(model, "_comm_hooks", None) or [])
