"""The throwaway services keep what they promise: data a service persists survives a restart (and, for
PostgreSQL, a killed postmaster); a Redis without persistence comes back empty."""

from __future__ import annotations

import pytest

from ..throwaway import ThrowawayPostgres, ThrowawayRabbitMQ, ThrowawayRedis


@pytest.fixture
def postgres():
    service = ThrowawayPostgres()
    try:
        yield service.start()
    finally:
        service.close()


def test_postgres_keeps_committed_rows_across_a_restart_and_a_crash(postgres):
    import psycopg

    def rows() -> list[str]:
        with psycopg.connect(dsn) as conn:
            return [name for (name,) in conn.execute("SELECT name FROM t ORDER BY id")]

    dsn = postgres.url.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE t (id serial PRIMARY KEY, name text)")
        conn.execute("INSERT INTO t (name) VALUES ('before restart')")
    postgres.restart()
    assert rows() == ["before restart"]
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO t (name) VALUES ('before crash')")
    postgres.kill()
    postgres.start()
    assert rows() == ["before restart", "before crash"]


@pytest.mark.parametrize("persistent", [True, False])
def test_redis_restart_keeps_keys_only_when_persistent(tmp_path, persistent):
    import redis

    with ThrowawayRedis(tmp_path, persistent=persistent) as service:
        redis.Redis.from_url(service.url).set("key", "value")
        service.restart()
        assert redis.Redis.from_url(service.url).get("key") == (b"value" if persistent else None)
    assert not service.dir.exists()


def test_rabbitmq_restart_keeps_a_durable_queue_and_its_persistent_message(tmp_path):
    from kombu import Connection, Producer, Queue

    queue = Queue("throwaway-check", durable=True, routing_key="throwaway-check")
    with ThrowawayRabbitMQ(tmp_path) as service:
        with Connection(service.url, transport_options={"confirm_publish": True}) as conn:
            Producer(conn.default_channel).publish("kept", routing_key=queue.name, delivery_mode=2, declare=[queue])
        service.restart()
        with Connection(service.url) as conn:
            message = queue(conn.default_channel).get(no_ack=True)
            assert message is not None and message.payload == "kept"
    assert not service.dir.exists()
