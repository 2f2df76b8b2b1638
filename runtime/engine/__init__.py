"""The engine: sessions, turns, the decode batch, the turn planner over the tiers, requests,
sampling, speculation, images and the cache state that moves between the device and the tiers."""
