"""What each gRPC status code of a rollout server means to a client, in one place: the channel's
retries (``rollout_client.channel``), the pool's failover (``rollout_client.pool``) and a trainer's
retries of an iteration all read their codes from here.

| code | the server answers it when | channel retry | replica failure | server failure |
|---|---|---|---|---|
| RESOURCE_EXHAUSTED | its queue is full; another weight update is in progress | yes | yes | yes |
| UNAVAILABLE | it drains or is down; a rank died; a sync group failed; it is released | yes | yes | yes |
| INTERNAL | the model's velocity was not finite for a latent in range; an unexpected error | | yes | yes |
| ABORTED | a stream stalled past its write limit; a group update was dropped | | yes | yes |
| UNKNOWN, CANCELLED | (gRPC's own) a connection broke; a call was cancelled | | yes | yes |
| DEADLINE_EXCEEDED | the call's deadline passed; an upload went idle | | | yes |
| UNAUTHENTICATED, PERMISSION_DENIED | a token, or a prune's control token, is missing or refused | | | |
| INVALID_ARGUMENT | a field is wrong (BadRequest names it), also one whose values overflow a step | | | |
| FAILED_PRECONDITION | a stale version; a late prune; no weight-sync group; an update while released | | | |
| NOT_FOUND | no such rollout (a prune) or weights file | | | |

* **channel retry** (``CHANNEL_RETRIES``): gRPC retries a Rollout refused with these before its first
  message, under the client's ``RetryPolicy`` (never one that started: no rollout runs twice). A
  pool's replicas retry nothing: the pool re-runs the group on another replica at once.
* **replica failure** (``REPLICA_FAILURES``): the replica failed rather than the request. The pool
  re-runs the prompt group on another replica with the same seeds, and takes the replica out of
  routing unless it was only full (RESOURCE_EXHAUSTED).
* **server failure** (``SERVER_FAILURES``): a server that is down, restarting, overloaded or stuck
  rather than a bad request. A trainer retries its iteration after a pause. A replica that answers
  one of them to a pool's update (a deadline included) missed it: it leaves routing until the update
  is replayed on it. A rollout's DEADLINE_EXCEEDED the pool raises: the request's deadline passed.
* ``CALLER_ERRORS``: every other code. The same call gets the same answer until the caller changes
  it: a step that the request's own x_0, schedule, noise level or latent dtype takes out of range
  fails the same way on every replica, so the pool re-runs it nowhere. Of them,
  ``REFUSED_CREDENTIALS`` are raised even by the pool's health watcher, since waiting never mends
  them.

Imports grpc only, as ``rollout_client.channel`` does.
"""

import grpc

Code = grpc.StatusCode

CHANNEL_RETRIES = (Code.RESOURCE_EXHAUSTED, Code.UNAVAILABLE)  # in the service config's order
REPLICA_FAILURES = frozenset({*CHANNEL_RETRIES, Code.INTERNAL, Code.ABORTED, Code.UNKNOWN, Code.CANCELLED})
SERVER_FAILURES = REPLICA_FAILURES | {Code.DEADLINE_EXCEEDED}
CALLER_ERRORS = frozenset(Code) - SERVER_FAILURES - {Code.OK}
REFUSED_CREDENTIALS = frozenset({Code.UNAUTHENTICATED, Code.PERMISSION_DENIED})
