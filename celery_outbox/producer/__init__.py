"""The producer side: every send inside a unit of work is published only after its commit, and a
durable queue's message is stored in that same transaction first."""
