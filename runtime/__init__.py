"""Runtime: loads artifacts, owns the caches and tiers, drives phases."""
