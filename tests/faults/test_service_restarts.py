"""A broker or the database restarted in the middle of a run: nothing lost, nothing done twice.

Each scenario runs its own throwaway instance of the service it restarts, on a private
port, so the shared services of the suite are never touched. The invariants and the
printed line are those of ``harness``.
"""

from __future__ import annotations

from ..services import require
from ..throwaway import ThrowawayPostgres, ThrowawayRabbitMQ, ThrowawayRedis
from .harness import FaultRun, assert_invariants, play


def test_redis_without_persistence_restarted_mid_run(tmp_path, record_property):
    """The broker comes back empty: queued, prefetched and unacked messages are all gone (the
    restart comes while the consumer is stopped and sent messages wait in the queue). Delivery
    tracking publishes again every sent message no inbox acknowledged; the relay sends what could
    not be published while it was down."""
    database_url = require("postgres")
    with ThrowawayRedis(tmp_path / "redis", persistent=False) as redis:
        run = FaultRun("Redis restarted, no persistence", tmp_path, redis.url, database_url)
        run.at_progress(0.4, run.with_consumer_stopped(redis.restart))
        outcome = play(run, record_property)
        assert run.redelivered() > 0, f"{outcome.line()}: delivery tracking published nothing again"
        assert_invariants(outcome)


def test_rabbitmq_restarted_mid_run(tmp_path, record_property):
    """Every connection of producer, workers and beat is cut; durable queues and persistent
    messages survive the restart, and the clients reconnect."""
    database_url = require("postgres")
    with ThrowawayRabbitMQ(tmp_path / "rabbitmq") as rabbitmq:
        run = FaultRun("RabbitMQ restarted", tmp_path, rabbitmq.url, database_url)
        run.at_progress(0.4, rabbitmq.restart)
        assert_invariants(play(run, record_property))


def test_postgres_restarted_mid_run(tmp_path, record_property):
    """Every database connection is cut, the liveness locks of all nodes with them: claims that
    cannot be made go back to the broker, the producer tries its order again, recovery takes over
    the claims of nodes that look dead, and each effect still commits once."""
    redis_url = require("redis")
    with ThrowawayPostgres() as postgres:
        run = FaultRun("PostgreSQL restarted", tmp_path, redis_url, postgres.url)
        run.at_progress(0.4, postgres.restart)
        assert_invariants(play(run, record_property))
