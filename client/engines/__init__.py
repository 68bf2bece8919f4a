"""The engines the client serves: one folder per engine (its drop-in surface, plugin, sizing rules and group naming)."""
