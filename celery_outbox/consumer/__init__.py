"""The consumer side: the inbox claims each delivery, discards copies, dead-letters bad input.

Transaction boundary: a delivery is claimed in its body's transaction (optimistic) or in one that
commits just before the body (eager); a malformed message is dead-lettered in a transaction of its
own, never fatal.
"""
