"""The demo's server-less broker: kombu's filesystem transport, with atomic writes.

kombu's own filesystem transport creates a message file and then writes into it, so a
consumer polling the folder can take the file while it is still empty and its worker's
consumer fails on the half-written JSON. This transport writes each message under a
hidden name and renames it into place (atomic on POSIX), so a reader only ever sees
whole messages. Registered as ``shopfs://`` by ``celery_app``.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        hidden = os.path.join(self.data_folder_out, f".{uuid.uuid4().hex}.writing")  # never matches a queue
        try:
            with open(hidden, "wb") as file:
                file.write(str_to_bytes(dumps(payload)))
            os.replace(hidden, os.path.join(self.data_folder_out, name))
        except OSError as exc:
            raise ChannelError(f"cannot add message {name!r} to {self.data_folder_out!r}: {exc}") from exc


class Transport(filesystem.Transport):
    Channel = Channel


def register() -> None:
    TRANSPORT_ALIASES.setdefault("shopfs", "example_project.broker:Transport")
