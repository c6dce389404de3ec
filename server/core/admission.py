"""The admission rule: whether the engine takes one more stream now, and when to retry if not.

Pure functions over the policy's published state (:class:`~server.core.events.Admission`),
applied by the engine client on the event loop, so a refusal never waits for the inference
thread. The rules are the policy's (``server/core/policy.py``'s docstring, "Admission").
"""

from __future__ import annotations

from collections.abc import Mapping

from server.core.events import Admission
from server.core.policy import PolicyConfig


def retry_after_ms(queued: int, batch_limit: int, seconds_per_block: float) -> int:
    """When a refused stream could expect a slot: batches ahead × ten blocks × block time.

    A sequence needs roughly ten blocks; the 250 ms floor avoids retry storms.
    """
    batches_ahead = 1 + queued // max(1, batch_limit)
    return max(250, int(batches_ahead * 10 * seconds_per_block * 1000))


def refusal(
    admission: Admission,
    config: PolicyConfig,
    pending: int,
    *,
    client: str = "",
    pending_by_client: Mapping[str, int] | None = None,
) -> int | None:
    """The admission rule: None to admit a new stream, else the ``retry_after_ms`` to refuse it with.

    Below ``max_queue`` waiting sequences everyone is admitted. At or past it, a client is
    admitted only while it has fewer than its fair share waiting, ``max_queue`` divided by
    the clients with sequences waiting (itself included), and while fewer than
    ``2 × max_queue`` are waiting in all. Both count the sequences a listener waits for
    (a stream's current segment; look-ahead ones are bounded per stream and rank after
    them) and the streams submitted since. One client alone is refused at ``max_queue`` as
    before; a client that filled the queue is refused while a newcomer is still let in.

    Args:
        admission: the policy's state (:meth:`SchedulingPolicy.admission`).
        config: the policy's configuration.
        pending: streams submitted that ``admission`` does not count yet.
        client: who asks.
        pending_by_client: of ``pending``, how many each client submitted (None: all by ``client``).
    """
    if admission.breaker_open:  # /ready fails meanwhile, so a load balancer routes elsewhere
        return int(config.breaker_probe_interval_s * 1000)
    queued = admission.waiting + pending
    if queued < config.max_queue:
        return None
    if pending_by_client is None:
        pending_by_client = {client: pending}
    heard = sum(admission.by_client.values()) + pending
    if heard < 2 * config.max_queue:
        mine = admission.by_client.get(client, 0) + pending_by_client.get(client, 0)
        clients = len({client, *admission.by_client, *(c for c, n in pending_by_client.items() if n)})
        if mine < config.max_queue // clients:
            return None
    return retry_after_ms(queued, admission.batch_limit, admission.seconds_per_block)
