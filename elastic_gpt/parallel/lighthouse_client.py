"""The training side's half of the replica groups' Lighthouse (C7 all-or-nothing step): its
`Leave`.

torchft's own Lighthouse protocol (`Quorum`, `Heartbeat`) is spoken by torchft's Manager. The one
request this project adds, `Leave` (a group's rank 0 says it takes part in no more steps, so the
others' next quorum need not wait for its heartbeat to time out), is named and encoded here, once:
the server (`elastic_gpt/elastic/lighthouse.py`, run by the driver) registers what this module
names, and `ReplicaGroup.leave` (`parallel/replicate.py`) calls it. It sits below both: the
training side needs no part of the server, and nothing here imports Ray or torch.
"""

from __future__ import annotations

import json
import logging
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

LEAVE_SERVICE = "elastic_gpt.Lighthouse"
"""The gRPC service beside torchft's `torchft.LighthouseService` that holds `Leave`."""
LEAVE = "Leave"
LEAVE_METHOD = f"/{LEAVE_SERVICE}/{LEAVE}"


def encode(message: dict) -> bytes:
    """`Leave`'s request and response on the wire: JSON (no generated protobuf code)."""
    return json.dumps(message).encode()


decode = json.loads


class LighthouseClient:
    """A group's line to the Lighthouse's `Leave`, connected when made: a drained group's word
    should cost the others no connection set-up."""

    def __init__(self, lighthouse: str):
        import grpc

        self._grpc = grpc
        self._channel = grpc.insecure_channel(urlsplit(lighthouse).netloc or lighthouse)
        grpc.channel_ready_future(self._channel)  # starts connecting; nothing waits for it
        self._leave = self._channel.unary_unary(
            LEAVE_METHOD, request_serializer=encode, response_deserializer=decode)

    def leave(self, replica_id: str, timeout_s: float = 2.0) -> bool:
        """Tell the Lighthouse that `replica_id` takes part in no more quorums. Best effort: False
        if it could not be told (the probe or the heartbeat timeout then does the same, later)."""
        try:
            self._leave({"replica_id": replica_id}, timeout=timeout_s)
            return True
        except self._grpc.RpcError as e:
            log.warning("could not tell the Lighthouse that %s left: %s", replica_id, e.code())
            return False

    def close(self) -> None:
        self._channel.close()
