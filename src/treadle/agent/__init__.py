"""The conversation room: one token-exact path for both of treadle's doors.

    tokenizer.py     the tokenizer protocol, and Hugging Face tokenizer.json files
    chat/            chat formats (one protocol, one registry): Hermes, Qwen3
    context.py       one trajectory's token context: extensions, retries, new segments
    runner.py        where turns run (`TurnRunner`), sampling, one engine's runner
    conversation.py  context + record + the runner's events, exactly once
    loop.py          treadle's agent loop: the agent's rules over a conversation
    fingerprint.py   a tokenizer's identity, for trainers to compare theirs with

The harness gateway (`treadle.gateway.session`) is the other driver of the same
`Conversation`: it adds only the harness protocol.
"""
