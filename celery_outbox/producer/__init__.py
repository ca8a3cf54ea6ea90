"""The producer side: every send inside a unit of work is published only after its commit.

Transaction boundary: the unit of work's; a durable queue's message is stored in that same
transaction first, so it survives a broker outage and a crash of the sender.
"""
