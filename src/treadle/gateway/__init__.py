"""The harness gateway: an OpenAI-compatible door through which any agent harness
becomes a treadle agent loop (docs/gateway.md).

    render.py    chat formats: OpenAI messages as token pieces, replies as tool calls
    context.py   one session's token context: extend it, or begin a new segment
    wire.py      the OpenAI chat-completions request, its replies and its errors
    session.py   one session: its calls as scheduled turns, its end
    sessions.py  the open sessions: creation, ends, idle timeouts, sub-agents' credit
    harness.py   running a harness command for a session, and scoring what it did
"""
