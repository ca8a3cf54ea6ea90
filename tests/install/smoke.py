"""The install matrix's scenario, run by a fresh virtual environment's own interpreter: the docs'
``migrate``, a worker and beat started with the docs' commands, a unit of work that commits and one
that rolls back, a durable message consumed by an ``IdempotentTask`` and a copy of it discarded.
Prints ``smoke: ok`` and exits 0 when every step holds; exits 1 naming the step that did not."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

from waiting import wait_until  # copied next to this file, as the matrix runs it

WAIT = 60.0  # seconds a step may take: a fresh environment's first imports are slow

BIN = os.path.dirname(sys.executable)


def celery(*args: str) -> list[str]:
    return [os.path.join(BIN, "celery"), "-A", "smoke_app", *args]


def main() -> None:
    directory = os.environ["SMOKE_DIR"]
    os.makedirs(os.path.join(directory, "broker"), exist_ok=True)
    env = dict(os.environ, PYTHONFAULTHANDLER="1",  # a process that hangs shows where (SIGABRT, below)
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    subprocess.run(celery("outbox", "migrate"), env=env, check=True)
    print("smoke: migrate ok", flush=True)

    sys.path.insert(0, os.path.dirname(__file__))
    from smoke_app import DJANGO, MAINTENANCE_QUEUE, QUEUE, app, effects, outbox, record
    from sqlalchemy import func, select

    effects.create(outbox.engine, checkfirst=True)
    logs = {name: open(os.path.join(directory, f"{name}.log"), "wb") for name in ("worker", "beat")}
    processes = [  # the worker with a node name of its own: RabbitMQ's pidbox queue of a name is exclusive
        subprocess.Popen(celery("worker", "-Q", f"{QUEUE},{MAINTENANCE_QUEUE}", "-l", "INFO", "-c", "2",
                                "-n", f"{QUEUE}@%h"), env=env,
                         stdout=logs["worker"], stderr=subprocess.STDOUT, start_new_session=True),
        subprocess.Popen(celery("beat", "-l", "INFO", "--schedule", os.path.join(directory, "beat-schedule")),
                         env=env, stdout=logs["beat"], stderr=subprocess.STDOUT, start_new_session=True),
    ]
    try:
        run(directory, app, outbox, record, effects, func, select, DJANGO, QUEUE, env)
    finally:
        for process in processes:  # a warm shutdown, as a user's Ctrl-C or a service manager asks for it
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack into its log
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                with contextlib.suppress(ProcessLookupError):  # SIGABRT may have ended it and its group
                    os.killpg(process.pid, signal.SIGKILL)
                sys.exit(f"smoke: {process.args[3]} did not stop within 60 s of SIGTERM (its stacks end its log)")
    print("smoke: ok", flush=True)


def log(directory: str, name: str) -> str:
    with open(os.path.join(directory, f"{name}.log"), errors="replace") as file:
        return file.read()


def run(directory, app, outbox, record, effects, func, select, django: bool, queue: str, env: dict) -> None:
    wait_until(lambda: " ready." in log(directory, "worker"), WAIT, message="the worker to be ready")
    print("smoke: worker ok", flush=True)

    if django:
        from django.db import transaction

        unit_of_work = transaction.atomic
    else:
        unit_of_work = outbox.transaction
    with unit_of_work():
        record.delay(1)
    try:
        with unit_of_work():
            record.delay(2)
            raise RuntimeError("rolled back")
    except RuntimeError:
        pass
    committed = {1: 1, 3: 1}
    if os.environ.get("SMOKE_ASYNC") == "1":  # the asyncio extras: an async unit that commits, one that rolls back
        import asyncio

        async def async_units() -> None:
            async with outbox.atransaction():
                record.delay(4)
            try:
                async with outbox.abegin():
                    record.delay(5)
                    raise RuntimeError("rolled back")
            except RuntimeError:
                pass

        asyncio.run(async_units())
        committed[4] = 1
    message = app.amqp.as_task_v2("smoke-copy", "smoke.record", args=(3,))
    with app.producer_or_acquire() as producer:
        for _ in range(2):  # one message, delivered twice
            producer.publish(message.body, routing_key=queue, headers=message.headers, serializer="json",
                             declare=[app.amqp.queues[queue]], **message.properties)

    def counts() -> dict[int, int]:
        with outbox.engine.connect() as conn:
            rows = conn.execute(select(effects.c.order_id, func.count()).group_by(effects.c.order_id)).all()
        return dict(rows)

    def status() -> dict:
        out = subprocess.run(celery("outbox", "status", "--json"), capture_output=True, text=True, check=True,
                             env=env)
        return json.loads(out.stdout)

    wait_until(lambda: counts() == committed, WAIT, message="the committed message and the copy's first delivery")
    report = wait_until(lambda: (found := status())["duplicates_discarded"] == 1 and found, WAIT, interval=1.0,
                        message="the copy to be discarded")
    assert counts() == committed, f"effects {counts()}: the rolled-back message ran, or a copy ran twice"
    print(f"smoke: units of work and the copy ok: {json.dumps(report['incoming'])}", flush=True)

    port = os.environ.get("SMOKE_METRICS_PORT")
    if port:
        body = wait_until(lambda: _get(f"http://127.0.0.1:{port}/metrics"), WAIT, message="the worker's metrics")
        assert "celery_outbox_" in body, body[:500]
        print("smoke: metrics ok", flush=True)
    # beat logs "Sending due task" before it publishes; the worker's "received" says the publish ended.
    # Celery beat's SIGTERM handler closes the broker connection from inside the signal handler: sent
    # during a publish, on py-amqp, it re-enters the frame writer's lock (or a frame half read) and hangs.
    wait_until(lambda: "celery_outbox.recover" in log(directory, "beat")
               and re.search(r"Task celery_outbox\.recover\[[^]]+\] received", log(directory, "worker")), WAIT,
               message="beat to send the recover task and the worker to receive it")
    print("smoke: beat ok", flush=True)


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


if __name__ == "__main__":
    main()
