"""Parked messages: a tenant's deliveries its workers could not claim while its store was down.

Workers park such a message in the default store (a ``tenant_unavailable`` dead letter with its
envelope) and ack it (``consumer.outages``); the tenant's own recovery pass, which runs only once
its store answers, sends them again. Transaction boundary: per batch, in the default store, the
tenant's parked letters are locked, published unchanged (the same task id and send: the tenant's
inbox discards any other copy) and deleted, in one transaction; a crash after the publish
publishes them again later, and the inbox discards the copy. Guarantee: a parked message is kept
until its publish is confirmed; the default store's maintenance never waits for a tenant's store.
"""

from __future__ import annotations

from ..core.runtime import Runtime
from ..core.tenancy import TENANT_HEADER, current_tenant, tenant_of_headers, using_tenant
from ..message.dead_letter_rows import stored_header_text
from ..message.envelope import from_row
from ..monitoring import tracing
from ..producer.broker import outlet
from ..vocabulary import DeadLetterReason

__all__ = ["send_parked"]


def send_parked(runtime: Runtime, max_batches: int | None = None) -> tuple[int, str | None]:
    """Publish the current tenant's parked messages (none without a tenant); returns how many,
    and the broker's error when it stopped the pass (the rest wait for the next)."""
    tenant = current_tenant()
    if tenant is None:
        return 0, None
    settings, sent = runtime.settings, 0
    with using_tenant(None):
        store = runtime.ready().store
        where = store.dead_letter_filter(reason=DeadLetterReason.TENANT_UNAVAILABLE.value,
                                         headers_containing=stored_header_text(TENANT_HEADER, tenant))
        with outlet(runtime.app) as out:
            after_id = 0
            for _ in range(max_batches or settings.max_batches_per_run):
                with store.begin(durable=False) as conn:  # lost in a crash, the messages are only sent again
                    rows = store.lock_dead_letters(conn, where, settings.recover_batch_size, after_id=after_id)
                    if not rows:
                        return sent, None
                    after_id = rows[-1].id
                    broker_error = out.unreachable()
                    if broker_error:
                        return sent, broker_error
                    pairs = [(row, message) for row in rows
                             if tenant_of_headers((message := from_row(row, out.queues)).headers) == tenant]
                    done = out.publish_each(pairs, crash_point="during_recover", step=tracing.Step.RECOVER)
                    store.delete_dead_letters(conn, [row.id for row, _ in done.published])
                sent += len(done.published)
                if done.broker_error_text or len(rows) < settings.recover_batch_size:
                    return sent, done.broker_error_text
    return sent, None
