"""``celery -A proj outbox ...``: the schema, maintenance, monitoring, dead-letter and audit commands.

Each command calls the same ``Outbox`` methods beat or start-up calls, in their transactions, and
only parses arguments and prints; an error of the library (a bad setting, a database that cannot
be reached) ends it with one line, exit code 1.
"""

from . import audit, commands, dead_letters  # noqa: F401 - each registers its commands on the group
from .group import outbox, printable

__all__ = ["outbox", "printable"]
