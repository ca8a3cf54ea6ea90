"""Maintenance that beat and the CLI run: relay and recovery publish every stranded row again, cleanup
keeps the tables bounded, and dead letters are replayed or purged, each in short transactions."""
