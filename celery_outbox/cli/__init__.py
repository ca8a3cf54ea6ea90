"""``celery -A proj outbox ...``: the schema, maintenance, monitoring, dead-letter and audit commands.

Transaction boundary: none of its own; each command calls the ``Outbox`` method beat or start-up
calls, in that method's transactions, and only parses arguments and prints. An error of the
library (a bad setting, a database that cannot be reached) ends it with one line, exit code 1.
"""

from . import audit, commands, dead_letters  # noqa: F401 - each registers its commands on the group
from .group import outbox, printable

__all__ = ["outbox", "printable"]
