"""kvplug inside LMCache."""
