"""Publishes inside Django's ``transaction.atomic()`` join Django's transaction.

Transaction boundary: inside an atomic block on the outbox's Django database (nested blocks,
savepoints and ``ATOMIC_REQUESTS`` included), captured messages wait, a batch per savepoint level,
each batch one ``transaction.on_commit`` callback. Django's outermost commit inserts the durable
messages of the batches it still holds through Django's own connection, as the transaction's last
statement (on PostgreSQL with psycopg, with the COMMIT in one network message); the callbacks
publish after it. A send in a coroutine that ``async_to_sync`` runs inside the block joins it too.
A ``retry`` or ``replace`` of the running task is stored and forwarded at once. Guarantee: a
durable message commits with the user's data or not at all (a rolled-back savepoint or block takes
its messages with it); once committed it is published now or by the relay later, never lost;
nothing is published after a rollback. See docs/django.md.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from sqlalchemy.exc import DBAPIError

from ..core.crashpoints import crashpoint
from ..core.tenancy import current_tenant, using_tenant
from ..errors import OutboxError, StoreUnavailable, TransactionAborted
from ..message.envelope import OutgoingMessage
from ..producer.publishing import Publisher
from ..store import Store
from .engine import django_engine

__all__ = ["DjangoTransaction", "joined_transaction"]


class _Batch:
    """The messages captured at one savepoint level, and the ``on_commit`` callback that
    publishes them: Django drops it, with them, when that savepoint (or an outer one) rolls back."""

    __slots__ = ("messages", "owner")

    def __init__(self, owner: DjangoTransaction):
        self.messages: list[OutgoingMessage] = []
        self.owner = owner

    def __call__(self) -> None:
        self.owner.publish(self.messages)


class DjangoTransaction:
    """The capture target of the publishes inside Django's atomic block on database ``using``.

    Messages captured at one savepoint level share one batch (``_Batch``); the durable ones of
    the batches Django still holds are inserted with its outermost COMMIT
    (``_store_at_commit``), and those batches are published after it.
    """

    def __init__(self, publisher: Publisher, using: str, store: Store, tenant: str | None = None):
        self.publisher = publisher
        self.using = using
        self.store = store
        #: the tenant whose Django database ``using`` is (None: the default store's)
        self.tenant = tenant
        self._hooks: Any = None  # Django's list of on_commit callbacks the batches below were registered in
        self._batches: dict[tuple[str, ...], _Batch] = {}

    def add(self, messages: list[OutgoingMessage]) -> None:
        """Capture messages in Django's transaction: the durable ones are inserted with its
        COMMIT, and all are published after it."""
        from django.db import connections, transaction

        decided = [m for m in messages if m.survives_rollback]
        if decided:
            self.publisher.store_and_forward(decided)
        joined = [m for m in messages if not m.survives_rollback]
        if not joined:
            return
        connection = connections[self.using]
        if self._hooks is not connection.run_on_commit:  # a new transaction, or a savepoint rolled back
            self._hooks, self._batches = connection.run_on_commit, {}
        level = tuple(connection.savepoint_ids)
        batch = self._batches.get(level)
        if batch is None:
            batch = self._batches[level] = _Batch(self)
            transaction.on_commit(batch, using=self.using, robust=True)
            _ahead_of_the_projects_callbacks(connection)
            _store_at_commit(connection)
        batch.messages.extend(joined)

    def store_before_commit(self, connection: Any, batches: list[_Batch], commit: bool) -> None:
        """Django's outermost COMMIT is about to go: insert the durable messages of ``batches``
        (this transaction's, which Django still holds), through its connection, in its
        transaction; with ``commit``, as the transaction's last statement, which the COMMIT may go
        with. An error is raised as the ORM raises one (``_raise_as_django_error``): Django's
        commit then rolls back."""
        durable = [m for batch in batches for m in batch.messages if m.durable and m.row_id is None]
        if durable:
            with using_tenant(self.tenant):
                self._insert(connection, durable, commit)

    def publish(self, messages: list[OutgoingMessage]) -> None:
        """Django's ``on_commit`` callback of a batch: publish its messages. A durable message
        with no row yet had its callback run with no commit (Django's test cases run them,
        ``captureOnCommitCallbacks(execute=True)``, inside the test's transaction): it is inserted
        first, through Django's connection as it stands."""
        from django.db import connections

        with using_tenant(self.tenant):
            stranded = [m for m in messages if m.durable and m.row_id is None]
            if stranded:
                self._insert(connections[self.using], stranded, commit=False)
            crashpoint("after_commit")
            self.publisher.publish_committed(messages)

    def _insert(self, connection: Any, messages: list[OutgoingMessage], commit: bool) -> None:
        try:
            with self.store.engine.connect() as conn:  # Django's connection
                self.publisher.store_durable(conn, messages, commit)
        except (StoreUnavailable, DBAPIError) as exc:
            _raise_as_django_error(exc, connection)


def _ahead_of_the_projects_callbacks(connection: Any) -> None:
    """Move the ``on_commit`` callback just registered (a batch) ahead of the project's own, behind
    the batches before it: Django stops a block's callbacks at the first one that raises and is not
    robust, and a project's cache invalidation that fails must not keep the block's messages from
    going out. The batches keep their order, and so the messages theirs."""
    hooks = connection.run_on_commit
    entry = hooks.pop()
    ahead = 0
    while ahead < len(hooks) and isinstance(hooks[ahead][1], _Batch):
        ahead += 1
    hooks.insert(ahead, entry)


# the Django connections whose commit stores the joined transactions' durable messages first
_storing: weakref.WeakSet[Any] = weakref.WeakSet()


def _store_at_commit(connection: Any) -> None:
    """Make Django's ``connection`` insert the durable messages of the batches among its
    ``on_commit`` callbacks (a rolled-back savepoint took its own with it) just before each
    COMMIT it sends (once per connection; a commit with none sends only its COMMIT).
    Django rolls back on the ``DatabaseError`` an INSERT raises; anything else (a signal such as
    a soft time limit interrupting the exchange) closes the connection first, its protocol state
    unknown, and Django's callbacks go with it."""
    from django.db import DatabaseError

    if connection in _storing:
        return
    commit = connection._commit

    def store_then_commit() -> Any:
        batches = [callback for _, callback, _ in connection.run_on_commit if isinstance(callback, _Batch)]
        if batches:
            if connection.vendor == "postgresql":  # only PostgreSQL aborts a transaction for a failed statement
                _refuse_if_aborted(connection, batches[0].owner.store)
            crashpoint("before_commit")
            owners = list(dict.fromkeys(batch.owner for batch in batches))  # each outbox's, in order
            try:
                for n, owner in enumerate(owners, 1):
                    owner.store_before_commit(connection, [b for b in batches if b.owner is owner],
                                              commit=n == len(owners))
            except DatabaseError:
                raise
            except BaseException:
                connection.close()
                raise
        return commit()

    connection._commit = store_then_commit
    _storing.add(connection)


def _refuse_if_aborted(connection: Any, store: Store) -> None:
    """Before Django's COMMIT of a block that sent messages: when the database aborted its
    transaction (a statement failed and the view caught the error outside a nested ``atomic()``),
    that COMMIT would end as a ROLLBACK, raising nothing, and the messages would go out for
    writes that never happened. Raise ``TransactionAborted`` as a ``DatabaseError``, which makes
    Django roll the block back and drop its callbacks: nothing is published."""
    from django.db import DatabaseError

    with store.engine.connect() as conn:  # Django's connection
        cause = store.aborted_by(conn)
    if cause is not None:
        raise DatabaseError(str(TransactionAborted(cause))) from TransactionAborted(cause)


def _raise_as_django_error(exc: StoreUnavailable | DBAPIError, connection: Any) -> None:
    """Raise ``exc``, an error of a statement sent on Django's ``connection``, as the ORM raises
    the driver's error behind it: Django's own class (``django.db.OperationalError`` for a lost
    connection), caused by the driver's error, with the connection's ``errors_occurred`` set, so
    a caller's ``except django.db.Error`` catches it and Django checks the connection before
    reusing it. ``exc`` itself when no driver error caused it."""
    cause = exc.__cause__ if isinstance(exc, StoreUnavailable) else exc
    driver_error = getattr(cause, "orig", cause)
    if not isinstance(driver_error, connection.Database.Error):
        raise exc
    with connection.wrap_database_errors:  # Django's mapping of the driver's classes onto its own
        raise driver_error


# per Django connection (one per thread or greenlet): its joined transaction, per outbox
_joined: weakref.WeakKeyDictionary[Any, dict[int, DjangoTransaction]] = weakref.WeakKeyDictionary()


def joined_transaction(publisher: Publisher) -> DjangoTransaction | _JoinedFromCoroutine | None:
    """The Django transaction a publish joins now: an atomic block open on the outbox's Django
    database in this thread or, for a coroutine that ``async_to_sync`` runs, in the thread waiting
    for it; or None."""
    caller = _waiting_sync_thread()
    if caller is not None:
        try:
            asked = caller.submit(_joined_in_this_thread, publisher)
        except RuntimeError:  # asgiref's: the caller has returned, no thread waits for this coroutine
            return _joined_in_this_thread(publisher)
        joined = asked.result()
        return None if joined is None else _JoinedFromCoroutine(joined, caller)
    return _joined_in_this_thread(publisher)


class _JoinedFromCoroutine:
    """The atomic block of the sync thread that waits in ``async_to_sync`` for the coroutine that
    sends: its messages are captured in that thread, on its Django connection."""

    __slots__ = ("caller", "joined")

    def __init__(self, joined: DjangoTransaction, caller: Any):
        self.joined = joined
        self.caller = caller

    def add(self, messages: list[OutgoingMessage]) -> None:
        """Capture messages in the waiting thread's transaction (``DjangoTransaction.add``)."""
        self.caller.submit(self.joined.add, messages).result()


def _waiting_sync_thread() -> Any:
    """When this thread runs an event loop and the coroutine running now was called through
    ``async_to_sync`` by a sync thread that waits for it: asgiref's executor that runs work in that
    thread (where ``sync_to_async`` runs thread-sensitive code). Django's connections are
    per thread, and an atomic block open there would not see a send made here: the send would
    be stored and published at once, even if the block rolled back. Else None.

    The wait for that thread blocks this event loop for as long as it takes to capture the
    messages; the thread runs the work while it waits, so it does not need the loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    from asgiref.sync import AsyncToSync

    # where SyncToAsync runs thread-sensitive code (asgiref 3.x)
    return (getattr(AsyncToSync.executors, "current", None)
            or getattr(AsyncToSync, "loop_thread_executors", {}).get(loop))


def _joined_in_this_thread(publisher: Publisher) -> DjangoTransaction | None:
    """The atomic block open on the outbox's Django database in this thread, or None."""
    from django.db import connections

    settings = publisher.runtime.settings
    using = django_database_of(publisher.runtime)
    if using is None:
        return None
    connection = connections[using]
    if not connection.in_atomic_block:
        if connection.connection is not None and not connection.autocommit:
            raise OutboxError(
                f"a message was sent inside a transaction of Django's database {using!r} opened with "
                "transaction.set_autocommit(False): the outbox cannot know whether it commits (Django's own "
                "on_commit() refuses it too), so the message would go out even if it rolls back; open the "
                "transaction with transaction.atomic() instead")
        return None
    of_connection = _joined.setdefault(connection, {})
    joined = of_connection.get(id(publisher))
    if joined is None or joined.publisher is not publisher:
        joined = of_connection[id(publisher)] = DjangoTransaction(publisher, using,
                                                                  _store(using, settings.table_prefix),
                                                                  current_tenant())
    return joined


def django_database_of(runtime: Any) -> str | None:
    """The Django database of the running tenant's store: ``outbox_django_database`` for none, the
    tenant's alias (``TenantPlace.django``), or None for a tenant placed outside Django."""
    tenant = current_tenant()
    if tenant is None:
        return runtime.settings.django_database
    place = runtime.tenant_places(refresh_for=tenant).get(tenant)
    return None if place is None else place.django


def tenant_in_atomic_block(runtime: Any) -> str | None:
    """The tenant placed in a Django database with an atomic block open in this thread (a send
    there, naming no tenant, is that tenant's), or None. Two such databases with blocks open at
    once are one send that cannot be placed: ``OutboxError``."""
    from django.db import connections

    places = runtime.tenant_places()
    open_in = sorted(tenant for tenant, place in places.items()
                     if place.django is not None and connections[place.django].in_atomic_block)
    if len(open_in) > 1:
        raise OutboxError(f"a message is sent inside atomic blocks of the Django databases of tenants "
                          f"{', '.join(open_in)}: name its tenant with using_tenant() or outbox.transaction(tenant=)")
    return open_in[0] if open_in else None


_stores: dict[tuple[str, str], Store] = {}


def _store(using: str, prefix: str) -> Store:
    """The store on Django's connection ``using``: one per database and prefix, shared by every
    thread (its engine hands out the calling thread's connection)."""
    store = _stores.get((using, prefix))
    if store is None:
        store = _stores[(using, prefix)] = Store(django_engine(using), prefix)
    return store
