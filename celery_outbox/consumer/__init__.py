"""The consumer side: each delivery is claimed in the inbox in the transaction of its body's writes,
copies are discarded, and a malformed message is dead-lettered, never fatal."""
