"""The tiers a runtime keeps state in: the SSD block store, the DRAM snapshot pool (in-process
or on Redis), their common interface and the self-describing records that leave the process."""
