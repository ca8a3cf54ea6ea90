"""The shop with three tenants: ``python -m example_project.tenants_demo``.

The shop's tables and tasks (``example_project/shop``), its ``outbox_tenants`` three tenants, each
in a database of its own beside the default store's (``SHOP_TENANTS`` in ``shop/settings.py``).
Places orders for each tenant in ``outbox.transaction(tenant=...)``, interleaved, so one
``payments`` queue mixes the tenants' messages; starts a real worker for payments and receipts;
sends a few payment messages of each tenant again as duplicates; waits until every order is paid
and prints a summary that checks itself: each tenant's orders paid exactly once, with their
receipts, in the tenant's own database; no order, payment or inbox row of a tenant in another
tenant's database or in the default store; nothing pending, no dead letter. The exit code is 0 only
when every check holds.

Runs on embedded defaults: each tenant an SQLite file, the default store another, and a filesystem
broker (no server). ``--database-url postgresql+psycopg://...`` puts the default store in that
PostgreSQL database and each tenant in a schema of it; ``--broker-url`` takes Redis or RabbitMQ.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import uuid
from decimal import Decimal
from typing import Any

from .demo import ROOT, Process, Shop, fresh_data_dir, refuse, send_id_of, worker

TENANTS = ("acme", "globex", "initech")
DUPLICATES = 3  # payment messages of each tenant sent again, as a broker redelivers them


class TenantShop(Shop):
    """The shop of ``example_project/shop`` without its HTTP API: the demo places orders itself."""

    name = "celery-outbox tenants demo"
    command = "example_project.tenants_demo"
    description = __doc__.splitlines()[0]

    def start(self) -> None:
        from example_project.shop.celery_app import app, outbox
        from example_project.shop.tasks import charge_payment

        self.app, self.outbox, self.charge_payment = app, outbox, charge_payment


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {TenantShop.command}", description=TenantShop.description)
    parser.add_argument("--orders", type=int, default=20, help="orders to place for each tenant (default 20)")
    parser.add_argument("--database-url", help="the default store (default: SQLite in the data directory, each "
                        "tenant another file); on PostgreSQL each tenant is a schema of that database. The demo "
                        "empties the shop's and the outbox's tables there first")
    parser.add_argument("--broker-url", help="the broker (default: a filesystem broker, see broker.py)")
    parser.add_argument("--data-dir", help="where the demo keeps its files (default: a new temporary directory)")
    parser.add_argument("--settle-timeout", type=float, default=60.0, help="seconds to wait for every payment")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--reset", action="store_true", help="delete a --data-dir the demo did not make and empty "
                        "databases whose shop or outbox tables hold rows (refused without it)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data_dir = fresh_data_dir(args.data_dir, args.reset)
    if data_dir is None:
        return 2
    env = dict(os.environ, SHOP_DATA_DIR=str(data_dir), SHOP_TENANTS=",".join(TENANTS), PYTHONPATH=str(ROOT))
    if args.database_url:
        env["SHOP_DATABASE_URL"] = args.database_url
    if args.broker_url:
        env["SHOP_BROKER_URL"] = args.broker_url
    os.environ.update({k: v for k, v in env.items() if k.startswith("SHOP_")})

    from celery_outbox import using_tenant

    shop = TenantShop()
    shop.start()
    stores = (None, *TENANTS)  # None: the default store
    for store in stores:
        with using_tenant(store):
            holding = shop.tables_with_rows()
            if holding and not args.reset:
                return refuse(f"the database at {shop.outbox.store.describe()} already holds rows in "
                              f"{', '.join(holding)}; the demo deletes its tables: use another database, or --reset")
    for store in stores:
        with using_tenant(store):
            shop.create_tables()
    say = (lambda *_: None) if args.json else (lambda text: print(text, flush=True))
    say(f"demo: tenants {', '.join(TENANTS)}, broker {shop.app.conf.broker_url.split('@')[-1]}, files in {data_dir}")

    processes: list[Process] = []
    try:
        processes.append(worker("tenants", shop.celery_app, "payments,receipts", 2, env, data_dir))
        placed = place_orders(shop, args.orders)
        say(f"demo: {args.orders} orders placed for each tenant, each in outbox.transaction(tenant=...)")
        duplicates = send_duplicates(shop, placed, args.settle_timeout)
        say(f"demo: {sum(duplicates.values())} payment messages re-delivered as duplicates")
        summary = settle(shop, placed, duplicates, args.settle_timeout)
        summary["data_dir"] = str(data_dir)
    finally:
        for process in processes:
            process.stop()
        deadline = time.monotonic() + 30
        for process in processes:
            process.stopped(deadline)
    print(json.dumps(summary, indent=2) if args.json else report(summary))
    return 0 if summary["ok"] else 1


def place_orders(shop: TenantShop, orders: int) -> dict[str, list[dict[str, str]]]:
    """Place ``orders`` for each tenant, the tenants in turn: each order and its payment message in one
    unit of work of its tenant. Each tenant's orders, with their payment's task id."""
    from example_project.shop.models import Order

    rng = random.Random(7)
    placed: dict[str, list[dict[str, str]]] = {tenant: [] for tenant in TENANTS}
    for _ in range(orders):
        for tenant in TENANTS:
            order_id = str(uuid.uuid4())
            with shop.outbox.transaction(tenant=tenant) as session:
                session.add(Order(id=order_id, amount=Decimal(rng.randint(100, 9999)) / 100, status="placed"))
                charge = shop.charge_payment.delay(order_id)  # stored in the tenant's database, sent after commit
            placed[tenant].append({"order_id": order_id, "charge_task_id": charge.id})
    return placed


def send_duplicates(shop: TenantShop, placed: dict[str, list[dict[str, str]]], timeout: float) -> dict[str, int]:
    """Send the first payment messages of each tenant again, as a broker redelivers them (same task
    id, same send), each once a worker took its original (within ``timeout`` seconds in all): for its
    tenant, so the copy names it as the original does. How many each tenant's were sent."""
    from celery_outbox import SEND_HEADER, using_tenant

    deadline = time.monotonic() + timeout
    sent = dict.fromkeys(TENANTS, 0)
    for tenant in TENANTS:
        with using_tenant(tenant):
            for order in placed[tenant][:DUPLICATES]:
                task_id = order["charge_task_id"]
                try:
                    send_id = send_id_of(shop.outbox, task_id, max(deadline - time.monotonic(), 0))
                except RuntimeError:  # never taken: the summary shows its order unpaid
                    continue
                shop.charge_payment.apply_async((order["order_id"],), task_id=task_id, headers={SEND_HEADER: send_id})
                sent[tenant] += 1
    return sent


def look(shop: TenantShop, orders: list[dict[str, str]], duplicates_sent: int) -> dict[str, Any]:
    """What the current store (``using_tenant``) holds, against the ``orders`` placed for it."""
    from sqlalchemy import select

    statuses, charges, receipts = shop.effects()
    outbox = shop.outbox
    with outbox.store.begin() as conn:
        inbox = set(conn.execute(select(outbox.store.tables.incoming.c.message_id)).scalars())
    status = outbox.status()
    own_orders = {order["order_id"] for order in orders}
    own_payments = {order["charge_task_id"] for order in orders}
    return {
        "database": outbox.store.describe() + (f", schema {outbox.store.schema}" if outbox.store.schema else ""),
        "orders_placed": len(orders),
        "orders_paid_exactly_once": sum(1 for order_id in own_orders
                                        if charges.get(order_id) == 1 and statuses.get(order_id) == "paid"),
        "orders_charged_twice": sum(1 for count in charges.values() if count > 1),
        "payments_made": sum(charges.values()),
        "receipts_sent": receipts,
        "duplicates_sent": duplicates_sent,
        "duplicates_discarded": status["duplicates_discarded"],
        "others_orders": len(statuses.keys() - own_orders),  # an order another store's unit of work placed
        "others_payments": len(charges.keys() - own_orders),
        "others_inbox_rows": len(inbox - own_payments),  # a delivery claimed in the wrong database
        "rows_pending": sum(row["count"] for row in status["outgoing"])
        + sum(row["count"] for row in status["incoming"] if row["status"] == "running"),
        "dead_letters": sum(row["count"] for row in status["dead_letters"]),
    }


def holds(store: dict[str, Any]) -> bool:
    """Every check of one store: its orders paid exactly once, each with its receipt, each duplicate
    discarded, nothing of another store's, nothing pending."""
    placed = store["orders_placed"]
    return (store["orders_paid_exactly_once"] == store["payments_made"] == store["receipts_sent"] == placed
            and store["orders_charged_twice"] == 0 and store["duplicates_discarded"] == store["duplicates_sent"]
            and store["others_orders"] == store["others_payments"] == store["others_inbox_rows"] == 0
            and store["rows_pending"] == store["dead_letters"] == 0)


def settle(shop: TenantShop, placed: dict[str, list[dict[str, str]]], duplicates: dict[str, int],
           timeout: float) -> dict[str, Any]:
    """Look at every store until each holds (or ``timeout`` seconds have passed); the last looks."""
    from celery_outbox import using_tenant

    started = time.monotonic()
    while True:
        stores: dict[str, dict[str, Any]] = {}
        for tenant in (None, *TENANTS):
            with using_tenant(tenant):
                stores[tenant or "default"] = look(shop, placed.get(tenant or "", []), duplicates.get(tenant or "", 0))
        for store in stores.values():
            store["ok"] = holds(store)
        ok = all(store["ok"] for store in stores.values())
        if ok or time.monotonic() - started > timeout:
            return {"stores": stores, "settle_seconds": round(time.monotonic() - started, 1), "ok": ok}
        time.sleep(0.2)


def report(summary: dict[str, Any]) -> str:
    check = {True: "ok", False: "WRONG"}
    lines = ["", f"{TenantShop.name}: summary",
             f"  {'store':<9} {'orders':>6} {'paid once':>9} {'receipts':>8} {'duplicates sent/discarded':>26} "
             f"{'rows of others':>14} {'pending':>7} {'dead':>4}"]
    for name, store in summary["stores"].items():
        others = store["others_orders"] + store["others_payments"] + store["others_inbox_rows"]
        duplicates = f"{store['duplicates_sent']} / {store['duplicates_discarded']}"
        lines.append(f"  {name:<9} {store['orders_placed']:>6} {store['orders_paid_exactly_once']:>9} "
                     f"{store['receipts_sent']:>8} {duplicates:>26} {others:>14} {store['rows_pending']:>7} "
                     f"{store['dead_letters']:>4}  [{check[store['ok']]}]")
    lines += ["", "  databases"]
    lines += [f"    {name:<9} {store['database']}" for name, store in summary["stores"].items()]
    lines += [
        f"  waited {summary['settle_seconds']} s after the duplicates; logs in {summary['data_dir']}",
        "",
        "RESULT: " + ("each tenant's orders paid exactly once in its own database, nothing in another's or in the "
                      "default store, nothing pending" if summary["ok"]
                      else "a check does not hold: see the lines marked WRONG and the logs"),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
