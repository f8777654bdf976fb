"""The control plane: NATS subjects, connections, calls, served endpoints, publishing, discovery.

- ``subjects``: every subject of a stack, and the queue groups;
- ``connection``: connecting (per-role inbox, reconnect policy);
- ``calls``: request/reply with failures made explicit (503 no responders, 504 timeout);
- ``service_api``: the NATS service API (``$SRV`` PING/INFO/STATS) with endpoints whose stats are true;
- ``publisher``: ordered publishing from engine-thread callbacks, and recently cancelled request ids;
- ``directory``: the one poller of the service API that everything else (routing, liveness,
  readiness, metrics) reads.
"""
