"""The shop under fire: ``python -m example_project.demo`` (or ``tox -e demo``).

Starts the shop's HTTP API, a worker for payments and cancellations, a worker for
receipts and celery beat; places orders over HTTP (most paid at once, some left
unpaid so their scheduled cancellation fires); sends a share of the payment
messages again as duplicates; SIGKILLs the payments worker in the middle and starts
another; waits for the system to settle and prints a summary a person can check.
The exit code is 0 only when every invariant holds.

Runs on embedded defaults (SQLite and a filesystem broker: no server).
``--database-url`` and ``--broker-url`` run the same demo on PostgreSQL with Redis
or RabbitMQ.

The demo deletes only what it made: a ``--data-dir`` holding files but not its marker
file, or a database whose shop or outbox tables already hold rows, is refused unless
``--reset`` is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timezone
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[1]
MARKER = ".celery-outbox-demo"  # in a data folder the demo made: the only kind it deletes without --reset
RECEIPTS_QUEUE = "receipts"  # the shops' plain queue (their task_routes send shop.send_receipt there)

# Timings that make a demo last a minute, not a day: beat every second, a dead node noticed
# within seconds, a lost message redelivered after five.
DEMO_ENVIRONMENT = {
    "SHOP_RECOVER_INTERVAL": "1",
    "SHOP_HEARTBEAT_INTERVAL": "0.5",
    "SHOP_NODE_STALE_AFTER": "2",
    "SHOP_NODE_STALE_CHECKS": "2",
    "SHOP_REDELIVER_AFTER": "5",
    "SHOP_CLEANUP_INTERVAL": "3600",  # the demo runs cleanup itself at the end, before the audit
}


def parse_args(argv: list[str] | None, prog: str, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--orders", type=int, default=300, help="orders to place (default 300)")
    parser.add_argument("--short", action="store_true", help="a quick run for CI: 60 orders")
    parser.add_argument("--unpaid-share", type=float, default=0.1, help="orders placed without payment")
    parser.add_argument("--duplicate-share", type=float, default=0.2, help="payments sent twice")
    parser.add_argument("--cancel-after", type=float, default=20.0, help="seconds until an unpaid order is cancelled")
    parser.add_argument("--database-url", help="the store (default: SQLite in the data directory); "
                        "the demo empties the shop's and the outbox's tables there first")
    parser.add_argument("--broker-url", help="the broker (default: a filesystem broker, see broker.py)")
    parser.add_argument("--data-dir", help="where the demo keeps its files (default: a new temporary directory)")
    parser.add_argument("--settle-timeout", type=float, default=180.0, help="seconds to wait for the system to settle")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--reset", action="store_true", help="delete a --data-dir the demo did not make and empty "
                        "a database whose shop or outbox tables hold rows (refused without it)")
    parser.add_argument("--no-audit", action="store_true", help="skip the delivery audit (Spark) at the end")
    args = parser.parse_args(argv)
    if args.short:
        args.orders = min(args.orders, 60)
    return args


class Process:
    """A process of the shop, ``python -m <command>`` (a celery worker or beat, an ASGI server),
    logging to a file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        command = [sys.executable, "-m", *command]
        self.process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=self.log_path.open("ab"),
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for(self, text: str, timeout: float = 60) -> None:
        """Wait for ``text`` in the process's log. A process that never writes it is killed before
        the error leaves: a worker's exclusive queues would bar the next run's worker of that name."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if text in self.log_path.read_text(errors="replace"):
                    return
                if self.process.poll() is not None:
                    break
                time.sleep(0.1)
            raise SystemExit(f"demo: {self.name} did not start; see {self.log_path}")
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL the process and its pool children: a crash, no cleanup."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def stop(self) -> None:
        """Start a warm shutdown: SIGTERM to the main process alone, which stops its pool itself.
        (A pool process sent SIGTERM too dies at once, and its worker then waits for it.)"""
        if self.process.poll() is None:
            self.process.terminate()

    def stopped(self, deadline: float) -> None:
        """Wait for the shutdown until ``deadline`` (monotonic); SIGKILL the process group then."""
        try:
            self.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.kill()


def worker(name: str, app: str, queues: str, concurrency: int, env: dict[str, str], log_dir: Path) -> Process:
    """A worker process, once it is ready (one that never gets ready is killed)."""
    process = Process(name, ["celery", "-A", app, "worker", "-Q", queues, "-c", str(concurrency), "-n", f"{name}@%h",
                             "-l", "INFO", "--without-heartbeat", "--without-gossip", "--without-mingle"], env, log_dir)
    process.wait_for(" ready.")
    return process


def place(url: str, order: dict[str, Any]) -> dict[str, Any]:
    """POST an order; its reply, with ``asked_at``: the wall-clock time before the request left
    (its cancellation falls due no earlier than ``asked_at`` plus the countdown)."""
    asked_at = time.time()
    return {**post(url, order), "asked_at": asked_at}


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


class Server(Protocol):
    """What serves a shop's HTTP API at ``url`` for the demo; stopped with the shop's processes."""

    url: str

    def stop(self) -> None: ...

    def stopped(self, deadline: float) -> None: ...


class WSGIServer:
    """A WSGI application served in the demo's own process (werkzeug's threaded server)."""

    def __init__(self, application: Any):
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request is noise here
        self.server = make_server("127.0.0.1", 0, application, threaded=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def stop(self) -> None:
        self.server.shutdown()

    def stopped(self, deadline: float) -> None:
        return None


class Shop:
    """What the demo drives: the SQLAlchemy shop of ``example_project/shop`` (the Django shop's is
    in ``django_demo.py``). Its modules are imported by ``start``, once the environment is set."""

    name = "celery-outbox demo"
    command = "example_project.demo"
    description = __doc__.splitlines()[0]
    celery_app = "example_project.shop.celery_app"
    environment: dict[str, str] = {}  # what the shop's processes, the demo's own among them, must have set
    clients = 1  # HTTP clients placing orders at once
    no_audit: str | None = None  # why this shop's demo ends without the delivery audit, or None: it runs it

    def refusal(self) -> str | None:
        """Why the shop cannot run with the environment set, or None. Asked before ``start``."""
        return None

    def start(self) -> None:
        from example_project.shop.celery_app import app, outbox
        from example_project.shop.tasks import charge_payment
        from example_project.shop.web import api

        self.app, self.outbox, self.charge_payment, self.wsgi = app, outbox, charge_payment, api

    def serve(self, env: dict[str, str], log_dir: Path) -> Server:
        """Serve the shop's HTTP API (here in the demo's process), once its tables exist."""
        return WSGIServer(self.wsgi)

    def tables_with_rows(self) -> list[str]:
        """The shop's and the outbox's tables that exist and hold rows (the schema version row aside)."""
        from sqlalchemy import inspect

        from example_project.shop.models import Base

        existing = set(inspect(self.outbox.engine).get_table_names())
        return tables_holding_rows(self.outbox, [t for t in Base.metadata.sorted_tables if t.name in existing])

    def create_tables(self) -> None:
        """Empty tables: the demo's counts are of this run only."""
        from example_project.shop.models import Base

        Base.metadata.drop_all(self.outbox.engine)
        self.outbox.store.tables.metadata.drop_all(self.outbox.engine)
        self.outbox.ready()  # the outbox's tables (web.create_tables, without the Flask app)
        Base.metadata.create_all(self.outbox.engine)

    def effects(self) -> tuple[dict[str, str], dict[str, int], int]:
        """Each order's status, each order's number of payments, and the number of receipts."""
        from sqlalchemy import func, select

        from example_project.shop.models import Order, Payment, Receipt

        with self.outbox.transaction() as session:
            statuses = dict(session.execute(select(Order.id, Order.status)).all())
            charges = dict(session.execute(select(Payment.order_id, func.count()).group_by(Payment.order_id)).all())
            receipts = session.scalar(select(func.count()).select_from(Receipt))
        return statuses, charges, receipts


def tables_holding_rows(outbox: Any, shop_tables: list[Any]) -> list[str]:
    """The names of ``shop_tables`` and of the outbox's existing tables that hold rows (the schema
    version row aside), read on the outbox's engine."""
    from sqlalchemy import func, inspect, select

    existing = set(inspect(outbox.engine).get_table_names())
    tables = [*shop_tables, *(t for t in outbox.store.tables.all()
                              if t.name in existing and t is not outbox.store.tables.schema)]
    with outbox.engine.connect() as conn:
        return [t.name for t in tables if conn.execute(select(func.count()).select_from(t)).scalar()]


def main(argv: list[str] | None = None, shop: Shop | None = None) -> int:
    shop = shop or Shop()
    args = parse_args(argv, f"python -m {shop.command}", shop.description)
    data_dir = fresh_data_dir(args.data_dir, args.reset)
    if data_dir is None:
        return 2
    env = dict(os.environ, **DEMO_ENVIRONMENT, **shop.environment, SHOP_DATA_DIR=str(data_dir),
               SHOP_CANCEL_UNPAID_AFTER=str(args.cancel_after), PYTHONPATH=str(ROOT))
    audit = not args.no_audit and shop.no_audit is None and audit_available()
    audit_skipped = "--no-audit" if args.no_audit else shop.no_audit or "needs Java and celery-outbox[spark]"
    if audit:  # a short dedupe window, so the demo can archive its rows for the audit once it settled
        env.update(SHOP_ARCHIVE_PATH=str(data_dir / "archive"), SHOP_KEEP_AFTER_HANDLING="30")
    if args.database_url:
        env["SHOP_DATABASE_URL"] = args.database_url
    if args.broker_url:
        env["SHOP_BROKER_URL"] = args.broker_url
    os.environ.update({k: v for k, v in env.items() if k.startswith("SHOP_") or k in shop.environment})

    from celery_outbox import SEND_HEADER

    reason = shop.refusal()
    if reason:
        return refuse(reason)
    shop.start()
    app, outbox = shop.app, shop.outbox
    holding = shop.tables_with_rows()
    if holding and not args.reset:
        return refuse(f"the database at {outbox.store.describe()} already holds rows in {', '.join(holding)}; "
                      "the demo deletes its tables: use another database, or --reset to empty them")
    shop.create_tables()
    say = (lambda *_: None) if args.json else (lambda text: print(text, flush=True))
    say(f"demo: store {outbox.store.describe()}, broker {app.conf.broker_url.split('@')[-1]}, files in {data_dir}")

    processes: list[Process | Server] = []
    try:
        server = shop.serve(env, data_dir)
        processes.append(server)
        victim = worker("payments-a", shop.celery_app, "payments,cancellations,celery", 2, env, data_dir)
        processes.append(victim)  # stopped at the end even when a later process fails to start
        processes.append(worker("receipts", shop.celery_app, RECEIPTS_QUEUE, 1, env, data_dir))
        beat = Process("beat", ["celery", "-A", shop.celery_app, "beat", "-l", "INFO"], env, data_dir)
        beat.wait_for("beat: Starting...")
        processes.append(beat)

        rng = random.Random(7)
        orders = [{"pay": rng.random() >= args.unpaid_share, "amount": f"{rng.randint(100, 9999) / 100:.2f}"}
                  for _ in range(args.orders)]
        placed: list[dict[str, Any]] = []
        kill_at = args.orders // 2
        killed_at = None
        with ThreadPoolExecutor(shop.clients, thread_name_prefix="demo-client") as clients:
            replies = [clients.submit(place, f"{server.url}/orders", order) for order in orders]
            for n, (order, reply) in enumerate(zip(orders, replies, strict=True)):  # the kill: later orders in flight
                placed.append({**reply.result(), "pay": order["pay"]})
                if n + 1 == kill_at:
                    say(f"demo: {n + 1} orders placed; SIGKILL the payments worker and start another")
                    victim.kill()
                    killed_at = time.time()
                    processes.append(worker("payments-b", shop.celery_app, "payments,cancellations,celery", 2, env,
                                            data_dir))
        say(f"demo: {len(placed)} orders placed over HTTP" + (f" by {shop.clients} clients at once"
                                                              if shop.clients > 1 else ""))

        paid = [order for order in placed if order["pay"]]
        duplicates = rng.sample(paid, int(len(paid) * args.duplicate_share))
        for order in duplicates:  # the same message again, as a broker redelivers it: same task id, same send
            shop.charge_payment.apply_async((order["order_id"],), task_id=order["charge_task_id"],
                                            headers={SEND_HEADER: send_id_of(outbox, order["charge_task_id"])})
        say(f"demo: {len(duplicates)} payment messages re-delivered as duplicates")

        summary = settle(shop, placed, duplicates, args.settle_timeout, args.cancel_after)
        summary.update(killed_after_orders=kill_at if killed_at else None, data_dir=str(data_dir))
        if not audit:
            summary["audit_skipped"] = audit_skipped
        if audit and summary["ok"]:
            say("demo: archiving the handled rows and running the delivery audit (Spark)")
            summary["audit"] = run_audit(shop, env, data_dir)
            summary["ok"] = summary["audit"]["exit_code"] == 0
    finally:
        for process in processes:  # all at once: each warm shutdown takes seconds
            process.stop()
        deadline = time.monotonic() + 30
        for process in processes:
            process.stopped(deadline)
    print(json.dumps(summary, indent=2) if args.json else report(summary, shop.name))
    return 0 if summary["ok"] else 1


def fresh_data_dir(given: str | None, reset: bool) -> Path | None:
    """The run's data folder, emptied, marked as the demo's and holding the filesystem broker's
    folders (a new temporary one when none is given); None, once the refusal is printed, when
    ``given`` holds files the demo did not make and ``reset`` is not set."""
    data_dir = Path(given or tempfile.mkdtemp(prefix="celery-outbox-demo-")).resolve()
    if given and data_dir.exists():
        if not (reset or (data_dir / MARKER).exists() or not any(data_dir.iterdir())):
            refuse(f"{data_dir} holds files the demo did not make; give another --data-dir, or --reset to delete it")
            return None
        shutil.rmtree(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / MARKER).write_text("made by the celery-outbox demo: it deletes this folder on its next run\n")
    for folder in ("broker", "control"):
        (data_dir / folder).mkdir()
    return data_dir


def audit_available() -> bool:
    import importlib.util

    return shutil.which("java") is not None and all(
        importlib.util.find_spec(name) is not None for name in ("pyspark", "pyarrow"))


def run_audit(shop: Shop, env: dict[str, str], data_dir: Path) -> dict[str, Any]:
    """Archive every handled row (cleanup, once the 30 s dedupe window has passed), then run the
    audit as a user would: ``celery -A <the shop's app> outbox audit``."""
    outbox = shop.outbox
    deadline = time.monotonic() + 120
    while outbox.store.count_incoming() and time.monotonic() < deadline:
        outbox.cleanup()
        time.sleep(1)
    out = data_dir / "audit"
    command = [sys.executable, "-m", "celery", "-A", shop.celery_app, "outbox", "audit",
               "--out", str(out), "--grace", "0s", "--master", "local[2]"]
    with (data_dir / "audit.log").open("wb") as log:
        exit_code = subprocess.run(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    result: dict[str, Any] = {"exit_code": exit_code, "report": str(out / "report.html"),
                              "log": str(data_dir / "audit.log")}
    if (out / "summary.json").exists():
        audited = json.loads((out / "summary.json").read_text())
        result.update({key: audited[key] for key in ("sent", "handled", "lost", "duplicates_discarded")},
                      latency_p99_seconds=audited["latency_seconds"]["p99"])
    return result


def refuse(reason: str) -> int:
    print(f"demo: refused: {reason}", file=sys.stderr)
    return 2


def send_id_of(outbox: Any, task_id: str, timeout: float = 60.0) -> str:
    """The publish identity of a sent message, as its inbox row records it once a worker took it
    (a copy must carry it to be a copy, not a new send of the same task id)."""
    deadline = time.monotonic() + timeout
    while (row := outbox.store.get_incoming(task_id)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the payment {task_id} never reached a worker")
        time.sleep(0.1)
    return row.send_id


def late_payments(outbox: Any, placed: list[dict[str, Any]], statuses: dict[str, str],
                  charges: dict[str, int], cancel_after: float) -> tuple[int, int]:
    """Of the orders to pay that were cancelled and not charged: how many lost the shop's own race
    (their payment ran once the cancellation was due, saw the order cancelled and charged nothing,
    as the shop means it to), and how many were cancelled early (their payment ran before the
    cancellation could be due, or never ran: a wrong result). A payment claimed at or after the
    order's request left plus ``cancel_after`` is late for sure: the cancellation's countdown began
    after that."""
    late = early = 0
    for order in placed:
        if not order["pay"] or statuses.get(order["order_id"]) != "cancelled" or charges.get(order["order_id"]):
            continue
        row = outbox.store.get_incoming(order["charge_task_id"])
        claimed_at = row.claimed_at if row is not None and row.status == "handled" else None
        if claimed_at is not None and claimed_at.tzinfo is None:  # SQLite keeps UTC without its zone
            claimed_at = claimed_at.replace(tzinfo=timezone.utc)
        if claimed_at is not None and claimed_at.timestamp() >= order["asked_at"] + cancel_after:
            late += 1
        else:
            early += 1
    return late, early


def settle(shop: Shop, placed: list[dict[str, Any]], duplicates: list[dict[str, Any]],
           timeout: float, cancel_after: float) -> dict[str, Any]:
    """Wait until every payment and cancellation happened, nothing is pending, and the receipts'
    plain queue stayed empty with the receipts counted unchanged across two looks (the broker
    tracks nothing of a plain queue's messages but their number); count what happened. An order
    whose payment came after its cancellation was due is cancelled, not paid: the shop's rule
    (``late_payments``), counted apart; on a busy host the demo's 20 s countdown can be shorter
    than a payment's wait behind the killed worker's."""
    outbox = shop.outbox
    to_pay = {order["order_id"] for order in placed if order["pay"]}
    unpaid = {order["order_id"] for order in placed if not order["pay"]}
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    last_receipts: tuple[int, int] | None = None  # (receipts waiting in their queue, receipts sent)
    while True:
        statuses, charges, receipts = shop.effects()
        receipts_now = (messages_waiting(shop.app, RECEIPTS_QUEUE), receipts)
        receipts_done = receipts_now == last_receipts == (0, receipts)
        last_receipts = receipts_now
        status = outbox.status()
        outgoing_left = sum(row["count"] for row in status["outgoing"])
        running = sum(row["count"] for row in status["incoming"] if row["status"] == "running")
        late, early = late_payments(outbox, placed, statuses, charges, cancel_after)
        summary = {
            "orders_placed": len(placed),
            "orders_to_pay": len(to_pay),
            "payments_made": sum(charges.values()),
            "orders_paid_exactly_once": sum(1 for order_id in to_pay if charges.get(order_id) == 1),
            "orders_charged_twice": sum(1 for count in charges.values() if count > 1),
            "unpaid_orders": len(unpaid),
            "unpaid_orders_cancelled": sum(1 for order_id in unpaid if statuses.get(order_id) == "cancelled"),
            "paid_orders_cancelled": early,
            "payments_after_cancellation": late,
            "receipts_sent": receipts,
            "duplicates_sent": len(duplicates),
            "duplicates_discarded": status["duplicates_discarded"],
            "messages_recovered": status["messages_recovered"],
            "dead_letters": sum(row["count"] for row in status["dead_letters"]),
            "rows_pending": outgoing_left + running,
            "settle_seconds": round(time.monotonic() - started, 1),
        }
        settled = (summary["orders_paid_exactly_once"] + late == len(to_pay)
                   and summary["unpaid_orders_cancelled"] == len(unpaid) and summary["rows_pending"] == 0
                   and receipts_done)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    summary["ok"] = bool(
        settled and summary["payments_made"] + late == len(to_pay) and summary["orders_charged_twice"] == 0
        and summary["paid_orders_cancelled"] == 0 and summary["dead_letters"] == 0
    )
    return summary


def messages_waiting(app: Any, queue: str) -> int:
    """The messages the broker holds in ``queue`` that no worker has taken yet (Redis knows no
    empty queue: none there is none waiting)."""
    with app.pool.acquire(block=True) as connection, connection.channel() as channel:
        try:
            return channel.queue_declare(queue, passive=True).message_count
        except connection.channel_errors:
            return 0


def report(summary: dict[str, Any], name: str = Shop.name) -> str:
    check = {True: "ok", False: "WRONG"}
    late = summary["payments_after_cancellation"]
    lines = [
        "",
        f"{name}: summary",
        f"  orders placed over HTTP        {summary['orders_placed']}",
        f"  orders to pay                  {summary['orders_to_pay']}",
        f"  payments made                  {summary['payments_made']}  "
        f"[{check[summary['payments_made'] + late == summary['orders_to_pay']]}: equal"
        + (f", with {late} that ran after their order's cancellation was due and charged nothing" if late else "")
        + "]",
        f"  orders paid exactly once       {summary['orders_paid_exactly_once']}  "
        f"[{check[summary['orders_charged_twice'] == 0]}: {summary['orders_charged_twice']} charged twice]",
        f"  unpaid orders cancelled        {summary['unpaid_orders_cancelled']} of {summary['unpaid_orders']}  "
        f"(durable countdown; {summary['paid_orders_cancelled']} orders to pay cancelled early)",
        f"  receipts sent (plain queue)    {summary['receipts_sent']}",
        f"  duplicates sent / discarded    {summary['duplicates_sent']} / {summary['duplicates_discarded']}  "
        "(copies recovery sent are discarded too; a copy whose original died with",
        "                                 the killed worker runs in its place)",
        f"  messages recovered after the crash  {summary['messages_recovered']}",
        f"  dead letters                   {summary['dead_letters']}",
        f"  rows left pending              {summary['rows_pending']}  [{check[summary['rows_pending'] == 0]}]",
        f"  settled in                     {summary['settle_seconds']} s after the last order",
        f"  logs                           {summary['data_dir']}",
    ]
    audit = summary.get("audit")
    if audit and "lost" in audit:
        lines.append(f"  delivery audit (Spark)         {audit['sent']} sent, {audit['handled']} handled, "
                     f"{audit['lost']} lost, p99 latency {audit['latency_p99_seconds']:.3f} s  "
                     f"[{check[audit['exit_code'] == 0]}]")
        lines.append(f"  audit report                   {audit['report']}")
    elif audit:
        lines.append(f"  delivery audit (Spark)         failed (exit code {audit['exit_code']}); see {audit['log']}")
    else:
        lines.append(f"  delivery audit (Spark)         skipped ({summary.get('audit_skipped', 'not run')})")
    lines += [
        "",
        "RESULT: " + ("every order paid exactly once (or cancelled, when its payment came after the deadline), "
                      "nothing lost, nothing pending" if summary["ok"]
                      else "an invariant does not hold: see the lines marked WRONG and the logs"),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
