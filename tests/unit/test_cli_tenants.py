"""The operator commands per tenant (``--tenant NAME``, ``--all-tenants``), run in this process with
click's runner on SQLite files, one per tenant: which store each command works on, the headings
and the JSON that name the stores, usage errors, and a store that fails without stopping the
others. On PostgreSQL databases and schemas, as ``celery`` subprocesses:
tests/integration/test_cli_tenants.py."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from types import SimpleNamespace

import pytest
from celery import Celery
from click.testing import CliRunner, Result
from sqlalchemy import select

from celery_outbox import TENANT_HEADER, Outbox, using_tenant
from celery_outbox.cli import outbox as outbox_group
from celery_outbox.message.dead_letter_rows import dead_letter_row
from celery_outbox.store import Store, build_engine, utcnow
from celery_outbox.vocabulary import DeadLetterReason

TENANTS = ("acme", "globex")


@pytest.fixture
def urls(tmp_path) -> dict[str | None, str]:
    """The database of each store: None, the default one."""
    return {None: f"sqlite:///{tmp_path / 'default.db'}",
            **{name: f"sqlite:///{tmp_path / name}.db" for name in TENANTS}}


def tenant_outbox(urls: dict[str | None, str], **places: str) -> Outbox:
    """An outbox whose tenants are ``urls``' (``places`` replacing some)."""
    app = Celery(f"cli_tenants_{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    tenants = {name: url for name, url in urls.items() if name is not None}
    app.conf.update(outbox_database_url=urls[None], outbox_tenants={**tenants, **places}, task_default_queue="q")
    return Outbox(app)


def run(outbox: Outbox, *args: str) -> Result:
    """``celery -A ... outbox ARGS`` on ``outbox``'s app, in this process."""
    return CliRunner().invoke(outbox_group, list(args), obj=SimpleNamespace(app=outbox.app))


def store_of(outbox: Outbox, tenant: str | None) -> Store:
    """``tenant``'s store, its tables created."""
    with using_tenant(tenant):
        return outbox.ready().store


def pending_row(message_id: str, age: timedelta = timedelta(0)) -> dict:
    return {"message_id": message_id, "task_name": "tasks.late", "destination": "q", "body": b"[[], {}, {}]",
            "content_type": "application/json", "content_encoding": "utf-8", "exchange": "", "routing_key": "q",
            "headers": "{}", "properties": "{}", "created_at": utcnow() - age}


def store_rows(outbox: Outbox, tenant: str | None, outgoing: int = 0, dead_letters: int = 0,
               age: timedelta = timedelta(0)) -> None:
    store = store_of(outbox, tenant)
    with store.begin() as conn:
        if outgoing:
            store.insert_outgoing(conn, [pending_row(f"{tenant or 'default'}-{n}", age) for n in range(outgoing)])
        if dead_letters:
            store.insert_dead_letters(conn, [
                dead_letter_row(reason=DeadLetterReason.FAILED, failed_at=utcnow() - timedelta(minutes=1),
                                message_id=f"{tenant or 'default'}-dead-{n}", task_name="tasks.broken")
                for n in range(dead_letters)])


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_tenant_runs_migrate_on_that_tenants_database_alone(urls):
    outbox = tenant_outbox(urls)
    result = run(outbox, "migrate", "--tenant", "acme")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"store: {urls['acme']}"
    assert Store(build_engine(urls["acme"]), "celery_outbox_").missing_tables() == []
    for other in (None, "globex"):
        assert Store(build_engine(urls[other]), "celery_outbox_").missing_tables() != [], other


def test_all_tenants_runs_the_default_store_then_every_tenant_under_a_heading_each(urls):
    outbox = tenant_outbox(urls)
    result = run(outbox, "migrate", "--all-tenants")
    assert result.exit_code == 0, result.output
    headings = [line for line in result.stdout.splitlines() if line.startswith("==")]
    assert headings == ["== default store ==", "== tenant acme ==", "== tenant globex =="]
    stores = [line.removeprefix("store: ") for line in result.stdout.splitlines() if line.startswith("store: ")]
    assert stores == [urls[None], urls["acme"], urls["globex"]]
    for url in urls.values():
        assert Store(build_engine(url), "celery_outbox_").missing_tables() == []


def test_without_a_tenant_option_a_command_uses_the_default_store_and_its_json_names_no_tenant(urls):
    outbox = tenant_outbox(urls)
    store_rows(outbox, None, outgoing=1)
    store_rows(outbox, "acme", outgoing=3)
    report = json.loads(run(outbox, "status", "--json").stdout)
    assert (report["tenant"], report["store"], report["outgoing"][0]["count"]) == (None, urls[None], 1)
    assert "==" not in run(outbox, "status").stdout, "one store: no heading"


def test_the_json_of_each_store_names_its_tenant(urls):
    outbox = tenant_outbox(urls)
    store_rows(outbox, "acme", outgoing=3)
    result = run(outbox, "status", "--tenant", "acme", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["tenant"], report["outgoing"]) == ("acme", [{"status": "pending", "destination": "q", "count": 3}])
    every = run(outbox, "status", "--all-tenants", "--json")
    assert every.exit_code == 0, every.output
    reports = [json.loads(line) for line in every.stdout.splitlines()]  # one document per line, no heading
    assert [(each["tenant"], each["store"], [row["count"] for row in each["outgoing"]]) for each in reports] == [
        (None, urls[None], []), ("acme", urls["acme"], [3]), ("globex", urls["globex"], [])]


@pytest.mark.parametrize("command", [["status"], ["migrate"], ["check"], ["recover"], ["relay"], ["cleanup"],
                                     ["dead-letters", "list"], ["dead-letters", "purge", "--older-than", "1d"]])
def test_an_unknown_tenant_is_a_usage_error_naming_it(urls, command):
    outbox = tenant_outbox(urls)
    result = run(outbox, *command, "--tenant", "initech")
    assert result.exit_code == 2, result.output
    assert [line for line in result.stderr.splitlines() if line.startswith("Error:")] == [
        "Error: Invalid value for '--tenant': unknown tenant 'initech': outbox_tenants does not name it"]
    assert "Traceback" not in result.output and result.stdout == ""


def test_a_name_that_is_no_tenant_name_and_both_options_at_once_are_usage_errors(urls):
    outbox = tenant_outbox(urls)
    bad_name = run(outbox, "status", "--tenant", "../acme")
    assert bad_name.exit_code == 2 and "unknown tenant '../acme': it is not a tenant name" in bad_name.stderr
    both = run(outbox, "status", "--tenant", "acme", "--all-tenants")
    assert both.exit_code == 2 and "give --tenant NAME or --all-tenants, not both" in both.stderr


def test_one_tenants_store_failing_does_not_stop_the_others(urls, tmp_path):
    """globex's database cannot be opened: its failure is one line naming it, the stores after it
    still run, and the exit code is 1; in JSON, globex gets a document naming its error."""
    outbox = tenant_outbox({**urls, "globex": f"sqlite:///{tmp_path / 'missing' / 'globex.db'}",
                            "hooli": f"sqlite:///{tmp_path / 'hooli.db'}"})
    store_rows(outbox, "hooli", outgoing=2)
    result = run(outbox, "status", "--all-tenants")
    assert result.exit_code == 1, result.output
    assert [line for line in result.stdout.splitlines() if line.startswith(("==", "store: "))] == [
        "== default store ==", f"store: {urls[None]}", "== tenant acme ==", f"store: {urls['acme']}",
        "== tenant globex ==", "== tenant hooli ==", f"store: sqlite:///{tmp_path / 'hooli.db'}"]
    errors = result.stderr.splitlines()
    assert errors[0].startswith("Error: tenant globex: cannot use the message store at sqlite:///"), errors
    assert errors[-1] == "Error: 1 of 4 stores failed: tenant globex"
    assert "Traceback" not in result.output
    as_json = run(outbox, "status", "--all-tenants", "--json")
    assert as_json.exit_code == 1
    documents = json_lines(as_json.stdout)
    assert [each["tenant"] for each in documents] == [None, "acme", "globex", "hooli"]
    assert "cannot use the message store" in documents[2]["error"] and "outgoing" not in documents[2]
    assert documents[3]["outgoing"][0]["count"] == 2


def test_the_check_of_every_tenant_says_which_tenant_failed(urls, tmp_path):
    """acme has a message pending for two hours, globex's database cannot be opened, the default
    store is healthy: the check of all of them names each failure's tenant and exits 2 (a store
    down); acme's alone exits 1, the default store's 0."""
    outbox = tenant_outbox(urls, globex=f"sqlite:///{tmp_path / 'missing' / 'globex.db'}")
    store_rows(outbox, "acme", outgoing=1, age=timedelta(hours=2))
    result = run(outbox, "check", "--all-tenants", "--stuck-after", "3h")
    assert result.exit_code == 2, result.output
    lines = result.stdout.splitlines()
    assert lines[:2] == ["== default store ==", "OK"], lines
    assert lines[3] == "== tenant acme ==" and lines[4].startswith(
        "FAIL pending_age (tenant acme): the oldest pending outgoing message waits for 72"), lines
    assert lines[6] == "== tenant globex ==" and lines[7].startswith(
        "FAIL store (tenant globex): the message store did not answer"), lines
    assert result.stderr.splitlines()[-1] == "Error: 2 of 3 stores failed: tenant acme, tenant globex"
    acme = run(outbox, "check", "--tenant", "acme", "--stuck-after", "3h")
    assert acme.exit_code == 1 and acme.stdout.startswith("FAIL pending_age (tenant acme)"), acme.output
    default = run(outbox, "check")
    assert (default.exit_code, default.stdout.strip()) == (0, "OK")
    as_json = run(outbox, "check", "--all-tenants", "--json", "--stuck-after", "3h")
    assert as_json.exit_code == 2
    assert [(each["tenant"], each["ok"], [f["condition"] for f in each["failures"]])
            for each in json_lines(as_json.stdout)] == [
        (None, True, []), ("acme", False, ["pending_age"]), ("globex", False, ["store"])]


def test_the_liveness_check_of_a_tenant_reaches_that_tenants_database(urls, tmp_path):
    """The liveness probe reads in a thread of its own: it still reaches the chosen tenant's store."""
    outbox = tenant_outbox(urls, globex=f"sqlite:///{tmp_path / 'missing' / 'globex.db'}")
    down = run(outbox, "check", "--liveness", "--tenant", "globex")
    assert down.exit_code == 2 and down.stdout.startswith("FAIL store (tenant globex): "), down.output
    up = run(outbox, "check", "--liveness", "--tenant", "acme")
    assert (up.exit_code, up.stdout.strip()) == (0, "OK"), up.output


def test_the_dead_letter_commands_work_on_the_chosen_store(urls):
    outbox = tenant_outbox(urls)
    store_rows(outbox, None, dead_letters=1)
    store_rows(outbox, "acme", dead_letters=2)
    listed = run(outbox, "dead-letters", "list", "--tenant", "acme", "--json")
    assert listed.exit_code == 0, listed.output
    assert [(each["message_id"], each["tenant"]) for each in json_lines(listed.stdout)] == [
        ("acme-dead-0", "acme"), ("acme-dead-1", "acme")]
    every = run(outbox, "dead-letters", "list", "--all-tenants", "--json")
    assert every.exit_code == 0, every.output
    assert [(each["message_id"], each["tenant"]) for each in json_lines(every.stdout)] == [
        ("default-dead-0", None), ("acme-dead-0", "acme"), ("acme-dead-1", "acme")]
    text = run(outbox, "dead-letters", "list", "--all-tenants").stdout
    assert text.index("== default store ==") < text.index("default-dead-0") < text.index("== tenant acme ==") \
        < text.index("acme-dead-1") < text.index("== tenant globex ==")

    acme_id = str(json_lines(listed.stdout)[1]["id"])
    shown = run(outbox, "dead-letters", "show", acme_id, "--tenant", "acme")
    assert shown.exit_code == 0 and "message_id: acme-dead-1" in shown.stdout, shown.output
    for ids_everywhere in (["show", acme_id], ["replay", acme_id]):
        refused = run(outbox, "dead-letters", *ids_everywhere, "--all-tenants")
        assert refused.exit_code == 2, refused.output
        assert "dead letter ids are those of one store: name it with --tenant" in refused.stderr

    purged = run(outbox, "dead-letters", "purge", "--older-than", "0s", "--all-tenants")
    assert purged.exit_code == 0, purged.output
    assert [line for line in purged.stdout.splitlines() if line.startswith("purged")] == [
        "purged 1 dead letter(s)", "purged 2 dead letter(s)", "purged 0 dead letter(s)"]


def outgoing_of(outbox: Outbox, tenant: str | None) -> list:
    """Every outgoing row of ``tenant``'s store."""
    store = store_of(outbox, tenant)
    with store.begin() as conn:
        return conn.execute(select(store.tables.outgoing)).all()


def test_replay_refuses_an_unknown_tenants_letter_until_the_tenant_is_configured_then_sends_it_there(urls, tmp_path):
    """The consumer's guard kept a message naming hooli in the default store. Replayed while
    outbox_tenants does not name hooli: refused with the reason (exit code 1), the letter kept,
    nothing stored. Replayed by a process whose outbox_tenants names it: stored and published
    from hooli's store, the letter counted replayed, nothing stored in the default store."""
    before = tenant_outbox(urls)
    store = store_of(before, None)
    with store.begin() as conn:
        store.insert_dead_letters(conn, [dead_letter_row(
            reason=DeadLetterReason.UNKNOWN_TENANT, failed_at=utcnow(), message_id="stray-1", task_name="tasks.late",
            queue="q", routing_key="q", body=b"[[], {}, {}]", content_type="application/json",
            content_encoding="utf-8", headers={"id": "stray-1", "task": "tasks.late", TENANT_HEADER: "hooli"},
            description="it names tenant 'hooli', which outbox_tenants does not know")])
    (letter,) = store.list_dead_letters(store.dead_letter_filter())

    refused = run(before, "dead-letters", "replay", "--all", "--reason", "unknown_tenant")
    assert refused.exit_code == 1, refused.output
    assert "replayed 0 dead letter(s)" in refused.stdout
    assert (f"refused dead letter {letter.id}: unknown tenant 'hooli': outbox_tenants does not name it; the letter "
            "is kept") in refused.stderr
    assert store.get_dead_letter(letter.id).replay_count == 0
    assert outgoing_of(before, None) == []

    after = tenant_outbox(urls, hooli=f"sqlite:///{tmp_path / 'hooli.db'}")
    replayed = run(after, "dead-letters", "replay", str(letter.id))
    assert replayed.exit_code == 0, replayed.output
    assert "replayed 1 dead letter(s)" in replayed.stdout
    (row,) = outgoing_of(after, "hooli")
    assert (row.message_id, json.loads(row.headers)[TENANT_HEADER]) == ("stray-1", "hooli")
    assert row.sent_at is not None, "published after its commit"
    assert outgoing_of(after, None) == []
    assert store_of(after, None).get_dead_letter(letter.id).replay_count == 1


def test_the_maintenance_passes_run_on_the_chosen_stores(urls):
    """acme has two rows whose publish never happened: ``relay --tenant acme`` publishes them; the
    recover and cleanup passes of every store each name their tenant."""
    outbox = tenant_outbox(urls)
    store_rows(outbox, "acme", outgoing=2)
    relayed = run(outbox, "relay", "--tenant", "acme")
    assert relayed.exit_code == 0, relayed.output
    with using_tenant("acme"):
        assert outbox.status()["outgoing"] == [{"status": "sent", "destination": "q", "count": 2}]
    for command in ("recover", "cleanup"):
        result = run(outbox, command, "--all-tenants", "--json")
        assert result.exit_code == 0, result.output
        assert [each["tenant"] for each in json_lines(result.stdout)] == [None, "acme", "globex"]
    single = json.loads(run(outbox, "recover", "--tenant", "globex", "--json").stdout)
    assert single["tenant"] == "globex"
