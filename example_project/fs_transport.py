"""kombu's filesystem transport, with messages written atomically.

The stock transport creates a message file and then writes it; a worker polling in
between reads an empty file, loses the message and may die on a JSON error. Here a
message is written under a name no consumer matches and renamed into place.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic

from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = final + ".partial"  # ends differently, so _get() never picks it up
        with open(partial, "wb") as f:
            f.write(dumps(payload).encode())
        os.replace(partial, final)


class Transport(filesystem.Transport):
    Channel = Channel


TRANSPORT_ALIASES.setdefault("atomicfs", "example_project.fs_transport:Transport")
