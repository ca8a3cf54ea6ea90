"""``celery -A proj outbox audit``: the Spark delivery audit, started in a process of its own.

No transaction: the audit reads the archive (and the live tables) and writes only its outputs;
pyspark is imported only when it runs. It audits the stores ``--tenant`` or ``--all-tenants``
choose (``per_tenant``): a tenant's archive and outputs are its folders of ``--archive`` and
``--out`` (``tenant_folder``: ``tenants/<name>``), its live tables those of its store.
"""

from __future__ import annotations

import click

from ..core.tenancy import current_tenant, tenant_folder
from ..outbox import Outbox
from .group import Age, outbox, per_tenant


@outbox.command()


@click.option("--archive", help="The archive cleanup writes (default: outbox_archive_path); a path or a URI. "
              "A tenant's is its folder tenants/<name> in it.")


@click.option("--out", required=True, help="Folder (a path or a URI) for summary.json, report.html and "
              "aggregates/; a tenant's go to its folder tenants/<name> in it.")


@click.option("--jdbc-url", help="Also read the live tables (jdbc:postgresql:// or postgresql:// URL); "
              "'store' uses the store's database (outbox_database_url, or the tenant's).")


@click.option("--jdbc-jar", help="The PostgreSQL JDBC driver jar (default /usr/share/java/postgresql.jar).")


@click.option("--grace", type=Age(), default="1h", show_default=True,
              help="A sent message not handled after this long is lost.")


@click.option("--late-after", type=Age(), default="60s", show_default=True, help="Sent to handled beyond this is late.")


@click.option("--stuck-after", type=Age(), default="1h", show_default=True, help="A live row waiting longer is stuck.")


@click.option("--master", default="local[*]", show_default=True,
              help="Spark master; on a cluster (spark://, yarn...) the package is shipped to the executors.")


@click.option("--driver-memory", help="The Spark driver's heap, e.g. 6g (Spark's default: 1g). In local mode "
              "the driver does all the work.")


@click.option("--shuffle-partitions", type=click.IntRange(min=1),
              help="Partitions per shuffle (default: 4 per core, unless your Spark configuration sets them).")


@click.option("--verbose", is_flag=True, help="Spark's own log on the console, not in spark.log in --out.")


@click.option("--full", is_flag=True, help="Read the whole archive again, not only what the ledger in --out has "
              "not covered.")


@click.option("--no-ledger", is_flag=True, help="A one-off audit: read everything and keep no ledger in --out "
              "(about half the cost of a full run that keeps one).")


@click.option("--horizon", type=Age(), default="1d", show_default=True,
              help="How long after a message's newest row the ledger still matches repeats of its rows.")


@click.option("--now", type=click.DateTime(formats=["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"]),
              help="Audit as of this moment (ISO 8601, UTC unless it says; default: now).")


@per_tenant()


def audit(box: Outbox, archive, out, jdbc_url, jdbc_jar, grace, late_after, stuck_after, master, driver_memory,
          shuffle_partitions, verbose, full, no_ledger, horizon, now) -> None:
    """The delivery audit (Spark): lost, duplicated, late and dead-lettered messages; exit 1 when any is lost."""
    import importlib.util

    if jdbc_url not in (None, "store") and click.get_current_context().params.get("all_tenants"):
        raise click.UsageError("a --jdbc-url is one store's database: give --jdbc-url store with --all-tenants "
                               "(each store's own), or name the tenant with --tenant")
    missing = [name for name in ("pyspark", "pyarrow") if importlib.util.find_spec(name) is None]
    if missing:
        raise click.ClickException(f"the audit needs {' and '.join(missing)}: pip install 'celery-outbox[spark]'")
    from ..audit.job import main as audit_main

    archive = archive or box.settings.archive_path
    tenant, schema = current_tenant(), None
    if tenant is not None:
        archive, out = tenant_folder(archive, tenant) if archive else None, tenant_folder(out, tenant)
        store = box.runtime.store
        schema = store.schema
        if jdbc_url == "store":
            jdbc_url = store.engine.url.render_as_string(hide_password=False)
    elif jdbc_url == "store":
        jdbc_url = box.settings.database_url
    argv = ["--out", out, "--table-prefix", box.settings.table_prefix, "--grace", str(grace.total_seconds()),
            "--late-after", str(late_after.total_seconds()), "--stuck-after", str(stuck_after.total_seconds()),
            "--master", master, "--horizon", str(horizon.total_seconds())]
    if now is not None:
        argv += ["--now", now.isoformat()]
    for flag, value in (("--archive", archive), ("--jdbc-url", jdbc_url), ("--schema", schema),
                        ("--jdbc-jar", jdbc_jar), ("--driver-memory", driver_memory),
                        ("--shuffle-partitions", shuffle_partitions)):
        if value:
            argv += [flag, str(value)]
    raise SystemExit(audit_main(argv + ["--verbose"] * verbose + ["--full"] * full + ["--no-ledger"] * no_ledger))
