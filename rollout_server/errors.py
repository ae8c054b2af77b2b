"""The exceptions that cross the server's layers, in one place.

Each names an outcome a caller can act on; admission (``admission.py``) maps them to status codes
and the CLI (``cli.py``) to exit codes. Errors that one module raises and handles itself stay in it.
"""

# A rejection lists at most this many violations (the rest are counted): the list travels in the
# status trailer, which gRPC caps at a few KiB, and in the server log.
MAX_LISTED_VIOLATIONS = 20


class InvalidRequest(Exception):
    """One or more request fields are invalid: ``violations`` is a list of (field, description).

    Only the first ``MAX_LISTED_VIOLATIONS`` are kept, followed by a count of the others."""

    def __init__(self, violations: list[tuple[str, str]]):
        hidden = len(violations) - MAX_LISTED_VIOLATIONS
        self.violations = list(violations[:MAX_LISTED_VIOLATIONS])
        if hidden > 0:
            self.violations.append(("...", f"and {hidden} more violations"))
        super().__init__(
            "invalid request: " + "; ".join(f"{field}: {what}" for field, what in self.violations)
        )


class TextTooLong(Exception):
    """A text's tokens, once tokenised, are more than the model's encoding takes (``tokens`` above
    ``limit``): the memory estimate sizes a text's env by that bound. The prompt cache names the
    request field that held the text."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(f"{tokens} tokens once tokenised, above the {limit} this model takes")
        self.tokens, self.limit = tokens, limit


class UnknownRollout(Exception):
    """No running rollout has the request id a call names."""


class ForeignRollout(Exception):
    """A control call (PruneRollout) did not present the control token of the rollout it names: it
    comes from someone other than the rollout's caller."""


class PruneTooLate(Exception):
    """A prune reached its rollout after the last step (or after the rollout ended): nothing was
    left to stop."""


class Overloaded(Exception):
    """Too many rollouts are queued or running."""


class ShuttingDown(Exception):
    """The server stopped before the rollout or update could run."""


class MemoryReleased(Exception):
    """The weights' memory is released (or a release waits for the running rollouts): a rollout is
    refused until it is resumed, a weight update until then too."""


class NonFiniteStep(Exception):
    """A step produced NaN or infinity (a broken policy, or a model that overflows in its dtype): the
    rollout fails there instead of streaming numbers no trainer can use."""


class StaleUpdate(Exception):
    """The update's policy version is not above the server's current one."""


class UploadIdle(Exception):
    """The client sent nothing for longer than the server's upload idle timeout."""


class RankFailure(RuntimeError):
    """A collective failed: a rank died, hung past the timeout, or fell out of step."""


class WeightSyncFailed(Exception):
    """The weight-sync group could not be joined, or a broadcast on it failed or timed out: the
    update was not applied, and the group is gone."""


class NoWeightSyncGroup(Exception):
    """A group update came to a server that is in no weight-sync group."""


class UpdateAbandoned(Exception):
    """The trainer left a group update (it ended the call, or never sent its start) before any byte
    moved."""


class ParallelismUnsupported(Exception):
    """The model or the machine cannot run the requested split (no plan, heads, no kernel)."""


class UnsupportedModel(Exception):
    """The folder holds a pipeline no adapter supports."""


class StartupError(Exception):
    """An option the server cannot start with (a security file, an address); the message is the
    whole explanation."""
