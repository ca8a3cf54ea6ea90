"""The core every side stands on: the runtime of one app, its settings, sessions, this process's
node, crash points and the seam an integration joins through. No transaction of its own."""
