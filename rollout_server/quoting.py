"""Client strings in log lines and error messages: escaped and cut, so none can forge a log line or
swell a message."""

# Client strings quoted in messages and logs are cut to this many characters.
MAX_QUOTED_CHARS = 120


def quoted(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """A client-supplied string made safe for a log line or an error message: escaped (no newline or
    control character survives, so it cannot forge a log line) and cut to ``limit`` characters."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
